"""One pass's examples drawn and run by Hypothesis: its settings, its clock, what it found.

Each pass is one Hypothesis run of :class:`~conformance.lockstep.machine.LockstepMachine`
examples under the run's seed, with the same draws in every process (a shard
or a job of the same run draws the same examples), a time budget checked
between examples, and shrinking bounded in time. What it found goes into the
:class:`~conformance.run.result.RunResult`: a conformance failure with its
workload, a hang, or an error of the suite itself, reported, never a traceback.
"""

from __future__ import annotations

import time
import unittest
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Flaky, HypothesisException, Unsatisfiable
from hypothesis.internal.conjecture import engine as _engine
from hypothesis.internal.conjecture import providers as _providers
from hypothesis.internal.constants_ast import Constants
from hypothesis.stateful import run_state_machine_as_test

from conformance.bounds.checker import BoundsChecker
from conformance.errors import SuiteStopped
from conformance.interpreter import specialisations
from conformance.judges.compare import Difference
from conformance.judges.oracle import OracleChoice
from conformance.lockstep.driver import ConformanceFailure
from conformance.lockstep.machine import LockstepMachine
from conformance.lockstep.plan import Plan
from conformance.lockstep.run_stats import RunStats, timed_progress
from conformance.run.control import RunControl
from conformance.run.result import RunResult
from conformance.run.shard import Claims, Shard
from conformance.watchdog import CallTimeout, RunWatch
from spec.backend import Backend

_PHASES = [p for p in Phase if p is not Phase.explain]  # explaining costs runs; unused here


_NO_SHRINK = [p for p in _PHASES if p is not Phase.shrink]


class _BudgetSpent(KeyboardInterrupt):
    """Stops Hypothesis from starting another example.

    A ``KeyboardInterrupt`` because that is the one exception Hypothesis lets
    through untouched: it would take an ``Exception`` for a failure, and any
    other ``BaseException`` out of an example cut short for inconsistent data
    generation.
    """


class Clock:
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
def same_draws_everywhere() -> Iterator[None]:
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
def bounded_shrinking() -> Iterator[None]:
    """Restore Hypothesis's own shrink time limit after the run (:class:`Clock` lowers it).

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


def ticker(
    stats: RunStats, progress: Callable[[str], None] | None, clock: Clock, watch: RunWatch
) -> Callable[[], None]:
    """What runs at the end of each example: progress, the shrink limit, the parent's copy."""
    report = timed_progress(stats, progress)

    def tick() -> None:
        report()
        clock.after_example()
        stats.specialisations |= specialisations.seen()
        watch.send({"t": "stats", "stats": stats})

    return tick


def pass_settings(
    count: int, steps: int, database: ExampleDatabase | None, shrink: bool
) -> settings:
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


def run_pass(
    result: RunResult,
    backend: Backend,
    plan: Plan,
    config: settings,
    tick: Callable[[], None],
    clock: Clock,
    watch: RunWatch,
    split: Split,
    bounds: BoundsChecker | None = None,
    oracle: OracleChoice | None = None,
) -> bool:
    """One pass: a failure, or why it stopped, goes in ``result``; ``False`` when nothing the
    backend supports could be drawn in it.

    Unsharded, one Hypothesis run. One shard of several: first the examples
    saved in the database, in full (a failure found by any shard replays on
    every shard), then the generated ones, this shard's in full and the others'
    through the spec alone (:class:`Split`). One factory serves every run, so
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
class Split:
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


def note_shrinking(result: RunResult, clock: Clock) -> None:
    if not result.shrunk or clock.failure_at is None or clock.shrink_limit is None:
        return
    if time.monotonic() - clock.failure_at >= clock.shrink_limit:
        result.shrink_note = (
            f"shrinking stopped at its {clock.shrink_limit:.3g} s limit: "
            "the workload may not be minimal"
        )
