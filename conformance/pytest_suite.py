"""The suite under plain pytest, for the backend named by ``PAGED_SPEC_BACKEND``::

    PAGED_SPEC_BACKEND=my_pkg.backend:make pytest --pyargs conformance.pytest_suite

The variable takes what ``--backend`` takes: an installed name, ``module:factory``
or ``path/to/file.py:factory``. The other ``PAGED_SPEC_*`` variables
(:data:`conformance.run.control.ENVIRONMENT`) set the profile, seed, examples,
dtypes, long examples, time budget, shrinking, the per-call timeout and the
bounds check (``PAGED_SPEC_CHECK_BOUNDS``). The lockstep runs in a child
process, as ``python -m conformance run`` does, so a crash or a hang of the
backend is reported as a failure of that test.
"""

from __future__ import annotations

import os

import pytest

from conformance.errors import SetupError
from conformance.run.discovery import ENV_VAR, load_backend
from conformance.testing import BackendConformance
from spec.backend import Backend


class TestBackendFromEnvironment(BackendConformance):
    """:class:`BackendConformance` against the backend ``PAGED_SPEC_BACKEND`` names."""

    conformance_isolated = True

    @pytest.fixture
    def backend(self) -> Backend:
        ref = os.environ.get(ENV_VAR)
        if not ref:
            pytest.fail(f"set {ENV_VAR} to NAME, module:factory or file.py:factory", pytrace=False)
        try:
            backend = load_backend(ref)
        except SetupError as err:
            pytest.fail(f"{ENV_VAR}={ref}: {err}", pytrace=False)
        self.backend_ref = ref
        return backend
