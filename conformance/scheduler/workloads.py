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
token ids is drawn as a length and a seed, not token by token, and every
strategy is built once, not per example.

>>> [b for b in BLOCK_SIZES if b & (b - 1)]      # the block sizes that are not powers of two
[3, 5, 6, 12, 48]
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from functools import cache
from typing import Literal

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
    block_size = draw(_sizes(block_sizes))
    shared = _tokens(draw, max_prompt, vocab)
    drawn = draw(_request_lists(max_requests, max_prompt, max_new, vocab, sampling))
    requests = tuple(d.request(i, shared) for i, d in enumerate(drawn))
    largest = max(cdiv(r.max_kv_tokens, block_size) for r in requests)
    max_n = max(r.n for r in requests)
    config = SchedulerConfig(
        num_blocks=largest + draw(_either(_ints(0, 0), _ints(0, largest // 2))),  # often full
        block_size=block_size,
        max_num_batched_tokens=draw(_ints(1, 48)),
        max_num_seqs=draw(_either(_ints(max_n, max_n + 1), _ints(max_n, 8))),  # often few
        max_model_len=max_prompt + max_new,
        max_chunk_tokens=draw(_CHUNK),
        policy=draw(_POLICY),
        preemption=draw(_PREEMPTION),
        num_host_blocks=draw(_either(_ints(largest, 3 * largest), _ints(0, 3 * largest))),
        enable_prefix_caching=draw(_BOOLEANS),
    )
    arrivals = {i: d.arrival for i, d in enumerate(drawn)}
    aborts = {}
    for _ in range(draw(_ABORTS)):  # now and then, abort at some step
        aborts[draw(_ints(0, len(requests) - 1))] = draw(_ints(0, 12))
    k = draw(_either(_ints(0, 0), _ints(1, 4)))  # drawn last: earlier draws stay as they were
    config = replace(config, num_speculative_tokens=k)
    return Workload(config, requests, arrivals, aborts)


# Strategies are built once and reused: making one costs more than drawing from it.


@cache
def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    return st.integers(low, high)


@cache
def _sizes(block_sizes: tuple[int, ...]) -> st.SearchStrategy[int]:
    return st.sampled_from(block_sizes)


@cache
def _either(a: st.SearchStrategy[int], b: st.SearchStrategy[int]) -> st.SearchStrategy[int]:
    return a | b


_CHUNK: st.SearchStrategy[int | None] = st.none() | st.integers(1, 16)
_POLICY: st.SearchStrategy[Literal["fcfs", "priority"]] = st.sampled_from(("fcfs", "priority"))
_PREEMPTION: st.SearchStrategy[Literal["recompute", "swap"]] = st.sampled_from(
    ("recompute", "swap")
)
_BOOLEANS = st.booleans()
_ABORTS = st.sampled_from((0, 0, 0, 1, 2))
_SAMPLES = st.sampled_from((1, 1, 1, 2, 3))
_TEMPERATURE = {True: st.sampled_from((0.0, 1.0)), False: st.just(0.0)}
_CLASSES = st.sampled_from(("chat", "batch"))


@cache
def _request_lists(
    max_requests: int, max_prompt: int, max_new: int, vocab: int, sampling: bool
) -> st.SearchStrategy[list[_Drawn]]:
    return st.lists(_drawn(max_prompt, max_new, vocab, sampling), min_size=1, max_size=max_requests)


@st.composite
def _drawn(draw: st.DrawFn, max_prompt: int, max_new: int, vocab: int, sampling: bool) -> _Drawn:
    head = draw(_ints(0, max_prompt))
    return _Drawn(
        head=head,
        tail=_tokens(draw, max_prompt - head, vocab),
        max_new_tokens=draw(_ints(1, max_new)),
        stop_tokens=frozenset(draw(_stop_tokens(vocab))),
        priority=draw(_ints(0, 2)),
        n=draw(_SAMPLES),
        temperature=draw(_TEMPERATURE[sampling]),
        seed=draw(_ints(0, 1000)),
        request_class=draw(_CLASSES),
        arrival=draw(_ints(0, 5)),
    )


@cache
def _stop_tokens(vocab: int) -> st.SearchStrategy[list[int]]:
    return st.lists(_ints(0, vocab - 1), max_size=2)


def _tokens(draw: st.DrawFn, max_len: int, vocab: int) -> tuple[int, ...]:
    """Up to ``max_len`` token ids, from two draws: a length and a seed.

    Which ids a prompt holds matters to a scheduler only through sharing
    (prefix hits) and stop tokens, so they need not shrink one by one.
    """
    length = draw(_ints(0, max_len))
    rng = random.Random(draw(_ints(0, 2**16)))
    return tuple(rng.randrange(vocab) for _ in range(length))
