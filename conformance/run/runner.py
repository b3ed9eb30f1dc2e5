"""Running the lockstep machine against one backend, under a profile, and collecting the result.

Every run is seeded (a random seed is drawn and reported when none is given),
so ``--seed`` reproduces it; and failing examples are saved in a Hypothesis
example database, so the next run replays them first.

A run never ends in a traceback or a silent exit: whatever the backend does
(see :mod:`conformance.judges.guard`) and whatever Hypothesis raises (a flaky
failure, an internal error) ends as a :class:`RunResult` that the reports
describe. A failure found is replayed once more from its replay script: a
backend whose outcome differs is reported as not deterministic, with both
outcomes. :class:`~conformance.run.control.RunControl` bounds the run: no
shrinking, a shrink time limit, the long examples, a time budget, the per-call
timeout; and may add the bounds check (``check_bounds``): one
:class:`~conformance.bounds.checker.BoundsChecker` for the whole run, whose
:class:`~conformance.bounds.checker.BoundsReport` the result carries. A run that cannot
check anything is refused: before it starts, when Triton's interpreter is not
in use; at its end, when no example launched an interpreted Triton kernel.
A failing pass does not stop the others (``control.every_pass``): each
leaves a :class:`~conformance.run.failures.PassFailure` in ``failures``; only
the first is shrunk, the later ones are reported as found.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from conformance.bounds.checker import GPU_NOTE, BoundsChecker, unusable
from conformance.errors import SetupError
from conformance.interpreter import specialisations
from conformance.interpreter.api import install_when_interpreting
from conformance.judges.oracle import OracleChoice, oracle_for_run
from conformance.lockstep.envelope_scale import scaled
from conformance.lockstep.plan import Plan, plan_for
from conformance.lockstep.run_stats import RunStats
from conformance.run.causes import MAX_CAUSES, Cause, excluding
from conformance.run.compiles import watching_compiles
from conformance.run.control import RunControl
from conformance.run.database import open_database
from conformance.run.examples import (
    Clock,
    Split,
    bounded_shrinking,
    note_shrinking,
    pass_settings,
    run_pass,
    same_draws_everywhere,
    ticker,
)
from conformance.run.failures import FATAL
from conformance.run.isolate import find_cause
from conformance.run.profiles import PROFILES, Profile
from conformance.run.replay_check import judge_replays
from conformance.run.result import (
    RunResult,
    note_failure_margins,
    take_failure,
)
from conformance.run.shard import Claims, Shard
from conformance.watchdog import Sink, watching
from spec.backend import Backend

DATABASE_DIR = Path(".hypothesis") / "conformance"


def run_suite(
    backend: Backend,
    backend_ref: str,
    *,
    profile: str = "quick",
    run_seed: int | None = None,
    dtypes: Iterable[str] | None = None,
    database: Path | str | None = DATABASE_DIR,
    max_examples: int | None = None,
    progress: Callable[[str], None] | None = None,
    shrink: bool = True,
    control: RunControl | None = None,
    sink: Sink | None = None,
    passes: Iterable[str] | None = None,
    shard: Shard | None = None,
    claims: Claims | None = None,
) -> RunResult:
    """Run the lockstep machine against ``backend`` (named ``backend_ref`` in reports).

    Raises :class:`~conformance.errors.SetupError` if the backend can run nothing.
    ``shrink=False`` reports the first failing workload as found, unminimized
    (faster; the same as ``control.shrink``). ``sink`` makes this an isolated
    run's child: every event goes to it (see :mod:`conformance.run.isolation`). ``passes``
    limits the run to those kinds of example (:data:`conformance.lockstep.plan.PASSES`).
    ``database``: a directory, a Redis URL (:mod:`conformance.run.database`), or ``None``.
    ``shard``: run only that shard's share of the generated examples
    (:mod:`conformance.run.shard`); the examples saved in the database replay in
    full on every shard, first. ``claims``: of those, run only the examples this
    process claims first (one of a ``--jobs`` run's processes, :mod:`conformance.run.parallel`).
    """
    control = control or RunControl()
    install_when_interpreting()  # interpreted kernels are judged as compiled Triton would run
    specialisations.reset()  # the compiled kernels' keys this run launches, counted afresh
    if not shrink:
        control = replace(control, shrink=False)
    chosen = PROFILES[profile]
    if max_examples is not None and max_examples < 1:
        raise SetupError(f"max_examples must be at least 1, got {max_examples}")
    bounds = _bounds_checker(control)
    caps = backend.capabilities
    plan = replace(plan_for(caps, dtypes, control.envelope), poison=control.poison)
    if control.envelope_scale > 1:
        plan = replace(plan, envelope=scaled(plan.envelope, control.envelope_scale))
        plan = replace(plan, notes=(*plan.notes, _scale_note(plan, control.envelope_scale)))
    oracle = oracle_for_run(caps.device, control.reference_memory)
    stats = RunStats()
    short, long = chosen.examples(max_examples)
    result = RunResult(
        backend=backend_ref,
        profile=profile,
        seed=random.randrange(2**32) if run_seed is None else run_seed,
        capabilities=caps,
        skipped=plan.skipped,
        stats=stats,
        control=control,
        requested=(short, long if control.long_examples is None else control.long_examples),
        isolated=sink is not None,
        notes=plan.notes,
        oracle=oracle.note(),
        envelope=plan.envelope.device,
        shard=shard,
    )
    clock = Clock(control, stats)
    start = time.monotonic()
    with (
        watching(control.call_timeout_s, sink, isolated=sink is not None) as watch,
        bounded_shrinking(),
        same_draws_everywhere(),
        watching_compiles(stats),
    ):
        watch.send({"t": "start", "result": result})
        tick = ticker(stats, progress, clock, watch)
        kinds = None if passes is None else set(passes)
        offset, drew = 0, False  # examples the earlier passes asked for; whether any pass drew
        for plan_now in plan.passes():
            if kinds is not None and plan_now.kind not in kinds:
                continue
            why = _pass_unavailable(backend, plan_now)
            if why:
                result.skipped += (why,)
                continue
            count = _pass_count(result, chosen, plan_now.kind, max_examples)
            if count == 0:
                continue
            if clock.spent():
                result.stopped = "time budget"
                break
            name = _pass_name(plan_now)
            causes: list[Cause] = []  # excluded, one after each failure of this pass
            while True:
                shown = name if not causes else f"{name}, without {_listed(causes)}"
                result.passes.append((shown, count))
                watch.send({"t": "start", "result": result})  # the parent knows the pass
                suffix = "" if plan_now.kind == "short" else "-" + name.replace(" ", "-")
                db = None if causes else open_database(database, backend_ref + suffix)
                shrink = control.shrink and not result.failures  # later failures: as found
                config = pass_settings(count, chosen.pass_steps(plan_now.kind), db, shrink)
                this = replace(
                    plan_now,
                    caps=excluding(plan_now.caps, causes),
                    poison=_poison_after(plan_now.poison, causes),
                )
                split = Split(None if causes else result.shard, None if causes else claims)
                split.offset = offset
                if (causes and this.vetoed()) or not run_pass(
                    result, backend, this, config, tick, clock, watch, split, bounds, oracle
                ):
                    result.passes.pop()
                    result.skipped += (_nothing_to_draw(shown, this, causes),)
                    break
                drew = True
                if result.difference is not None and control.shrink and not shrink:
                    result.shrink_note = LATER_NOT_SHRUNK
                if result.difference is None:
                    break
                note_shrinking(result, clock)
                cause = result.cause = _cause(result, backend, oracle)
                result.failures.append(take_failure(result, shown))
                note_failure_margins(result)
                if not control.every_pass or result.difference.what in FATAL:
                    break
                clear_failure(result, clock)
                watch.send({"t": "start", "result": result})  # the parent keeps the failures
                if cause is None or cause.final or cause in causes or len(causes) >= MAX_CAUSES:
                    break
                causes.append(cause)  # the pass again, drawn without it: the next failure
                if result.stopped or result.interrupted or clock.spent():
                    break
            offset += count
            if result.difference is not None or result.stopped or result.interrupted:
                break
        if not drew and not result.interrupted and not result.stopped and not result.failures:
            raise SetupError(
                "the suite could not draw one workload the backend supports in any pass: "
                "check its capabilities and excludes hook (" + "; ".join(result.skipped[-3:]) + ")"
            )
        judge_replays(result, backend, watch)
        result.slowest_call = watch.slowest
    result.wall_time_s = time.monotonic() - start
    result.bounds = None if bounds is None else bounds.report()
    _refuse_unchecked(result, bounds)
    return result


def _scale_note(plan: Plan, factor: int) -> str:
    env = plan.envelope
    lo, hi = env.long_prompts
    return (
        f"the {env.device} envelope with lengths and widths divided by {factor}: wide steps of "
        f"{', '.join(map(str, env.wide_seqs))} sequences, long prompts of {lo} to {hi} tokens"
    )


LATER_NOT_SHRUNK = (
    "not shrunk: found after the run's first failure (shrinking every failing pass would "
    "multiply a failing run's time; fix the first failure and rerun to shrink this one)"
)


def _refuse_unchecked(result: RunResult, bounds: BoundsChecker | None) -> None:
    """:class:`SetupError` when a bounds-checked run passed without one kernel to check.

    Decided over the whole run, not its first example: Hypothesis discards
    examples a backend's limits rule out before any call is made.
    """
    if bounds is None or bounds.launches or result.difference is not None or result.interrupted:
        return
    raise SetupError(
        f"--check-bounds: the run's {result.stats.examples} examples made backend calls (the "
        "cache's creation, writes, copies and reads, and attention) that launched no Triton "
        "kernel under the interpreter, so nothing could be checked (only interpreted Triton "
        f"launches are); {GPU_NOTE}"
    )


def _listed(causes: list[Cause]) -> str:
    return ", ".join(c.excluded() for c in causes)


def _cause(result: RunResult, backend: Backend, oracle: OracleChoice) -> Cause | None:
    """The cause of the pass's failure (:func:`~conformance.run.isolate.find_cause`); ``None``
    for a fault of the run (a hang, a crash) or a failure outside any example."""
    diff, config = result.difference, result.failing_config
    if diff is None or config is None or diff.what in FATAL or not result.control.every_pass:
        return None  # (a run that stops at its first failure draws nothing without it)
    mode = result.control.check_bounds
    return find_cause(backend, result.workload, config, diff, mode, oracle)


def _poison_after(poison: str, causes: list[Cause]) -> str:
    """The pass's poison once ``causes`` are out: finite after a read of unowned memory."""
    return "finite" if poison == "nan" and any(c.finite_poison for c in causes) else poison


def _nothing_to_draw(name: str, plan: Plan, causes: list[Cause]) -> str:
    """Why a pass drew nothing: what the backend (and the failures before) left out."""
    if causes:
        return f"pass {name}: nothing else to draw once {_listed(causes)} is left out"
    return (
        f"pass {name}: nothing to draw that the backend supports (its capabilities and "
        "excludes hook rule out every workload of the pass)"
    )


def _bounds_checker(control: RunControl) -> BoundsChecker | None:
    """The run's bounds checker, if asked for; :class:`SetupError` when it could check nothing."""
    if control.check_bounds is None:
        return None
    why = unusable()
    if why is not None:
        raise SetupError(f"--check-bounds: {why}; {GPU_NOTE}")
    return BoundsChecker.for_mode(control.check_bounds)


def _pass_count(result: RunResult, profile: Profile, kind: str, override: int | None) -> int:
    """Examples of one pass: the run's short and long counts (run control), or the profile's."""
    if kind == "short":
        return result.requested[0]
    if kind == "long":
        return result.requested[1]
    return profile.pass_examples(kind, override)


def _pass_name(plan: Plan) -> str:
    """``short``, ``long``, ..., ``production (head dim 128, 8/2 heads, block size 16)``, or
    ``feature (sinks)``."""
    if plan.shape is not None:
        return f"{plan.kind} ({plan.shape.describe()})"
    return plan.kind if plan.feature is None else f"{plan.kind} ({plan.feature})"


def _pass_unavailable(backend: Backend, plan: Plan) -> str | None:
    """Why a pass cannot run on this backend (``None`` when it can)."""
    vetoed = plan.vetoed()
    if vetoed is not None:
        return f"pass {_pass_name(plan)}: nothing to draw: {vetoed}"
    if plan.kind == "large pool" and not callable(getattr(backend, "read_blocks", None)):
        return (
            "large pool pass (KV offsets past 2^31 elements): the backend has no "
            "read_blocks(layer, blocks), and copying a pool of 2^31 elements is not an option"
        )
    return None


def clear_failure(result: RunResult, clock: Clock) -> None:
    """Ready the next pass: no current failure, the clock's shrink limit for a new one."""
    result.difference, result.workload, result.shrunk = None, [], False
    result.shrink_note, result.flaky, result.cause = "", False, None
    result.failing_config = None
    result.stats.first_failure_example = None
    clock.failure_at = None
