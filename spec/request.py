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

>>> r = Request(request_id=1, prompt=[5, 6, 7], max_new_tokens=4, stop_tokens={0})
>>> r.prompt, r.stop_tokens  # normalised: a tuple of ints, a frozenset
((5, 6, 7), frozenset({0}))
>>> r.max_kv_tokens          # the last generated token is never fed back, so gets no KV
6

A request is checked when it is made, so that nothing about it can fail
later inside a step: every field has its type and range, and the error names it.

>>> Request(request_id=2, prompt=(), max_new_tokens=4)
Traceback (most recent call last):
...
spec.errors.ArgumentValueError: prompt of request 2 must hold at least one token, got ()
>>> Request(request_id=3, prompt=(1, 2), max_new_tokens=4, stop_tokens=5)
Traceback (most recent call last):
...
spec.errors.ArgumentTypeError: stop_tokens must be a sequence of ints, got int 5
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from spec.errors import ArgumentValueError
from spec.validate import (
    check_int,
    check_positive,
    check_real,
    check_str,
    check_token_ids,
    check_token_set,
)


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

    Validated at construction, each field naming itself when wrong: ``prompt``
    is a non-empty sequence of token ids (stored as a tuple of ints);
    ``max_new_tokens`` and ``n`` are ints >= 1; ``priority`` and ``seed`` are
    ints (not bools, floats or strings); ``stop_tokens`` is a set or sequence
    of token ids (stored as a frozenset); ``temperature`` is finite and >= 0;
    ``request_class`` is a str; ``arrival_time`` is None or finite.
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
        rid = check_int("request_id", self.request_id, low=0)
        prompt = check_token_ids("prompt", self.prompt)
        if not prompt:
            raise ArgumentValueError(
                f"prompt of request {rid} must hold at least one token, got {self.prompt!r}"
            )
        arrival = self.arrival_time
        fields = {
            "request_id": rid,
            "prompt": prompt,
            "max_new_tokens": check_positive("max_new_tokens", self.max_new_tokens),
            "stop_tokens": check_token_set("stop_tokens", self.stop_tokens),
            "priority": check_int("priority", self.priority),
            "n": check_positive("n", self.n),
            "temperature": check_real("temperature", self.temperature, low=0.0),
            "seed": check_int("seed", self.seed),
            "request_class": check_str("request_class", self.request_class),
            "arrival_time": None if arrival is None else check_real("arrival_time", arrival),
        }
        for name, value in fields.items():  # normalised: numpy ints to int, lists to tuples
            object.__setattr__(self, name, value)

    @property
    def max_kv_tokens(self) -> int:
        """Tokens of one sample that can ever need KV: prompt + max_new_tokens - 1."""
        return len(self.prompt) + self.max_new_tokens - 1


@dataclass(eq=False)  # identity: queues remove *this* sequence, and fast
class Sequence:
    """One sample of a request, as the scheduler tracks it (mutable, scheduler-owned).

    ``sample_index`` is 0 for the sequence that runs the prompt; forked
    samples are 1 .. n - 1. ``rank`` orders service (smallest first) and
    preemption (largest first); it is fixed for the sequence's life, so no
    queue ever needs re-sorting (:mod:`spec.sched_policy` says how it is made).
    What the sequence holds in memory (device or host blocks) is the memory
    side's business: :class:`spec.cache_manager.CacheManager` knows it.
    """

    seq_id: int
    request: Request
    sample_index: int
    arrival: int  # submission order: ties in rank go to the earlier arrival
    tokens: list[int]
    rank: tuple[int, int, int]
    submit_step: int = 0  # the scheduler step its request was submitted at
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    forked: bool = False  # True once the request's samples exist (always True when n == 1)
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

    def reset_for_recompute(self) -> None:
        """Forget everything about the KV cache; keep the tokens already generated."""
        self.num_computed = 0
        self.status = SeqStatus.WAITING
