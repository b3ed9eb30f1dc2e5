"""The documentation build: generated console outputs, diagrams, screenshots, API extension,
and the sandbox page's runtime (``sandbox_site``, a mkdocs hook) and browser check.

Not installed with the package; run from the repository root (``python -m docs_tools.NAME``).
"""
