"""Hypothesis strategies for scheduler workloads: requests, arrival steps and a configuration.

Drawn to reach the hard paths: block sizes that are not powers of two (3, 5,
6, 12, 48 beside 1, 2, 4, 8, 16), pools barely larger than the largest
request, often exactly its size (preemption, by recomputation and by swapping,
and no deadlock when nearly full), budgets smaller than a prompt (chunked
prefill), prompts that share prefixes (prefix-cache hits), stop tokens,
priorities, ``n > 1`` (forks), aborts, and both preemption modes. Needs
``hypothesis`` (a test dependency).

Laid out for fast generation and shrinking: each request and its arrival
step are one element of a list (deleting it deletes all of it), a run of
token ids is drawn as a length and a seed, not token by token, and the
element strategy is built once, not per example.

>>> [b for b in BLOCK_SIZES if b & (b - 1)]      # the block sizes that are not powers of two
[3, 5, 6, 12, 48]
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache

from hypothesis import strategies as st

from spec.block_manager import cdiv
from spec.request import Request
from spec.scheduler import SchedulerConfig

BLOCK_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 48)
"""Powers of two and not: a scheduler must never assume ``B`` divides anything."""


@dataclass(frozen=True)
class Workload:
    config: SchedulerConfig
    requests: tuple[Request, ...]
    arrivals: dict[int, int]  # request id -> the step before which it is submitted
    aborts: dict[int, int]  # request id -> the step before which it is aborted (if in flight)


@dataclass(frozen=True)
class _Drawn:
    """One request as drawn, before it is numbered and its prompt joined to the shared prefix."""

    head: int  # how many tokens of the shared prefix the prompt starts with
    tail: tuple[int, ...]
    max_new_tokens: int
    stop_tokens: frozenset[int]
    priority: int
    n: int
    temperature: float
    seed: int
    request_class: str
    arrival: int

    def request(self, request_id: int, shared: tuple[int, ...]) -> Request:
        prompt = shared[: self.head] + self.tail
        return Request(
            request_id=request_id,
            prompt=prompt or (self.seed % 61,),
            max_new_tokens=self.max_new_tokens,
            stop_tokens=self.stop_tokens,
            priority=self.priority,
            n=self.n,
            temperature=self.temperature,
            seed=self.seed,
            request_class=self.request_class,
        )


@st.composite
def workloads(
    draw: st.DrawFn,
    *,
    max_requests: int = 6,
    max_prompt: int = 20,
    max_new: int = 8,
    vocab: int = 61,
    sampling: bool = False,
    block_sizes: tuple[int, ...] = BLOCK_SIZES,
) -> Workload:
    """A random workload that every request of which can fit (admission control passes)."""
    block_size = draw(st.sampled_from(block_sizes))
    shared = _tokens(draw, max_prompt, vocab)
    element = _element(max_prompt, max_new, vocab, sampling)
    drawn = draw(st.lists(element, min_size=1, max_size=max_requests))
    requests = tuple(d.request(i, shared) for i, d in enumerate(drawn))
    largest = max(cdiv(r.max_kv_tokens, block_size) for r in requests)
    max_n = max(r.n for r in requests)
    config = SchedulerConfig(
        num_blocks=largest + draw(st.just(0) | st.integers(0, largest // 2)),  # often full
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_num_seqs=draw(st.integers(max_n, max_n + 1) | st.integers(max_n, 8)),  # often few
        max_model_len=max_prompt + max_new,
        max_chunk_tokens=draw(st.none() | st.integers(1, 16)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        preemption=draw(st.sampled_from(["recompute", "swap"])),
        num_host_blocks=draw(st.integers(largest, 3 * largest) | st.integers(0, 3 * largest)),
        enable_prefix_caching=draw(st.booleans()),
    )
    arrivals = {i: d.arrival for i, d in enumerate(drawn)}
    aborts = {}
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):  # now and then, abort at some step
        aborts[draw(st.integers(0, len(requests) - 1))] = draw(st.integers(0, 12))
    return Workload(config, requests, arrivals, aborts)


@cache
def _element(
    max_prompt: int, max_new: int, vocab: int, sampling: bool
) -> st.SearchStrategy[_Drawn]:
    """The strategy of one list element, built once per setting (strategies are costly to make)."""
    return _drawn(max_prompt, max_new, vocab, sampling)


@st.composite
def _drawn(draw: st.DrawFn, max_prompt: int, max_new: int, vocab: int, sampling: bool) -> _Drawn:
    head = draw(st.integers(0, max_prompt))
    return _Drawn(
        head=head,
        tail=_tokens(draw, max_prompt - head, vocab),
        max_new_tokens=draw(st.integers(1, max_new)),
        stop_tokens=frozenset(draw(st.lists(st.integers(0, vocab - 1), max_size=2))),
        priority=draw(st.integers(0, 2)),
        n=draw(st.sampled_from([1, 1, 1, 2, 3])),
        temperature=draw(st.sampled_from([0.0, 1.0])) if sampling else 0.0,
        seed=draw(st.integers(0, 1000)),
        request_class=draw(st.sampled_from(["chat", "batch"])),
        arrival=draw(st.integers(0, 5)),
    )


def _tokens(draw: st.DrawFn, max_len: int, vocab: int) -> tuple[int, ...]:
    """Up to ``max_len`` token ids, from two draws: a length and a seed.

    Which ids a prompt holds matters to a scheduler only through sharing
    (prefix hits) and stop tokens, so they need not shrink one by one.
    """
    length = draw(st.integers(0, max_len))
    rng = random.Random(draw(st.integers(0, 2**16)))
    return tuple(rng.randrange(vocab) for _ in range(length))
