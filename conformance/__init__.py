"""A conformance suite for paged KV memory and attention: any backend against the spec.

Hypothesis drives the spec and the backend in lockstep through random
workloads (prefills, chunked prefills, decodes, forks with copy-on-write,
frees, prefix-cache hits, allocation failures) and compares, after every step,
the backend's whole KV cache bit for bit and its attention outputs within the
dtype's tolerance. A failure is shrunk to a minimal workload, printed as a
script that replays it.

Three ways in (see docs/plugging-in.md):

* ``paged-spec run --backend NAME_OR_module:factory`` (or ``python -m conformance run``);
* ``pytest --paged-backend module:factory`` (the installed pytest plugin), or
  ``PAGED_SPEC_BACKEND=module:factory pytest --pyargs conformance.pytest_suite``;
* subclass :class:`conformance.testing.BackendConformance` in your own tests.
"""

from conformance.errors import SetupError
from conformance.judges.compare import Difference
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.workload import WorkloadConfig
from conformance.run.discovery import ENV_VAR, installed_backends, load_backend
from conformance.run.profiles import PROFILES
from conformance.run.result import RunResult
from conformance.run.runner import run_suite

__all__ = [
    "ENV_VAR",
    "PROFILES",
    "ConformanceFailure",
    "Difference",
    "Lockstep",
    "RunResult",
    "SetupError",
    "WorkloadConfig",
    "installed_backends",
    "load_backend",
    "run_suite",
]
