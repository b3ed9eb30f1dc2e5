"""The suite under pytest, for the backend ``--paged-backend`` or ``PAGED_SPEC_BACKEND`` names::

    pytest --paged-backend my_pkg.backend:make                   # the plugin (pytest11 entry point)
    PAGED_SPEC_BACKEND=my_pkg.backend:make pytest --pyargs conformance.pytest_suite

Both take what ``--backend`` takes: an installed name, ``module:factory`` or
``path/to/file.py:factory``. The plugin (:mod:`paged_spec.pytest_plugin`)
collects this module itself, with the ``--paged-*`` options, and names the
backend (and the shard) in each node id. The ``PAGED_SPEC_*`` variables
(:data:`conformance.run.control.ENVIRONMENT`) set the profile, seed, examples,
dtypes, long examples, time budget, shrinking, the per-call timeout and the
bounds check (``PAGED_SPEC_CHECK_BOUNDS``), over the options. The lockstep
runs in a child process, as ``paged-spec run`` does, so a crash or a hang of
the backend is reported as a failure of that test.
"""

from __future__ import annotations

import os

import pytest

from conformance.errors import SetupError
from conformance.pytest_runs import PagedRun
from conformance.run.discovery import ENV_VAR, load_backend
from conformance.testing import BackendConformance
from spec.backend import Backend


@pytest.fixture
def paged_run(request: pytest.FixtureRequest) -> PagedRun:
    """This test's run: the plugin's parameter (``--paged-backend``), or ``PAGED_SPEC_BACKEND``."""
    param = getattr(request, "param", None)
    if isinstance(param, PagedRun):
        return param
    ref = os.environ.get(ENV_VAR)
    if not ref:
        pytest.fail(
            f"set {ENV_VAR} to NAME, module:factory or file.py:factory (or use --paged-backend)",
            pytrace=False,
        )
    return PagedRun(ref, source=ENV_VAR)


class TestBackendFromEnvironment(BackendConformance):
    """:class:`BackendConformance` against the backend ``--paged-backend`` or the variable names."""

    conformance_isolated = True

    @pytest.fixture
    def backend(self, paged_run: PagedRun) -> Backend:
        try:
            backend = load_backend(paged_run.ref)
        except SetupError as err:
            pytest.fail(f"{paged_run.source}={paged_run.ref}: {err}", pytrace=False)
        paged_run.apply(self)
        return backend
