"""The bounds check tests itself: planted out-of-bounds kernels caught, correct kernels not.

Part of ``python -m conformance selftest`` (:mod:`conformance.planted.selftest`). With
the bounds check on, the project's Triton backend must pass in strict mode;
each backend of :data:`conformance.planted.kernels.PLANTED_BOUNDS` must fail,
as a ``bounds`` failure, in the mode it is planted for; and the one whose
only bug is reading padding must pass the default mode, which allows that
(:data:`spec.batch.PADDING_RULE`). Short examples only, few of them, without
shrinking: each costs an interpreted kernel per layer and step.

Where no Triton kernel can be checked (no interpreter), it says so and checks
nothing: the rest of the self-test does not need a kernel.
"""

from __future__ import annotations

from collections.abc import Callable

from conformance.bounds.checker import unusable
from conformance.run.control import RunControl
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from spec.backend import Backend

SEED = 20240601
EXAMPLES = 4
"""Short examples per run: the planted kernels fail within the first two."""


def bounds_selftest(out: Callable[[str], None] = print) -> bool:
    """Print one line per run; True when the correct kernels pass and every planted one fails."""
    try:
        import backend_gpu  # noqa: F401  (on a CPU-only machine: TRITON_INTERPRET, before triton)
    except ImportError as err:
        why: str | None = f"the Triton backend cannot be imported: {err}"
    else:
        why = unusable()
    if why is not None:
        out(f"  bounds check: not run here ({why})")
        return True
    from backend_gpu.triton_backend import TritonBackend
    from conformance.planted.kernels import PLANTED_BOUNDS, ReadsOnePastARow

    triton = _run(TritonBackend(device="cpu"), "triton", "strict")
    ok = _correct(out, "triton --check-bounds strict", triton)
    padding = _run(ReadsOnePastARow(), "conformance.planted.kernels:ReadsOnePastARow", "default")
    ok &= _correct(out, "ReadsOnePastARow --check-bounds default (padding reads allowed)", padding)
    caught = 0
    for label, (cls, mode) in PLANTED_BOUNDS.items():
        result = _run(cls(), f"conformance.planted.kernels:{cls.__name__}", mode)
        diff = result.difference
        if diff is not None and diff.what == "bounds":
            caught += 1
            first = diff.describe().splitlines()[0]
            out(f"  caught  {label} (--check-bounds {mode})\n          {first}")
        else:
            got = "passed" if diff is None else diff.describe().splitlines()[0]
            out(f"  MISSED  {label} (--check-bounds {mode}): {got}")
    out(f"bounds check: caught {caught}/{len(PLANTED_BOUNDS)}")
    return ok and caught == len(PLANTED_BOUNDS)


def _run(backend: Backend, ref: str, mode: str) -> RunResult:
    control = RunControl(shrink=False, long_examples=0, check_bounds=mode, every_pass=False)
    return run_suite(
        backend,
        ref,
        run_seed=SEED,
        database=None,
        max_examples=EXAMPLES,
        control=control,
        passes=("short",),
    )


def _correct(out: Callable[[str], None], label: str, result: RunResult) -> bool:
    if result.passed:
        checked = "" if result.bounds is None else f" ({result.bounds.summary})"
        out(f"  correct backend {label}: passes{checked}")
        return True
    out(f"  correct backend {label}: FLAGGED (a false alarm)")
    if result.difference is not None:
        out(result.difference.describe())
    return False
