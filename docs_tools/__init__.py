"""The documentation build: generated console outputs, diagrams, screenshots, API extension.

Not installed with the package; run from the repository root (``python -m docs_tools.NAME``).
"""
