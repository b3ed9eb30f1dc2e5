"""The scheduler suite: every invariant and token-exact equivalence, on random workloads.

``python -m conformance scheduler --scheduler REF`` (see :mod:`conformance.cli`)
loads a factory that builds a :class:`~spec.scheduler.Scheduler` from a
:class:`~spec.scheduler.SchedulerConfig` and runs :func:`check_workload` on
random workloads (:mod:`conformance.scheduler.workloads`) under a profile.
Each workload runs twice through
:func:`~conformance.scheduler.invariants.run_checked`: once without a model
(fast: every invariant, and outputs against a fixed sampling function), then
through the engine loop of :mod:`conformance.scheduler.engine`, whose
outputs must equal the tiny model's run alone, token for token. A failure is
shrunk by Hypothesis to a small workload, which :func:`check_workload` replays.

Every run is seeded (a random seed is drawn and reported when none is given),
so ``--seed`` reproduces it; failing examples are saved in a Hypothesis
example database, so the next run replays them first.

Whatever the scheduler does ends as a result the reports describe, never a
traceback: every call into it is reported to the run's watch
(:mod:`conformance.scheduler.watched`), so a call past the per-call timeout
is a hang (in process the watchdog interrupts it; ``python -m conformance
scheduler`` runs the suite in a child process and kills it,
:mod:`conformance.scheduler.isolation`, which also reports a crash or an
exit); an error the checks themselves stop with is a failure too
(:data:`INTERNAL`). A time budget stops drawing new workloads: the result is
then partial.

>>> from spec.scheduler import ContinuousScheduler
>>> result = run_scheduler_suite(ContinuousScheduler, "spec.scheduler:ContinuousScheduler",
...                              run_seed=1, max_examples=5, database=None)
>>> result.passed, result.stats.examples
(True, 5)
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import FlakyFailure, HypothesisException

from conformance.errors import SetupError
from conformance.run.control import DEFAULT_CALL_TIMEOUT_S
from conformance.run.discovery import load_callable
from conformance.run.examples import same_draws_everywhere
from conformance.scheduler.engine import EngineExecutor, engine_unsupported
from conformance.scheduler.invariants import run_checked
from conformance.scheduler.rules import RunReport, SchedulerInvariantError
from conformance.scheduler.watched import watched_factory
from conformance.scheduler.workloads import Workload, workloads
from conformance.watchdog import CallTimeout, RunWatch, Sink, current_watch, watching
from spec.scheduler import Scheduler, SchedulerConfig

SchedulerFactory = Callable[[SchedulerConfig], Scheduler]

DATABASE_DIR = Path(".hypothesis") / "conformance-scheduler"
PROBE = SchedulerConfig(num_blocks=4, block_size=4)
"""The configuration a factory is first called with, to check it builds a scheduler."""

HANG = "every call returns within the per-call timeout"
CRASH = "the scheduler process runs to the end"
INTERNAL = "the checks run to the end"
"""Failures that are not one invariant: a hang, a crash or exit of the process, and an error the
checks stopped with (a value from the scheduler that is not what the protocol says, usually)."""
KINDS = {HANG: "hang", CRASH: "crash", INTERNAL: "internal"}
"""The failure's kind in the reports, by rule (any other rule: ``violation``)."""

_MEMBERS = ("config", "manager", "metrics", "submit", "abort", "step", "update", "has_unfinished")
_NO_SHRINK = [p for p in Phase if p not in (Phase.shrink, Phase.explain)]


@dataclass(frozen=True)
class SchedulerProfile:
    """How hard to look: random workloads, how large each may be, how long to shrink a failure.

    ``shrink_runs`` bounds the workloads run while shrinking; past it the
    smallest failing workload found so far is reported (a run through the
    engine costs tens of milliseconds, and some failures shrink slowly).
    """

    name: str
    max_examples: int
    max_requests: int
    max_prompt: int
    max_new: int
    shrink_runs: int
    description: str


PROFILES = {
    p.name: p
    for p in (
        SchedulerProfile("quick", 300, 6, 20, 8, 100, "the default: seconds on 2 CPU cores"),
        SchedulerProfile("standard", 1500, 8, 28, 10, 500, "before a release, after a change"),
        SchedulerProfile("thorough", 8000, 10, 40, 12, 2000, "nightly, or hunting a rare bug"),
    )
}


@dataclass
class SuiteStats:
    """What a run did, summed over every workload it ran (shrinking included)."""

    examples: int = 0
    steps: int = 0
    requests: int = 0
    first_failure_example: int | None = None
    checks: Counter[str] = field(default_factory=Counter)
    paths: Counter[str] = field(default_factory=Counter)
    block_sizes: Counter[int] = field(default_factory=Counter)

    def add(self, report: RunReport) -> None:
        self.steps += report.steps
        self.checks.update(report.checks)
        self.paths.update(report.paths)


@dataclass
class SchedulerRunResult:
    """The outcome: passed, or the rule broken, where, and the shrunk workload that shows it."""

    scheduler: str
    profile: str
    seed: int
    stats: SuiteStats
    skipped: tuple[str, ...] = ()
    wall_time_s: float = 0.0
    failure: SchedulerInvariantError | None = None
    workload: Workload | None = None
    flaky: bool = False
    stopped: str | None = None  # why the run ended before its examples were done (time budget)
    interrupted: bool = False  # the user stopped it (Ctrl-C or SIGTERM): no verdict
    isolated: bool = False  # the scheduler ran in a child process
    call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S
    time_budget_s: float | None = None
    slowest_call: tuple[str, float] = ("", 0.0)
    diagnostics: tuple[str, ...] = ()  # what a crashed or hung child printed last

    @property
    def passed(self) -> bool:
        return self.failure is None and not self.interrupted

    @property
    def partial(self) -> bool:
        """Passed, but the time budget cut it short: not a pass of the profile."""
        return self.passed and self.stopped is not None

    @property
    def complete(self) -> bool:
        return self.stopped is None and not self.interrupted

    @property
    def kind(self) -> str | None:
        """The failure's kind: ``violation``, ``hang``, ``crash`` or ``internal`` (None: none)."""
        return None if self.failure is None else KINDS.get(self.failure.rule, "violation")


class _Failed(Exception):
    """A violation, the workload that showed it (what the report replays), and in which run."""

    def __init__(self, error: SchedulerInvariantError, workload: Workload, engine: bool) -> None:
        super().__init__(str(error))
        self.error, self.workload, self.engine = error, workload, engine


def load_scheduler(ref: str) -> SchedulerFactory:
    """The factory ``module:factory`` or ``path/to/file.py:factory`` names, tried on :data:`PROBE`.

    >>> from spec.scheduler import ContinuousScheduler
    >>> load_scheduler("spec.scheduler:ContinuousScheduler") is ContinuousScheduler
    True
    >>> load_scheduler("spec.scheduler:SchedulerConfig")
    Traceback (most recent call last):
    ...
    conformance.errors.SetupError: 'spec.scheduler:SchedulerConfig': calling SchedulerConfig(...
    """
    if ":" not in ref:
        raise SetupError(f"{ref!r} is not module:factory or path/to/file.py:factory")
    attr, factory = load_callable(ref)
    return probe_scheduler(ref, attr, factory)


def probe_scheduler(ref: str, attr: str, factory: Callable[..., object]) -> SchedulerFactory:
    """``factory`` (named ``attr`` in ``ref``), once it has built a scheduler from :data:`PROBE`.

    :class:`SetupError` when the call raises (or exits) or builds something
    that lacks a member of the protocol.
    """
    try:
        probe = factory(PROBE)
    except (Exception, SystemExit) as err:  # sys.exit in a factory is a setup error too
        raise SetupError(
            f"{ref!r}: calling {attr}({PROBE}) raised {type(err).__name__}: {err}"
        ) from err
    missing = [m for m in _MEMBERS if not hasattr(probe, m)]
    if missing:
        raise SetupError(
            f"{ref!r} built a {type(probe).__name__}, which lacks {', '.join(missing)}: "
            "see docs/scheduler-conformance.md for the Scheduler protocol"
        )
    return cast(SchedulerFactory, factory)


def check_workload(
    make: SchedulerFactory, workload: Workload, stats: SuiteStats | None = None
) -> None:
    """Every check on one workload; raises :class:`SchedulerInvariantError` at the first violation.

    First the model-free run (every invariant), then, unless the scheduler
    says it cannot drive an engine, the engine run (every invariant again, and
    token-exact equivalence with the model run alone).
    """
    try:
        _check(make, workload, stats or SuiteStats(), (False, True))
    except _Failed as failed:
        raise failed.error from None


class _BudgetSpent(KeyboardInterrupt):
    """Stops Hypothesis drawing another workload (see ``conformance.run.examples._BudgetSpent``)."""


def _check(make: SchedulerFactory, w: Workload, stats: SuiteStats, passes: Sequence[bool]) -> None:
    """Run ``w`` through the passes (``True``: the engine run) in order; raise :class:`_Failed`."""
    stats.requests += len(w.requests)
    stats.block_sizes[w.config.block_size] += 1
    made: list[Scheduler] = []

    def build(config: SchedulerConfig) -> Scheduler:
        made.append(make(config))
        return made[-1]

    for engine in passes:
        try:
            report = run_checked(
                build,
                w.config,
                w.requests,
                w.arrivals,
                aborts=w.aborts,
                executor=EngineExecutor if engine else None,
            )
        except SchedulerInvariantError as err:
            raise _Failed(err, w, engine) from err
        except CallTimeout:
            raise
        except BaseException as err:
            watch = current_watch()
            if isinstance(err, KeyboardInterrupt) and (watch is None or watch.is_users()):
                raise
            step = getattr(made[-1], "steps", 0) if made else 0
            detail = (
                f"the checks stopped with {type(err).__name__}: {err} (a value the scheduler "
                "returned or holds is not what the protocol says? If the scheduler is not at "
                "fault, please report this with the seed)"
            )
            raise _Failed(SchedulerInvariantError(INTERNAL, step, detail), w, engine) from err
        stats.add(report)
        if engine_unsupported(made[-1]) is not None:
            return


def run_scheduler_suite(
    make: SchedulerFactory,
    scheduler_ref: str,
    *,
    profile: str = "quick",
    run_seed: int | None = None,
    database: Path | None = DATABASE_DIR,
    max_examples: int | None = None,
    shrink: bool = True,
    progress: Callable[[str], None] | None = None,
    call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
    time_budget_s: float | None = None,
    sink: Sink | None = None,
) -> SchedulerRunResult:
    """Run :func:`check_workload` on random workloads (``scheduler_ref`` names it in reports).

    ``call_timeout_s``: a scheduler call (or its factory) taking longer is a
    hang (None: wait forever). ``time_budget_s``: stop drawing new workloads
    after this long (the result is then partial). ``sink`` makes this an
    isolated run's child: every event goes to it (:mod:`conformance.scheduler.isolation`).
    """
    if profile not in PROFILES:
        raise SetupError(f"unknown profile {profile!r}: one of {', '.join(PROFILES)}")
    if max_examples is not None and max_examples < 1:
        raise SetupError(f"max_examples must be at least 1, got {max_examples}")
    for name, value in (("call_timeout_s", call_timeout_s), ("time_budget_s", time_budget_s)):
        if value is not None and not value > 0:
            raise SetupError(f"{name} must be a positive number of seconds, got {value!r}")
    with watching(call_timeout_s, sink, isolated=sink is not None) as watch:
        return _run_suite(
            watched_factory(make, watch),
            SchedulerRunResult(
                scheduler=scheduler_ref,
                profile=profile,
                seed=random.randrange(2**32) if run_seed is None else run_seed,
                stats=SuiteStats(),
                isolated=sink is not None,
                call_timeout_s=call_timeout_s,
                time_budget_s=time_budget_s,
            ),
            watch,
            database,
            max_examples,
            shrink,
            progress,
        )


def _run_suite(
    make: SchedulerFactory,
    result: SchedulerRunResult,
    watch: RunWatch,
    database: Path | None,
    max_examples: int | None,
    shrink: bool,
    progress: Callable[[str], None] | None,
) -> SchedulerRunResult:
    """The run, under its watch; ``make`` reports its calls to that watch."""
    start = time.monotonic()
    chosen, stats = PROFILES[result.profile], result.stats
    try:
        why = engine_unsupported(make(PROBE))
    except CallTimeout:
        return _hang(result, watch, None, start)
    result.skipped = () if why is None else (f"token-exact equivalence: {why}",)
    watch.send({"t": "start", "result": result})
    tick = _ticker(stats, progress)
    budget = result.time_budget_s
    current: list[Workload] = []  # the workload running now (a hang's)

    passes = [False, True]  # model-free, engine; once one fails, shrinking runs only that one
    failed_workloads: list[Workload] = []  # still fail when shrinking is out of budget

    def example(w: Workload) -> None:
        first = stats.first_failure_example
        spent = first is not None and stats.examples - first >= chosen.shrink_runs
        if spent and w not in failed_workloads:
            return  # out of budget: only what failed before fails now, so shrinking ends
        late = budget is not None and time.monotonic() - start >= budget
        if late and first is None and stats.examples:
            raise _BudgetSpent
        current[:] = [w]
        watch.send({"t": "workload", "workload": w})
        stats.examples += 1
        tick()
        try:
            _check(make, w, stats, passes)
        except _Failed as failed:
            if first is None:
                stats.first_failure_example = stats.examples
                passes[:] = [failed.engine]
            failed_workloads.append(w)
            raise
        finally:
            watch.send({"t": "stats", "stats": stats})

    strategy = workloads(
        max_requests=chosen.max_requests,
        max_prompt=chosen.max_prompt,
        max_new=chosen.max_new,
        sampling=True,
    )
    count = chosen.max_examples if max_examples is None else max_examples
    config = _settings(count, _database(database, result.scheduler), shrink)
    try:
        # settings outermost: @seed alone would switch the example database off
        with same_draws_everywhere():
            config(seed(result.seed)(given(strategy)(example)))()
    except _Failed as failed:
        result.failure, result.workload = failed.error, failed.workload
    except _BudgetSpent:
        result.stopped = "time budget"
    except CallTimeout:
        return _hang(result, watch, current[0] if current else None, start)
    except FlakyFailure as group:
        inner = [e for e in group.exceptions if isinstance(e, _Failed)]
        if not inner:
            _internal(result, group)
        else:
            result.failure, result.workload, result.flaky = inner[0].error, inner[0].workload, True
    except (HypothesisException, Exception) as err:
        _internal(result, err)
    if result.workload is not None:
        try:
            _replay(make, result)
        except CallTimeout:
            return _hang(result, watch, result.workload, start)
    result.wall_time_s = time.monotonic() - start
    result.slowest_call = watch.slowest
    return result


def _hang(
    result: SchedulerRunResult, watch: RunWatch, workload: Workload | None, start: float
) -> SchedulerRunResult:
    """The result of an in-process run whose call in flight passed the per-call timeout."""
    call = watch.timed_out
    what = "a scheduler call" if call is None else call.describe()
    result.failure = SchedulerInvariantError(
        HANG,
        0 if call is None else call.step,
        f"{what} did not return within {result.call_timeout_s:g} s (the per-call timeout; "
        "--call-timeout sets it)",
    )
    result.workload = workload
    result.wall_time_s = time.monotonic() - start
    result.slowest_call = watch.slowest
    return result


def _internal(result: SchedulerRunResult, err: BaseException) -> None:
    """An error out of the run that is not a scheduler's violation: reported, never a traceback."""
    result.failure = SchedulerInvariantError(
        INTERNAL,
        0,
        f"the suite stopped with an internal error: {type(err).__name__}: {err} (if the "
        "scheduler is not at fault, please report this with the seed)",
    )


def _replay(make: SchedulerFactory, result: SchedulerRunResult) -> None:
    """Check the shrunk workload as its replay script will, and report what that shows."""
    assert result.workload is not None
    try:
        check_workload(make, result.workload)
    except SchedulerInvariantError as err:
        result.failure = err
    else:
        result.flaky = True


def _settings(count: int, database: DirectoryBasedExampleDatabase | None, shrink: bool) -> settings:
    return settings(
        max_examples=count,
        deadline=None,
        derandomize=False,  # the seed decides, even where a CI profile derandomizes
        database=database,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
        print_blob=False,
        phases=list(Phase) if shrink else _NO_SHRINK,
    )


def _database(root: Path | None, ref: str) -> DirectoryBasedExampleDatabase | None:
    if root is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", ref).strip("_") or "scheduler"
    return DirectoryBasedExampleDatabase(str(root / slug))


def _ticker(stats: SuiteStats, progress: Callable[[str], None] | None) -> Callable[[], None]:
    """A callback that reports progress at most every five seconds."""
    start = last = time.monotonic()

    def tick() -> None:
        nonlocal last
        now = time.monotonic()
        if progress is not None and now - last >= 5.0:
            last = now
            progress(f"{stats.examples} examples, {stats.steps} steps, {now - start:.0f} s")

    return tick
