"""The scheduler suite tests itself: every planted scheduler bug caught, no correct one flagged.

Runs the quick profile, with a fixed seed and without shrinking (finding is
what is tested here; the project's tests shrink and replay each one), against
the spec's :class:`~spec.scheduler.ContinuousScheduler`, which must pass, and
each scheduler of :data:`conformance.planted.schedulers.PLANTED`, which
must fail; those of :data:`~conformance.planted.schedulers.ENGINE_ONLY`
must fail the token-exact check, the one only the engine loop makes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from conformance.planted.schedulers import ENGINE_ONLY, PLANTED
from conformance.scheduler.engine import EQUIVALENCE
from conformance.scheduler.suite import SchedulerFactory, run_scheduler_suite
from spec.scheduler import ContinuousScheduler

SELFTEST_SEED = 20240601
CORRECT: dict[str, SchedulerFactory] = {"spec.scheduler:ContinuousScheduler": ContinuousScheduler}


def scheduler_selftest(out: Callable[[str], None] = print) -> bool:
    """Print one line per scheduler and ``caught N/N``; True when every bug is caught."""
    start = time.monotonic()
    ok = True
    for ref, make in CORRECT.items():
        result = run_scheduler_suite(make, ref, run_seed=SELFTEST_SEED, database=None, shrink=False)
        ok &= result.passed
        verdict = "passes" if result.passed else "FLAGGED (a false alarm)"
        out(f"  correct scheduler {ref}: {verdict}")
        if result.failure is not None:
            out(f"          {result.failure.rule}: {result.failure}")
    caught = 0
    for label, make in PLANTED.items():
        ref = f"conformance.planted.schedulers:{getattr(make, '__name__', make)}"
        result = run_scheduler_suite(make, ref, run_seed=SELFTEST_SEED, database=None, shrink=False)
        failure = result.failure
        if failure is not None and (make not in ENGINE_ONLY or failure.rule == EQUIVALENCE):
            caught += 1
            where = f"in example {result.stats.first_failure_example}"
            out(f"  caught  {label}\n          {where}: {failure.rule}: {failure}")
        else:
            out(f"  MISSED  {label} ({ref})")
    out(f"schedulers: caught {caught}/{len(PLANTED)} in {time.monotonic() - start:.1f} s")
    return ok and caught == len(PLANTED)
