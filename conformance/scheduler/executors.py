"""What turns a scheduler's decision into sampled tokens, and what a request samples alone.

An :class:`Executor` runs each step of a checked run
(:func:`conformance.scheduler.invariants.run_checked`). The model-free
:class:`TokenFnExecutor` "samples" a token as a fixed function of who and where
(:func:`default_tokens`); :mod:`conformance.scheduler.engine` runs the decision
through a paged KV cache instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from conformance.scheduler.rules import OUTPUTS
from spec.request import Request
from spec.scheduler import Scheduler, SchedulerOutput
from spec.speculative import accepted_prefix

TokenFn = Callable[[Request, int, int], int]


class Executor(Protocol):
    """Runs a step's decision and samples; knows what each request generates alone."""

    @property
    def rule(self) -> str:
        """The name of the final check it makes possible (how its outputs are compared)."""
        ...

    def execute(self, out: SchedulerOutput) -> Mapping[int, int | tuple[int, ...]]:
        """Execute ``out`` and return one sampled token per ``out.samples`` entry's ``seq_id``
        (a speculative row's: its accepted drafts, then the next token)."""
        ...

    def alone(self, request: Request) -> tuple[tuple[int, ...], ...]:
        """Each sample's outputs when the request runs by itself."""
        ...


ExecutorFactory = Callable[[Scheduler, Mapping[int, Request]], Executor]


def default_tokens(request: Request, sample_index: int, position: int) -> int:
    """A deterministic stand-in for sampling: depends only on who and where, never on batching."""
    return (request.request_id * 7919 + sample_index * 104729 + position * 31 + request.seed) % 61


def expected_outputs(
    request: Request, tokens: TokenFn = default_tokens
) -> tuple[tuple[int, ...], ...]:
    """Each sample's outputs when run alone: draw until a stop token or ``max_new_tokens``."""
    outs = []
    for i in range(request.n):
        out: list[int] = []
        while len(out) < request.max_new_tokens:
            out.append(tokens(request, i, len(out)))
            if out[-1] in request.stop_tokens:
                break
        outs.append(tuple(out))
    return tuple(outs)


@dataclass
class TokenFnExecutor:
    """The model-free executor: a sample's token is ``tokens(request, sample, position)``."""

    requests: Mapping[int, Request]
    tokens: TokenFn
    rule: str = OUTPUTS

    def execute(self, out: SchedulerOutput) -> dict[int, int | tuple[int, ...]]:
        drafts = dict(out.drafts)
        sampled: dict[int, int | tuple[int, ...]] = {}
        for s in out.samples:
            request = self.requests[s.request_id]
            if s.seq_id not in drafts:
                sampled[s.seq_id] = self.tokens(request, s.sample_index, s.position)
                continue
            d = drafts[s.seq_id]  # greedy verification against the true tokens
            targets = [self.tokens(request, s.sample_index, s.position + j) for j in range(len(d))]
            targets.append(self.tokens(request, s.sample_index, s.position + len(d)))
            sampled[s.seq_id] = accepted_prefix(d, targets)[1]
        return sampled

    def alone(self, request: Request) -> tuple[tuple[int, ...], ...]:
        return expected_outputs(request, self.tokens)
