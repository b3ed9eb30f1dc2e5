"""The suite tests itself: every planted bug must be caught, and no correct backend flagged.

Runs the quick profile, with a fixed seed and without shrinking (finding is
what is tested here; shrinking is tested in the project's own tests), against
each backend of :data:`conformance.planted.backends.PLANTED`, and against the correct
numpy backend and the spec's reference backend, which must pass. A planted
bug that names ``selftest_passes`` (the KV cache group bugs: only the groups
pass draws groups) runs those passes alone: each pass is seeded on its own,
so the pass draws what it would draw in the whole run. Then the bounds check
against planted out-of-bounds kernels and the project's Triton backend
(:mod:`conformance.planted.selftest_bounds`), the device-resident contract against a
planted stale-metadata bug (:mod:`conformance.planted.device`), and the
scheduler suite against its planted schedulers
(:mod:`conformance.planted.selftest_scheduler`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.planted.backends import PLANTED
from conformance.planted.device import device_selftest
from conformance.planted.selftest_bounds import bounds_selftest
from conformance.planted.selftest_scheduler import scheduler_selftest
from conformance.run.runner import run_suite
from spec.backend import ReferenceBackend

SELFTEST_SEED = 20240601


def selftest(out: Callable[[str], None] = print) -> bool:
    """Print one line per backend and ``caught N/N``; True when every bug is caught."""
    start = time.monotonic()
    ok = True
    for name, backend in (("reference", ReferenceBackend()), ("numpy", NumpyPagedBackend())):
        result = run_suite(backend, name, run_seed=SELFTEST_SEED, database=None, shrink=False)
        ok &= result.passed
        status = "passes" if result.passed else "FLAGGED (a false alarm)"
        out(f"  correct backend {name}: {status}")
        if result.difference is not None:
            out(result.difference.describe())
    caught = 0
    for label, cls in PLANTED.items():
        ref = f"conformance.planted.backends:{cls.__name__}"
        passes = getattr(cls, "selftest_passes", None)  # a bug only one pass can show
        result = run_suite(
            cls(), ref, run_seed=SELFTEST_SEED, database=None, shrink=False, passes=passes
        )
        if result.difference is not None:
            caught += 1
            first = result.difference.describe().splitlines()[0]
            where = f"in example {result.stats.first_failure_example}"
            out(f"  caught  {label}\n          {where}: {first}")
        else:
            out(f"  MISSED  {label} ({ref})")
    out(f"caught {caught}/{len(PLANTED)} in {time.monotonic() - start:.1f} s")
    bounds_ok = bounds_selftest(out)
    device_ok = device_selftest(out)
    schedulers_ok = scheduler_selftest(out)
    return ok and caught == len(PLANTED) and bounds_ok and device_ok and schedulers_ok
