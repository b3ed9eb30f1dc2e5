"""The suite tests itself: every planted bug must be caught, and no correct backend flagged.

Runs the quick profile, with a fixed seed and without shrinking (finding is
what is tested here; shrinking is tested in the project's own tests), against
each backend of :data:`conformance.planted.backends.PLANTED`, and against the correct
numpy backend (as the base of the latent bugs too, declaring the latent layout)
and the spec's reference backend, which must pass. A planted
bug that names ``selftest_passes`` (the KV cache group bugs: only the groups
pass draws groups) runs those passes alone: each pass is seeded on its own,
so the pass draws what it would draw in the whole run. Then the bounds check
against planted out-of-bounds kernels and the project's Triton backend
(:mod:`conformance.planted.selftest_bounds`), the device-resident contract against a
planted stale-metadata bug (:mod:`conformance.planted.device`), and the
scheduler suite against its planted schedulers
(:mod:`conformance.planted.selftest_scheduler`). The bugs planted in the real Triton
kernels (:mod:`conformance.planted.kernel_bugs`) run on the Triton backend, interpreted
under the H200's launch plan, each in the passes that reach its path.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import replace

from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.planted.backends import PLANTED
from conformance.planted.device import device_selftest
from conformance.planted.hidden import PLANTED_HIDDEN, RoundingHidesOverflow
from conformance.planted.selftest_bounds import bounds_selftest
from conformance.planted.selftest_scheduler import scheduler_selftest
from conformance.run.control import RunControl
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from spec.backend import ReferenceBackend

SELFTEST_SEED = 20240601
FIRST_FAILURE = RunControl(shrink=False, every_pass=False)
"""Finding is what is tested: each run stops at its first failure, unshrunk."""


def selftest(out: Callable[[str], None] = print) -> bool:
    """Print one line per backend and ``caught N/N``; True when every bug is caught."""
    start = time.monotonic()
    ok = True
    correct = (
        ("reference", ReferenceBackend()),
        ("numpy", NumpyPagedBackend()),
        ("numpy-latent", NumpyPagedBackend(latent=None)),  # the base of the latent bugs
    )
    for name, backend in correct:
        result = run_suite(
            backend, name, run_seed=SELFTEST_SEED, database=None, control=FIRST_FAILURE
        )
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
            cls(), ref, run_seed=SELFTEST_SEED, database=None, control=FIRST_FAILURE, passes=passes
        )
        if result.nondeterminism is not None:  # a deterministic planted bug: a false verdict
            out(f"  FALSE VERDICT  {label}: reported as not deterministic")
        elif result.difference is not None:
            caught += 1
            first = result.difference.describe().splitlines()[0]
            found = result.failures[0].pass_name if result.failures else "?"
            where = f"in pass {found}, example {result.stats.first_failure_example}"
            out(f"  caught  {label}\n          {where}: {first}")
        else:
            out(f"  MISSED  {label} ({ref})")
    caught += _hidden_selftest(out)
    kernel_caught, kernel_total = _kernel_selftest(out)
    caught += kernel_caught
    total = len(PLANTED) + len(PLANTED_HIDDEN) + kernel_total
    out(f"caught {caught}/{total} in {time.monotonic() - start:.1f} s")
    bounds_ok = bounds_selftest(out)
    device_ok = device_selftest(out)
    schedulers_ok = scheduler_selftest(out)
    return ok and caught == total and bounds_ok and device_ok and schedulers_ok


def _kernel_selftest(out: Callable[[str], None]) -> tuple[int, int]:
    """The bugs planted in the real kernels: how many caught, of how many run, each with where
    and on which observed path (the failing call's, as its report says). Without Triton
    (a base or torch-only install) there is no kernel to plant them in: said, and not run."""
    if importlib.util.find_spec("triton") is None:
        out("  NOT RUN  the bugs planted in the real Triton kernels: triton is not installed "
            "(pip install 'paged-spec[gpu]')")  # fmt: skip
        return 0, 0
    from conformance.planted.kernel_bugs import PLANTED_KERNELS

    caught = 0
    for label, cls in PLANTED_KERNELS.items():
        ref = f"conformance.planted.kernel_bugs:{cls.__name__}"
        control = replace(FIRST_FAILURE, check_bounds=cls.selftest_bounds)
        result = run_suite(
            cls(), ref, run_seed=SELFTEST_SEED, database=None, control=control,
            passes=cls.selftest_passes,
        )  # fmt: skip
        diff = result.difference
        if diff is None or result.nondeterminism is not None:
            why = "passed" if diff is None else "reported as not deterministic"
            out(f"  MISSED  {label} ({ref}): {why}")
            continue
        caught += 1
        found = result.failures[0].pass_name if result.failures else "?"
        path = "" if diff.numerics is None else diff.numerics.attention_path or ""
        on = f"; path: {path}" if path else ""
        first = diff.describe().splitlines()[0]
        where = f"in pass {found}, example {result.stats.first_failure_example}{on}"
        out(f"  caught  {label} (a real kernel)\n          {where}: {first}")
    return caught, len(PLANTED_KERNELS)


def _hidden_selftest(out: Callable[[str], None]) -> int:
    """The every-pass and NaN-replay checks (:mod:`conformance.planted.hidden`): how many caught.

    A two-bug backend must fail in each of its passes (the run judges every
    pass); a NaN-output backend must fail as a difference, not as a backend
    that is not deterministic.
    """
    caught = 0
    for label, cls in PLANTED_HIDDEN.items():
        ref = f"conformance.planted.hidden:{cls.__name__}"
        every = cls is RoundingHidesOverflow
        control = RunControl(shrink=False, every_pass=every)
        passes = getattr(cls, "selftest_passes", None)
        result = run_suite(
            cls(), ref, run_seed=SELFTEST_SEED, database=None, control=control, passes=passes
        )
        why = _hidden_missed(result, passes if every else None)
        if why is None:
            caught += 1
            lines = [f.headline() for f in result.failures]
            out(f"  caught  {label}\n          " + "\n          ".join(lines))
        else:
            out(f"  MISSED  {label} ({ref}): {why}")
    return caught


def _hidden_missed(result: RunResult, passes: tuple[str, ...] | None) -> str | None:
    """Why a hidden-bug run does not count as caught, or None."""
    if result.difference is None:
        return "passed"
    if result.nondeterminism is not None:
        return "reported as not deterministic"
    failed = {f.pass_name for f in result.failures}
    missing = [p for p in passes or () if p not in failed]
    return f"no failure reported in pass {', '.join(missing)}" if missing else None
