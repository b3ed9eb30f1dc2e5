"""Benchmarks, each printing its figures beside a baseline: ``python -m benchmarks.NAME``.

Not installed with the package; run from the repository root.
"""
