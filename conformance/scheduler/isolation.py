"""An isolated scheduler run: the scheduler in a child process, watched, as the backend suite's.

``python -m conformance scheduler`` runs the suite in a child process
(:mod:`conformance.scheduler.worker`) through the backend suite's
:class:`~conformance.run.isolation.ChildProcess`: the same pipes, messages,
per-call timeouts, stack dumps and process-group kill. So a scheduler that
exits (``os._exit``; ``sys.exit`` in a call is caught in the child as a
violation), crashes (a segfault), or hangs in a call or in its factory ends
as a failed :class:`~conformance.scheduler.suite.SchedulerRunResult` with the
call, the step and the workload it was running, whose reports are written
like any other; a Ctrl-C (or SIGTERM, :mod:`conformance.run.terminate`)
stops the child and returns a result marked interrupted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from conformance.errors import SetupError
from conformance.run.isolation import ChildProcess, to_stderr
from conformance.scheduler.rules import SchedulerInvariantError
from conformance.scheduler.suite import (
    CRASH,
    HANG,
    SchedulerRunResult,
    SuiteStats,
)
from conformance.scheduler.workloads import Workload


@dataclass(frozen=True)
class SchedulerRequest:
    """What the child should run: ``run_scheduler_suite``'s arguments, as JSON-able values."""

    scheduler: str
    profile: str
    seed: int
    database: str | None
    max_examples: int | None
    shrink: bool
    call_timeout_s: float | None
    time_budget_s: float | None


def run_scheduler_isolated(
    request: SchedulerRequest,
    progress: Callable[[str], None] | None = None,
    output: Callable[[str], None] | None = None,
) -> SchedulerRunResult:
    """Run ``request`` in a child process; the result of the run, whatever the child does.

    Raises :class:`~conformance.errors.SetupError` for a setup error in the child.
    """
    child = _SchedulerChild(request, progress or (lambda _: None), output or to_stderr)
    child.run()
    return child.outcome()


class _SchedulerChild(ChildProcess[SchedulerRunResult, SuiteStats]):
    party = "scheduler"

    def __init__(
        self,
        request: SchedulerRequest,
        progress: Callable[[str], None],
        output: Callable[[str], None],
    ) -> None:
        self.request = request
        self.current: Workload | None = None
        worker = "conformance.scheduler.worker"
        timeout = request.call_timeout_s
        super().__init__(worker, asdict(request), timeout, progress, output, SuiteStats())

    def on_other(self, kind: str, event: dict[str, Any]) -> None:
        if kind == "workload":
            self.current = event["workload"]
            self.examples_started += 1

    def outcome(self) -> SchedulerRunResult:
        """The child's result, or one built from what it sent before it hung or crashed."""
        if self.result is not None and not self.interrupted:
            self.result.isolated = True
            return self.result
        if self.setup_error is not None:
            raise SetupError(self.setup_error)
        result = self._so_far()
        if self.interrupted:
            result.interrupted = True
            return result
        stop = self.stop()
        rule = HANG if stop.kind == "hang" else CRASH
        result.failure = SchedulerInvariantError(rule, stop.step, stop.detail)
        result.workload = self.current
        result.diagnostics = self.diagnostics()
        if result.stats.first_failure_example is None:
            result.stats.first_failure_example = result.stats.examples
        return result

    def _so_far(self) -> SchedulerRunResult:
        r = self.request
        result = self.template or SchedulerRunResult(r.scheduler, r.profile, r.seed, SuiteStats())
        result.stats = self.stats
        result.stats.examples = max(self.stats.examples, self.examples_started)
        result.isolated = True
        result.call_timeout_s = r.call_timeout_s
        result.time_budget_s = r.time_budget_s
        result.slowest_call = self.slowest
        result.wall_time_s = time.monotonic() - self.started
        return result
