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
import re
import time
import unittest
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Flaky, HypothesisException, Unsatisfiable
from hypothesis.internal.conjecture import engine as _engine
from hypothesis.internal.conjecture import providers as _providers
from hypothesis.internal.constants_ast import Constants
from hypothesis.stateful import run_state_machine_as_test

from conformance.bounds.checker import GPU_NOTE, BoundsChecker, BoundsReport, unusable
from conformance.errors import SetupError, SuiteStopped
from conformance.interpreter import specialisations
from conformance.interpreter.api import install_when_interpreting
from conformance.judges.compare import Difference
from conformance.judges.oracle import OracleChoice, oracle_for_run
from conformance.lockstep.driver import ConformanceFailure
from conformance.lockstep.envelope_scale import scaled
from conformance.lockstep.machine import LockstepMachine, RunStats, timed_progress
from conformance.lockstep.plan import Plan, plan_for
from conformance.lockstep.workload import WorkloadConfig
from conformance.reports.replay import script as replay_script
from conformance.run.causes import MAX_CAUSES, Cause, excluding
from conformance.run.compiles import watching_compiles
from conformance.run.control import RunControl
from conformance.run.database import open_database
from conformance.run.failures import FATAL, PassFailure
from conformance.run.isolate import find_cause
from conformance.run.shard import Claims, Shard
from conformance.run.watchdog import CallTimeout, RunWatch, Sink, watching
from spec.backend import Backend
from spec.capabilities import Capabilities

DATABASE_DIR = Path(".hypothesis") / "conformance"
_PHASES = [p for p in Phase if p is not Phase.explain]  # explaining costs runs; unused here
_NO_SHRINK = [p for p in _PHASES if p is not Phase.shrink]


@dataclass(frozen=True)
class Profile:
    """How hard to look: examples (random workloads), steps (rules) per example, and passes.

    After the short examples, each further pass (:data:`conformance.lockstep.plan.PASSES`)
    runs a fixed number of examples, because each costs seconds on an
    interpreted kernel and a chance draw would either miss or repeat them:
    long contexts, wide batches, a large pool, each production shape, each
    declared attention variant and fp8 KV dtype, and KV cache groups.
    """

    name: str
    max_examples: int
    steps: int
    long_examples: int
    description: str
    wide_examples: int = 2
    large_pool_examples: int = 1
    production_examples: int = 1  # per production shape
    feature_examples: int = 1  # per declared attention variant and fp8 KV dtype
    groups_examples: int = 3  # layers in KV cache groups, when declared
    split_examples: int = 1  # a decode split into more than 8 parts, when the plan has one

    def examples(self, override: int | None) -> tuple[int, int]:
        """Short and long examples; an override scales the long ones (at least one).

        >>> PROFILES["quick"].examples(None), PROFILES["quick"].examples(12)
        ((60, 5), (12, 1))
        """
        return self.pass_examples("short", override), self.pass_examples("long", override)

    def pass_examples(self, kind: str, override: int | None = None) -> int:
        """Examples of one pass; an override scales the fixed passes (at least one each).

        >>> from conformance.lockstep.plan import PASSES
        >>> [PROFILES["quick"].pass_examples(k) for k in PASSES]
        [60, 2, 5, 1, 1, 1, 1, 3]
        """
        fixed = {
            "wide": self.wide_examples,
            "long": self.long_examples,
            "split": self.split_examples,
            "large pool": self.large_pool_examples,
            "production": self.production_examples,
            "feature": self.feature_examples,
            "groups": self.groups_examples,
        }
        if kind == "short":
            return self.max_examples if override is None else override
        if override is None:
            return fixed[kind]
        return max(1, override * fixed[kind] // self.max_examples)

    def pass_steps(self, kind: str) -> int:
        """Rules per example of a pass: fewer where each step runs many sequences or blocks, or
        decodes a context long enough to split (the passes whose opening is the point).

        >>> [PROFILES["quick"].pass_steps(k) for k in ("short", "feature", "split", "wide")]
        [20, 10, 5, 5]
        """
        if kind in ("wide", "production", "split"):
            return max(3, self.steps // 4)
        return max(3, self.steps // 2) if kind == "feature" else self.steps


PROFILES = {
    p.name: p
    for p in (
        Profile(
            "quick", 60, 20, 5, "the default: 1.5 minutes on 2 CPUs (--jobs 2), Triton interpreted"
        ),
        Profile(
            "standard",
            300,
            40,
            25,
            "before a release or after a kernel change",
            8,
            4,
            3,
            3,
            12,
            split_examples=2,
        ),
        Profile(
            "thorough",
            2000,
            60,
            150,
            "nightly, or when hunting a rare bug",
            40,
            15,
            10,
            10,
            60,
            split_examples=5,
        ),
    )
}


@dataclass
class RunResult:
    """The outcome of one run: passed, or the first difference and the workload that shows it.

    ``stopped``: why the run ended before the profile's examples were done
    (the time budget), or None. ``shrunk``: the workload was minimised
    (``shrink_note`` says how far, or why not). ``nondeterminism``: the first
    outcome and the replay's, when the same workload gave two. ``diagnostics``:
    what a crashed or hung backend process printed last. ``interrupted``: the
    user stopped the run (Ctrl-C). ``bounds``: the bounds check's report, when
    ``control.check_bounds`` asked for one and the run finished. ``failures``:
    every failing pass (``control.every_pass``); the first is also ``difference``.
    """

    backend: str
    profile: str
    seed: int
    capabilities: Capabilities
    skipped: tuple[str, ...]
    stats: RunStats
    notes: tuple[str, ...] = ()  # what was drawn, and from where (declared sets, the envelope)
    oracle: str = ""  # the references, when not the usual pair (OracleChoice.note)
    envelope: str = "cpu"
    passes: list[tuple[str, int]] = field(default_factory=list)  # (pass, examples asked)
    wall_time_s: float = 0.0
    difference: Difference | None = None
    workload: list[str] = field(default_factory=list)
    flaky: bool = False
    control: RunControl = field(default_factory=RunControl)
    requested: tuple[int, int] = (0, 0)  # short and long examples the run asked for
    stopped: str | None = None
    shrunk: bool = False
    shrink_note: str = ""
    nondeterminism: tuple[str, str] | None = None
    diagnostics: tuple[str, ...] = ()
    slowest_call: tuple[str, float] = ("", 0.0)
    isolated: bool = False
    interrupted: bool = False
    bounds: BoundsReport | None = None  # what the bounds check checked (when it was on)
    reproduce: str = ""  # the command that reproduces this result, when not ``run --seed``
    shard: Shard | None = None  # the run's share of the examples, when it is one shard of N
    failures: list[PassFailure] = field(default_factory=list)  # each failing pass, first first
    jobs: int = 1  # shards run side by side (conformance.run.parallel), merged into this result
    cause: Cause | None = None  # the current failure's cause (conformance.run.causes)
    failing_config: WorkloadConfig | None = None  # the current failure's example, if one

    @property
    def passed(self) -> bool:
        return self.difference is None and not self.interrupted

    @property
    def partial(self) -> bool:
        """Passed, but cut short (the time budget): a PARTIAL verdict, not a pass of the profile."""
        return self.passed and self.stopped is not None

    @property
    def complete(self) -> bool:
        """Whether every example the run asked for ran (no time budget cut it short)."""
        return self.stopped is None and not self.interrupted


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
    clock = _Clock(control, stats)
    start = time.monotonic()
    with (
        watching(control.call_timeout_s, sink, isolated=sink is not None) as watch,
        _shrinking(),
        _same_draws_everywhere(),
        watching_compiles(stats),
    ):
        watch.send({"t": "start", "result": result})
        tick = _ticker(stats, progress, clock, watch)
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
                config = _settings(count, chosen.pass_steps(plan_now.kind), db, shrink)
                this = replace(
                    plan_now,
                    capabilities=excluding(plan_now.capabilities, causes),
                    poison=_poison_after(plan_now.poison, causes),
                )
                split = _Split(None if causes else result.shard, None if causes else claims)
                split.offset = offset
                if (causes and this.vetoed()) or not _run_pass(
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
                _note_shrinking(result, clock)
                cause = result.cause = _cause(result, backend, oracle)
                result.failures.append(take_failure(result, shown))
                _note_failure_margins(result)
                if not control.every_pass or result.difference.what in FATAL:
                    break
                _clear_failure(result, clock)
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
        _judge_replays(result, backend, watch)
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


def take_failure(result: RunResult, pass_name: str) -> PassFailure:
    """The failing pass as found: its difference, workload, how it was shrunk, and its cause."""
    return PassFailure(
        pass_name,
        result.difference or Difference("internal", 0, "no difference"),
        tuple(result.workload),
        result.shrunk,
        result.shrink_note,
        result.flaky,
        result.stats.first_failure_example,
        cause=None if result.cause is None else result.cause.describe(),
        isolated=result.cause is not None and result.cause.found != "unisolated",
    )


def _clear_failure(result: RunResult, clock: _Clock) -> None:
    """Ready the next pass: no current failure, the clock's shrink limit for a new one."""
    result.difference, result.workload, result.shrunk = None, [], False
    result.shrink_note, result.flaky, result.cause = "", False, None
    result.failing_config = None
    result.stats.first_failure_example = None
    clock.failure_at = None


def _note_failure_margins(result: RunResult) -> None:
    """The reported failure's own excess in the run's margins: they count passing examples
    only (an example that failed while shrinking, say, is not in them), and the failures the
    report lists."""
    diff = result.difference
    if diff is None:
        return
    if diff.numerics is not None:
        result.stats.margins.note_step(diff.numerics)
    if diff.example is not None:
        result.stats.margins.note_example(diff.example)


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


def _judge_replays(result: RunResult, backend: Backend, watch: RunWatch) -> None:
    """Replay each failure (same outcome, or not deterministic); the first is the headline."""
    judged = []
    for failure in result.failures:
        _restore(result, failure)
        _check_replay(result, backend, watch)
        judged.append(replace(failure, nondeterminism=result.nondeterminism))
    result.failures[:] = judged
    if judged:
        _restore(result, judged[0])


def headline_first(result: RunResult, later: PassFailure) -> None:
    """Add ``later`` (a hang or crash the parent saw) after the failures the run already had;
    the first stays the headline."""
    result.failures.append(later)
    restore_headline(result)


def restore_headline(result: RunResult) -> None:
    """The first failing pass as the run's headline difference (there must be one)."""
    _restore(result, result.failures[0])


def _restore(result: RunResult, failure: PassFailure) -> None:
    result.difference, result.workload = failure.difference, list(failure.workload)
    result.shrunk, result.shrink_note, result.flaky = (
        failure.shrunk,
        failure.shrink_note,
        failure.flaky,
    )
    result.stats.first_failure_example = failure.example
    result.nondeterminism = failure.nondeterminism


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


class _BudgetSpent(KeyboardInterrupt):
    """Stops Hypothesis from starting another example.

    A ``KeyboardInterrupt`` because that is the one exception Hypothesis lets
    through untouched: it would take an ``Exception`` for a failure, and any
    other ``BaseException`` out of an example cut short for inconsistent data
    generation.
    """


class _Clock:
    """The run's time budget and shrink time limit, measured from the start of the run."""

    def __init__(self, control: RunControl, stats: RunStats) -> None:
        self.control = control
        self.stats = stats
        self.start = time.monotonic()
        self.failure_at: float | None = None
        self.shrink_limit: float | None = None

    def spent(self) -> bool:
        budget = self.control.time_budget_s
        return budget is not None and time.monotonic() - self.start >= budget

    def may_start_example(self) -> bool:
        """Another example may start: within the budget, or still shrinking a failure."""
        first = self.stats.examples == 0 or self.stats.first_failure_example is not None
        return first or not self.spent()

    def after_example(self) -> None:
        """At the first failure, bound its shrinking by the shrink limit and the budget left."""
        if self.failure_at is not None or self.stats.first_failure_example is None:
            return
        self.failure_at = time.monotonic()
        limits = [self.control.shrink_time_s]
        if self.control.time_budget_s is not None:
            left = self.control.time_budget_s - (self.failure_at - self.start)
            limits.append(max(left, 0.001))
        chosen = [x for x in limits if x is not None]
        if chosen:
            self.shrink_limit = min(chosen)
            _engine.MAX_SHRINKING_SECONDS = self.shrink_limit  # type: ignore[assignment]


@contextmanager
def _same_draws_everywhere() -> Iterator[None]:
    """Make a seed draw the same workloads whatever else the process has imported.

    Hypothesis mixes into its draws "local constants": literals it finds in
    the source of every project module loaded so far. The CLI's child, a
    pytest session and a library call load different modules, so the same
    seed would draw different workloads in each. During a run the pool is
    empty (and its cache fresh), so that ``--seed N``, ``PAGED_SPEC_SEED=N``
    and ``run_suite(..., run_seed=N)`` run one workload. Private Hypothesis
    names: when they are missing, nothing is changed.
    """
    saved: dict[str, Any] = {
        name: getattr(_providers, name, None)
        for name in ("_get_local_constants", "CONSTANTS_CACHE")
    }
    if any(value is None for value in saved.values()):
        yield
        return
    empty = Constants()
    _providers._get_local_constants = lambda: empty
    _providers.CONSTANTS_CACHE = type(saved["CONSTANTS_CACHE"])(1024)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(_providers, name, value)


@contextmanager
def _shrinking() -> Iterator[None]:
    """Restore Hypothesis's own shrink time limit after the run (:class:`_Clock` lowers it).

    ``MAX_SHRINKING_SECONDS`` is how long Hypothesis shrinks before it stops
    and reports the smallest failure found so far: the one way to bound
    shrinking that keeps that failure.
    """
    saved = getattr(_engine, "MAX_SHRINKING_SECONDS", None)
    try:
        yield
    finally:
        if saved is not None:
            _engine.MAX_SHRINKING_SECONDS = saved


def _ticker(
    stats: RunStats, progress: Callable[[str], None] | None, clock: _Clock, watch: RunWatch
) -> Callable[[], None]:
    """What runs at the end of each example: progress, the shrink limit, the parent's copy."""
    report = timed_progress(stats, progress)

    def tick() -> None:
        report()
        clock.after_example()
        stats.specialisations |= specialisations.seen()
        watch.send({"t": "stats", "stats": stats})

    return tick


def _settings(count: int, steps: int, database: ExampleDatabase | None, shrink: bool) -> settings:
    return settings(
        max_examples=count,
        stateful_step_count=steps,
        deadline=None,
        derandomize=False,  # the seed decides, even where a CI profile derandomizes
        database=database,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
        print_blob=False,
        phases=_PHASES if shrink else _NO_SHRINK,
    )


def _run_pass(
    result: RunResult,
    backend: Backend,
    plan: Plan,
    config: settings,
    tick: Callable[[], None],
    clock: _Clock,
    watch: RunWatch,
    split: _Split,
    bounds: BoundsChecker | None = None,
    oracle: OracleChoice | None = None,
) -> bool:
    """One pass: a failure, or why it stopped, goes in ``result``; ``False`` when nothing the
    backend supports could be drawn in it.

    Unsharded, one Hypothesis run. One shard of several: first the examples
    saved in the database, in full (a failure found by any shard replays on
    every shard), then the generated ones, this shard's in full and the others'
    through the spec alone (:class:`_Split`). One factory serves every run, so
    that all of them share one place in the database. A pass drawn again
    without a failure's cause runs unsplit, in the process that found it.
    """

    def factory() -> LockstepMachine:
        if not clock.may_start_example():
            raise _BudgetSpent
        if split.draw_only(result.stats):
            return LockstepMachine(backend, plan, RunStats(), lambda: None, draw_only=True)
        return LockstepMachine(
            backend,
            plan,
            result.stats,
            tick,
            bounds,
            defer_failure=split.active,
            oracle=oracle,
            on_found=lambda f: watch.send(
                {"t": "found", "difference": f.difference, "workload": list(f.log)}
            ),
        )

    if not split.shared:
        return _hypothesis(result, factory, config, watch)
    saved = [p for p in config.phases if p in (Phase.explicit, Phase.reuse, Phase.shrink)]
    if config.database is not None:
        _hypothesis(result, factory, settings(config, phases=saved), watch)
    if result.difference is None and result.stopped is None:
        split.active = True
        new = [p for p in config.phases if p not in (Phase.explicit, Phase.reuse)]
        return _hypothesis(result, factory, settings(config, phases=new), watch)
    return True


@dataclass
class _Split:
    """Which generated examples of a pass run in full in this process.

    While ``active``, example ``i`` of the pass (in the order the run's seed
    generates them), numbered ``offset + i`` in the run (``offset``: the
    examples the earlier passes asked for, so that passes of one example
    each fall to different shards), runs in full when the shard owns that
    number and, in a ``--jobs`` run, this process claims it first
    (``claims``), or once a failure is found (shrinking it needs the
    backend); the others are drawn through the spec alone. Every shard and
    job generates the same examples, so they share them out exactly. A failing example of a shard
    draws to its end before it fails (``defer_failure``), as its twin drawn
    through the spec alone would: Hypothesis requires one sequence of choices
    to draw the same way each time.
    """

    shard: Shard | None
    claims: Claims | None = None  # of the shard's examples, those this process claims first
    offset: int = 0
    active: bool = False
    index: int = 0

    @property
    def shared(self) -> bool:
        """Whether other processes run some of this pass's examples."""
        return self.shard is not None or self.claims is not None

    def draw_only(self, stats: RunStats) -> bool:
        if not self.active or not self.shared:
            return False
        self.index += 1
        if stats.first_failure_example is not None:
            return False
        number = self.offset + self.index - 1
        if self.shard is not None and not self.shard.owns(number):
            return True
        return self.claims is not None and not self.claims.take(f"{self.offset}.{self.index - 1}")


def _hypothesis(
    result: RunResult,
    factory: Callable[[], LockstepMachine],
    config: settings,
    watch: RunWatch,
) -> bool:
    """One Hypothesis run of the machines ``factory`` makes; what it found goes in ``result``.
    ``False`` when Hypothesis could draw nothing the backend supports."""
    try:
        # Hypothesis accepts any zero-argument callable that returns a machine.
        machine_factory: Any = seed(result.seed)(factory)
        run_state_machine_as_test(machine_factory, settings=config)
    except unittest.SkipTest:  # only saved examples asked for, and none saved
        pass
    except ConformanceFailure as failure:
        _record(result, failure, shrunk=Phase.shrink in config.phases)
    except _BudgetSpent:
        result.stopped = "time budget"
    except SuiteStopped as stop:
        raise stop.error from None
    except CallTimeout:
        _record_hang(result, watch)
    except Flaky as err:  # the same workload failed, then passed (or failed otherwise)
        inner = _conformance_failures(err)
        if inner:
            _record(result, inner[0], shrunk=False)
            result.flaky = True
            result.shrink_note = "not shrunk: the failure did not come back while shrinking"
        else:
            _record_internal(result, err, "Hypothesis found the run unreliable")
    except Unsatisfiable:
        return False
    except (HypothesisException, Exception) as err:
        _record_internal(result, err, "the suite stopped with an internal error")
    return True


def _record(result: RunResult, failure: ConformanceFailure, shrunk: bool) -> None:
    result.difference, result.workload, result.shrunk = failure.difference, failure.log, shrunk
    result.failing_config = failure.config
    if not shrunk:
        result.shrink_note = "not shrunk (--no-shrink)" if not result.control.shrink else ""


def _record_hang(result: RunResult, watch: RunWatch) -> None:
    call = watch.timed_out
    step, layer = (0, None) if call is None else (call.step, call.layer)
    what = "a backend call" if call is None else call.describe()
    timeout = result.control.call_timeout_s
    result.difference = Difference(
        "hang",
        step,
        f"{what} did not return within {timeout:g} s (the per-call timeout; "
        "--call-timeout or PAGED_SPEC_CALL_TIMEOUT sets it)",
        layer=layer,
    )
    result.workload, result.shrunk = list(watch.log), False
    result.shrink_note = "not shrunk: each replay of a hang costs the whole timeout"
    result.stats.note_failure()


def _record_internal(result: RunResult, err: BaseException, why: str) -> None:
    """An error that is not the backend's difference: reported, never a traceback."""
    result.difference = Difference(
        "internal",
        0,
        f"{why}: {type(err).__name__}: {err} (if the backend is not at fault, please report "
        "this with the seed)",
    )
    result.shrunk = False
    result.stats.note_failure()


def _conformance_failures(group: BaseException) -> list[ConformanceFailure]:
    """The conformance failures inside a (nested) exception group, first first."""
    if isinstance(group, ConformanceFailure):
        return [group]
    inner = getattr(group, "exceptions", ())
    return [f for e in inner for f in _conformance_failures(e)]


def _note_shrinking(result: RunResult, clock: _Clock) -> None:
    if not result.shrunk or clock.failure_at is None or clock.shrink_limit is None:
        return
    if time.monotonic() - clock.failure_at >= clock.shrink_limit:
        result.shrink_note = (
            f"shrinking stopped at its {clock.shrink_limit:.3g} s limit: "
            "the workload may not be minimal"
        )


def _check_replay(result: RunResult, backend: Backend, watch: RunWatch) -> None:
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
