"""One example's shared state, which the lockstep's parts read and fail through.

An example is one workload (:class:`~conformance.lockstep.workload.WorkloadConfig`)
driven through the spec and a backend. Its parts (the backend's calls, the KV
and output checks, the poison) report to the same counts and fail the same
way: a :class:`ConformanceFailure` that carries the difference, the log of
operations so far (the replay script) and the configuration (from which a run
finds the failure's cause).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NoReturn

from conformance.judges.compare import Difference
from conformance.lockstep.variants import describe, describe_kv
from conformance.lockstep.workload import WorkloadConfig


class ConformanceFailure(AssertionError):
    """The backend disagreed with the spec; carries the difference and the workload so far (and
    its configuration, from which a run names the failure's cause)."""

    def __init__(
        self, difference: Difference, log: Sequence[str], config: WorkloadConfig | None = None
    ) -> None:
        super().__init__(difference.describe())
        self.difference = difference
        self.log = list(log)
        self.config = config


@dataclass
class Example:
    """A workload's configuration, its log of operations (each a line of Python), the step it
    is at, and the counts of the checks made (the run's, when shared)."""

    config: WorkloadConfig
    log: list[str]
    checks: Counter[str] = field(default_factory=Counter)
    step_index: int = 0

    def fail(self, what: str, detail: str, layer: int | None = None) -> NoReturn:
        """A difference of kind ``what`` at this step."""
        self.raise_for(Difference(what, self.step_index, detail, layer=layer))

    def raise_for(self, diff: Difference) -> NoReturn:
        raise ConformanceFailure(diff, self.log, self.config)

    def named(self, diff: Difference, layer: int) -> Difference:
        """``diff`` with the layer's attention variant and KV dtype (and fp8 scales) named."""
        c = self.config
        kind = f"{describe(c.variant(layer))}; {describe_kv(c.geometry, layer)}"
        return replace(diff, detail=f"{diff.detail} [layer {layer}: {kind}]")
