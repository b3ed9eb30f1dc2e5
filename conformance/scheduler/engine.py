"""The scheduler suite's executor: each decision run through the engine loop, then compared alone.

An :class:`EngineExecutor` plugs into :func:`conformance.scheduler.invariants.run_checked`:
every step the scheduler under test decides, the engine's
:class:`~paged_spec.engine.loop.StepExecutor` runs that decision on the
spec's :class:`~spec.backend.ReferenceBackend` with the tiny model
(:data:`paged_spec.engine.tiny_model.SMALL`), in the order
:class:`spec.scheduler.SchedulerOutput` prescribes: swap-outs, copy-on-write
copies, swap-ins, the forward pass, one token per
:class:`spec.scheduler.SampleSlot`.

At the end the checker compares every sample with the same model run alone
(:func:`~paged_spec.engine.tiny_model.generate_alone`): token-exact equivalence.

A scheduler that cannot drive a real engine (one that only costs batches for a
simulator, say) says so with a class attribute ``engine_loop_unsupported =
"why"``; the suite then reports the equivalence check as skipped, with that reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from paged_spec.engine.loop import StepExecutor
from paged_spec.engine.tiny_model import SMALL, TinyModel, generate_alone
from spec.backend import ReferenceBackend
from spec.request import Request
from spec.scheduler import Scheduler, SchedulerOutput

EQUIVALENCE = "token-exact equivalence"
"""The rule an engine run checks at the end (and the name its report uses)."""

MODEL = TinyModel(SMALL)
"""The one model every check uses (its weights are fixed by its seed)."""


def engine_unsupported(scheduler: Scheduler) -> str | None:
    """Why ``scheduler`` cannot drive the engine loop (its own word), or None if it can."""
    why = getattr(scheduler, "engine_loop_unsupported", None)
    return None if why is None else str(why)


@dataclass
class EngineExecutor:
    """Runs each step through the engine loop with the tiny model; see the module docstring."""

    scheduler: Scheduler
    requests: Mapping[int, Request]
    rule: str = EQUIVALENCE
    backend: ReferenceBackend = field(default_factory=ReferenceBackend)

    def __post_init__(self) -> None:
        self.steps = StepExecutor(MODEL, self.backend, self.scheduler.config)

    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        return self.steps.execute(out, self.requests)

    def alone(self, request: Request) -> tuple[tuple[int, ...], ...]:
        return tuple(generate_alone(MODEL, request, i) for i in range(request.n))
