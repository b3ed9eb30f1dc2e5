"""The scheduler invariants by name, the paths a run counts, and what a checked run reports.

Each rule is a sentence a failure names (:class:`SchedulerInvariantError`); the
checks themselves live in :mod:`conformance.scheduler.invariants`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from spec.scheduler import FinishedRequest

BUDGET = "token budget"
SEATS = "max_num_seqs"
SLOTS = "a slot for every scheduled token"
INPUTS = "input tokens are the sequence's tokens"
NO_SKIP = "no running sequence skipped"
INTEGRITY = "block manager integrity"
CALLS = "scheduler calls do not raise"
RETURNS = "scheduler calls return the protocol's types"
CONFIG = "the configuration is not changed"
EXECUTABLE = "decisions the engine can execute"
FINISHED = "finished requests hold nothing"
PROGRESS = "progress (no deadlock)"
BOUNDED = "bounded wait"
FCFS = "FCFS order"
UNIQUE_IDS = "sequence ids unique to one request"
LEAK = "no leak at the end"
OUTPUTS = "outputs as sampled"
DRAFTS = "speculative rows carry the proposed drafts"
VERIFIED = "no drafts in flight between steps"
ACCEPTANCE = "acceptance metrics as verified"
RULES: tuple[str, ...] = (BUDGET, SEATS, SLOTS, INPUTS, NO_SKIP, INTEGRITY, CALLS, FINISHED)
RULES += (PROGRESS, BOUNDED, FCFS, UNIQUE_IDS, LEAK, RETURNS, CONFIG)
"""Every rule a run checks, whatever its executor (which adds its own final rule)."""

PATHS = (
    "aborts",
    "copy-on-write copies",
    "forked samples",
    "multi-token rows (prefill chunks)",
    "preemptions by recomputation",
    "preemptions by swapping",
    "prefix-cache hit tokens",
    "requests finished",
    "single-token rows",
    "steps that preempted",
    "swap-ins",
)
"""The hard paths a run counts (a count of 0 is a path the scheduler never took)."""


class SchedulerInvariantError(AssertionError):
    """A scheduler broke one of the invariants above: ``rule`` at ``step``, and how."""

    def __init__(self, rule: str, step: int, detail: str) -> None:
        super().__init__(f"step {step}: {detail}")
        self.rule, self.step, self.detail = rule, step, detail

    def __reduce__(self) -> tuple[type[SchedulerInvariantError], tuple[str, int, str]]:
        """Pickled as its three fields (an isolated run's child sends it to the parent)."""
        return (type(self), (self.rule, self.step, self.detail))


@dataclass
class RunReport:
    """What a checked run saw: totals, each rule's check count, each path's count, results."""

    steps: int = 0
    tokens: int = 0
    preemptions: int = 0
    swaps: int = 0
    max_running: int = 0
    results: dict[int, FinishedRequest] = field(default_factory=dict)
    checks: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(RULES, 0)))
    paths: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(PATHS, 0)))
