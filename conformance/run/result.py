"""A run's outcome: its verdict, its failing passes (the first is the headline) and what it ran."""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.bounds.checker import BoundsReport
from conformance.judges.compare import Difference
from conformance.lockstep.run_stats import RunStats
from conformance.lockstep.workload import WorkloadConfig
from conformance.run.causes import Cause
from conformance.run.control import RunControl
from conformance.run.failures import PassFailure
from conformance.run.shard import Shard
from spec.capabilities import Capabilities


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


def note_failure_margins(result: RunResult) -> None:
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


def headline_first(result: RunResult, later: PassFailure) -> None:
    """Add ``later`` (a hang or crash the parent saw) after the failures the run already had;
    the first stays the headline."""
    result.failures.append(later)
    restore_headline(result)


def restore_headline(result: RunResult) -> None:
    """The first failing pass as the run's headline difference (there must be one)."""
    restore(result, result.failures[0])


def restore(result: RunResult, failure: PassFailure) -> None:
    result.difference, result.workload = failure.difference, list(failure.workload)
    result.shrunk, result.shrink_note, result.flaky = (
        failure.shrunk,
        failure.shrink_note,
        failure.flaky,
    )
    result.stats.first_failure_example = failure.example
    result.nondeterminism = failure.nondeterminism
