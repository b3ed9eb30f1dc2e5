"""Each failure replayed once more: the same outcome, or a backend that is not deterministic.

The failing workload is run again as its replay script runs it
(:func:`conformance.run.replay.script`); the two outcomes are the same when
they are the same kind of difference at the same place with the same values
(NaN equal to NaN, a bounds failure's counts aside: the checker counts what
it saw, not what it refused).
"""

from __future__ import annotations

import re
from dataclasses import replace

from conformance.judges.compare import Difference
from conformance.lockstep.driver import ConformanceFailure
from conformance.run.replay import script as replay_script
from conformance.run.result import RunResult, restore
from conformance.watchdog import CallTimeout, RunWatch
from spec.backend import Backend


def judge_replays(result: RunResult, backend: Backend, watch: RunWatch) -> None:
    """Replay each failure (same outcome, or not deterministic); the first is the headline."""
    judged = []
    for failure in result.failures:
        restore(result, failure)
        check_replay(result, backend, watch)
        judged.append(replace(failure, nondeterminism=result.nondeterminism))
    result.failures[:] = judged
    if judged:
        restore(result, judged[0])


def check_replay(result: RunResult, backend: Backend, watch: RunWatch) -> None:
    """Replay the failing workload: the same outcome, or the backend is not deterministic."""
    if result.difference is None or result.difference.what in ("hang", "crash", "internal"):
        return
    first = result.difference
    try:
        again = replay(result, backend)
    except CallTimeout:
        call = watch.timed_out
        step = 0 if call is None else call.step
        again = Difference("hang", step, "a backend call hung on replay")
    except Exception as err:  # a replay script that does not run is worth knowing about
        result.shrink_note += f" (the replay script did not run here: {type(err).__name__}: {err})"
        return
    if again is not None and same_outcome(first, again):
        return
    replayed = "no difference: the same workload passed" if again is None else again.describe()
    result.nondeterminism = (first.describe(), replayed)


def replay(result: RunResult, backend: Backend) -> Difference | None:
    """Run ``result``'s replay script against ``backend``: its first difference, or None."""
    skip = ("backend = load_backend(", "print(")
    text = replay_script(result.backend, result.workload, result.control.check_bounds)
    lines = [x for x in text.splitlines() if not x.startswith(skip)]
    try:
        exec(compile("\n".join(lines), "<replay>", "exec"), {"backend": backend})
    except ConformanceFailure as failure:
        return failure.difference
    return None


def same_outcome(a: Difference, b: Difference) -> bool:
    """Two differences are the same outcome: same kind, place and values (messages may vary).

    Values compare NaN-aware: a kernel whose outputs are NaN is judged on them,
    not reported as nondeterministic because NaN != NaN.
    """
    where = ("what", "step", "layer", "seq_id", "token", "head", "block", "offset")
    if any(getattr(a, k) != getattr(b, k) for k in where):
        return False
    if a.what == "bounds":  # kernel, launch, argument and first offset: deterministic
        return _bounds_place(a.detail) == _bounds_place(b.detail)
    if a.what in ("exception", "shape", "input", "alias"):
        return a.detail.split(":")[0] == b.detail.split(":")[0]
    return _same_values(a.expected, b.expected) and _same_values(a.actual, b.actual)


_COUNTS = re.compile(r"\d+ (?:loads|stores)|\(worst \d+\)")


_MORE = re.compile(r"\s*\(and \d+ more violations? in this call\)")


def _bounds_place(detail: str) -> str:
    """A bounds failure's detail without its counts: how many accesses strayed, and how far
    the worst went, can depend on what the out-of-bounds reads returned (a block id read past
    a table, then used), which is whatever memory held; where the first one was cannot.

    >>> _bounds_place("k: 2332 loads outside t; first by program (0,): element 75 (worst 53)")
    'k: N outside t; first by program (0,): element 75 N'
    """
    return _COUNTS.sub("N", _MORE.sub("", detail))


def _same_values(x: tuple[float, ...], y: tuple[float, ...]) -> bool:
    """Equal element by element, NaN equal to NaN (a NaN output replays as NaN, not as a change).

    >>> nan = float("nan"); _same_values((1.0, nan), (1.0, nan)), _same_values((nan,), (0.0,))
    (True, False)
    """
    return len(x) == len(y) and all(
        p == q or (p != p and q != q) for p, q in zip(x, y, strict=False)
    )
