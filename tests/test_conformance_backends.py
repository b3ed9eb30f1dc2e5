"""The project's own backends under the suite: the spec itself, eager PyTorch, and Triton.

``make conformance`` runs the full quick profile on Triton; here each backend
gets a short run so that ``make test`` stays fast.
"""

from __future__ import annotations

import pytest

from conformance.reports.report import text_report
from conformance.run.discovery import load_backend
from conformance.run.runner import run_suite

SHORT_RUNS = {"reference": 40, "torch": 20, "triton": 8}


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(SHORT_RUNS))
def test_builtin_backend_conforms(name: str) -> None:
    backend = load_backend(name)  # torch and triton are imported only here
    result = run_suite(backend, name, run_seed=2024, database=None, max_examples=SHORT_RUNS[name])
    assert result.passed, text_report(result)
    assert result.stats.steps > 0
