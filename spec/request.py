"""Requests, and the sequences the scheduler makes of them.

A :class:`Request` is what a client submits: a prompt, how many tokens to
generate at most, which tokens stop it, its priority and how many parallel
samples it wants. The scheduler turns it into one sequence per sample. Before
the prompt is done there is a single sequence; when the prompt's last token
has been computed, the request forks into ``n`` samples that share the
prompt's blocks copy-on-write.

A sequence's state is two numbers: its ``tokens`` (prompt, then generated
tokens) and ``num_computed``, how many of them have KV in the cache. Each step
the scheduler gives it some of the ``len(tokens) - num_computed`` tokens left
to compute. A prefill, a chunk of a long prompt, a decode and a resumption
after preemption are all the same thing: catching up. When a sequence has
caught up, the logits of its last token produce its next token.

>>> r = Request(request_id=1, prompt=(5, 6, 7), max_new_tokens=4, stop_tokens=frozenset({0}))
>>> r.max_kv_tokens          # the last generated token is never fed back, so gets no KV
6
>>> Request(request_id=2, prompt=(), max_new_tokens=4)
Traceback (most recent call last):
...
spec.errors.InvalidRequestError: request 2: the prompt is empty
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from spec.errors import InvalidRequestError


class SeqStatus(Enum):
    """Where a sequence is in its life. Only ``RUNNING`` sequences hold device blocks."""

    WAITING = "waiting"  # never admitted, or preempted by recomputation: holds nothing
    RUNNING = "running"  # admitted: holds the blocks for its computed tokens
    SWAPPED = "swapped"  # preempted by swapping: its KV sits in host blocks
    FINISHED = "finished"  # stopped or hit max_new_tokens: holds nothing
    ABORTED = "aborted"  # cancelled by the client: holds nothing


@dataclass(frozen=True)
class Request:
    """One client request. Smaller ``priority`` is served first (like Unix nice).

    ``temperature`` and ``seed`` are for the sampler (0 means greedy); the
    scheduler ignores them. ``request_class`` slices the metrics.
    ``arrival_time`` (seconds) is only used to report latencies in seconds.
    """

    request_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_tokens: frozenset[int] = frozenset()
    priority: int = 0
    n: int = 1
    temperature: float = 0.0
    seed: int = 0
    request_class: str = "default"
    arrival_time: float | None = None

    def __post_init__(self) -> None:
        rid = self.request_id
        if not self.prompt:
            raise InvalidRequestError(f"request {rid}: the prompt is empty")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(
                f"request {rid}: max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if self.n < 1:
            raise InvalidRequestError(f"request {rid}: n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise InvalidRequestError(
                f"request {rid}: temperature must be >= 0, got {self.temperature}"
            )

    @property
    def max_kv_tokens(self) -> int:
        """Tokens of one sample that can ever need KV: prompt + max_new_tokens - 1."""
        return len(self.prompt) + self.max_new_tokens - 1


@dataclass(eq=False)  # identity: queues remove *this* sequence, and fast
class Sequence:
    """One sample of a request, as the scheduler tracks it (mutable, scheduler-owned).

    ``sample_index`` is 0 for the sequence that runs the prompt; forked
    samples are 1 .. n - 1. ``host_blocks`` is non-empty only while swapped.
    """

    seq_id: int
    request: Request
    sample_index: int
    arrival: int  # submission order: ties in priority go to the earlier arrival
    tokens: list[int]
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    forked: bool = False  # True once the request's samples exist (always True when n == 1)
    host_blocks: list[int] = field(default_factory=list)
    preempted: bool = False  # preempted and not yet back: its return is reported as resumed

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def outputs(self) -> tuple[int, ...]:
        return tuple(self.tokens[len(self.request.prompt) :])

    @property
    def remaining(self) -> int:
        """Tokens still to compute before this sequence can sample again."""
        return len(self.tokens) - self.num_computed

    @property
    def seats(self) -> int:
        """Slots in ``max_num_seqs`` it takes: all ``n`` until the fork, so the fork always fits."""
        return 1 if self.forked else self.request.n

    def order_key(self, by_priority: bool) -> tuple[int, int, int]:
        """Who is served first (and preempted last): priority, then arrival, then sample."""
        return (self.request.priority if by_priority else 0, self.arrival, self.sample_index)

    def reset_for_recompute(self) -> None:
        """Forget everything about the KV cache; keep the tokens already generated."""
        self.num_computed = 0
        self.host_blocks = []
        self.status = SeqStatus.WAITING
