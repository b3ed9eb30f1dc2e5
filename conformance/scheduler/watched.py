"""Every call the scheduler suite makes into a scheduler, reported to the run's watch.

The backend suite's guard (:mod:`conformance.judges.guard`) tells the run's
:class:`~conformance.watchdog.RunWatch` when each backend call starts and
ends; this does the same for a scheduler, so the same machinery times it: in
an isolated run the parent process kills a child whose call passed the
per-call timeout (:mod:`conformance.scheduler.isolation`), in process the
watchdog thread interrupts it. :func:`watched_factory` wraps a factory: each
call of it (building a scheduler for a workload) is reported, and what it
builds is a :class:`WatchedScheduler`, whose protocol methods are reported
with the step they are made at. What a call raises is left to the checker
(:meth:`conformance.scheduler.invariants._Run.call` judges it).

>>> from conformance.watchdog import RunWatch
>>> from spec.scheduler import ContinuousScheduler, SchedulerConfig
>>> events = []
>>> make = watched_factory(ContinuousScheduler, RunWatch(None, events.append, isolated=True))
>>> scheduler = make(SchedulerConfig(num_blocks=4, block_size=4))
>>> scheduler.has_unfinished(), [(e["t"], e.get("what")) for e in events]
(False, [('call', 'factory'), ('ret', None), ('call', 'has_unfinished'), ('ret', None)])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from conformance.watchdog import Call, RunWatch
from spec.scheduler import Scheduler, SchedulerConfig

METHODS = frozenset({"submit", "abort", "step", "update", "has_unfinished", "result"})
"""The protocol's methods, each reported as a call."""


def watched_factory(
    make: Callable[[SchedulerConfig], Scheduler], watch: RunWatch
) -> Callable[[SchedulerConfig], Scheduler]:
    """``make``, with each call of it and of what it builds reported to ``watch``."""

    def build(config: SchedulerConfig) -> Scheduler:
        return cast(Scheduler, WatchedScheduler(_timed(watch, "factory", 0, make)(config), watch))

    return build


class WatchedScheduler:
    """A scheduler whose protocol methods report to the watch; every other attribute is its own.

    ``steps`` counts the ``step()`` calls made so far: the step a call is made at (``update``
    belongs to the step it reports on, the one before).
    """

    def __init__(self, inner: Scheduler, watch: RunWatch) -> None:
        self._inner = inner
        self._watch = watch
        self.steps = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name not in METHODS or not callable(value):
            return value
        at = max(self.steps - 1, 0) if name == "update" else self.steps  # update: of the last step
        timed = _timed(self._watch, name, at, value)
        if name != "step":
            return timed

        def step(*args: Any, **kwargs: Any) -> Any:
            try:
                return timed(*args, **kwargs)
            finally:
                self.steps += 1

        return step


def _timed(watch: RunWatch, what: str, step: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, reported to ``watch`` as the call ``what`` at ``step`` while it runs."""

    def call(*args: Any, **kwargs: Any) -> Any:
        begun = Call(what, step, owner="scheduler")
        watch.begin(begun, [], [], False)
        try:
            return fn(*args, **kwargs)
        finally:
            watch.end(begun)  # a call past the per-call timeout raises CallTimeout here

    return call
