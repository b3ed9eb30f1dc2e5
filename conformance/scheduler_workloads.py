"""Hypothesis strategies for scheduler workloads: requests, arrival steps and a configuration.

Drawn to reach the hard paths: pools barely larger than the largest request
(preemption, and no deadlock when nearly full), budgets smaller than a prompt
(chunked prefill), prompts that share prefixes (prefix-cache hits), stop
tokens, priorities, ``n > 1`` (forks), and both preemption modes. Needs
``hypothesis`` (a test dependency).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from spec.block_manager import cdiv
from spec.request import Request
from spec.scheduler import SchedulerConfig


@dataclass(frozen=True)
class Workload:
    config: SchedulerConfig
    requests: tuple[Request, ...]
    arrivals: dict[int, int]  # request id -> the step before which it is submitted
    aborts: dict[int, int]  # request id -> the step before which it is aborted (if in flight)


@st.composite
def workloads(
    draw: st.DrawFn,
    *,
    max_requests: int = 6,
    max_prompt: int = 20,
    max_new: int = 8,
    vocab: int = 61,
    sampling: bool = False,
) -> Workload:
    """A random workload that every request of which can fit (admission control passes)."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    shared = draw(st.lists(st.integers(0, vocab - 1), min_size=max_prompt, max_size=max_prompt))
    requests = []
    for rid in range(draw(st.integers(1, max_requests) | st.just(max_requests))):
        head = draw(st.integers(0, max_prompt))
        tail = draw(st.lists(st.integers(0, vocab - 1), max_size=max_prompt - head))
        prompt = tuple(shared[:head]) + tuple(tail)
        if not prompt:
            prompt = (draw(st.integers(0, vocab - 1)),)
        requests.append(
            Request(
                request_id=rid,
                prompt=prompt,
                max_new_tokens=draw(st.integers(1, max_new)),
                stop_tokens=frozenset(draw(st.lists(st.integers(0, vocab - 1), max_size=2))),
                priority=draw(st.integers(0, 2)),
                n=draw(st.sampled_from([1, 1, 1, 2, 3])),
                temperature=draw(st.sampled_from([0.0, 1.0])) if sampling else 0.0,
                seed=draw(st.integers(0, 1000)),
                request_class=draw(st.sampled_from(["chat", "batch"])),
            )
        )
    largest = max(cdiv(r.max_kv_tokens, block_size) for r in requests)
    max_n = max(r.n for r in requests)
    config = SchedulerConfig(
        num_blocks=largest + draw(st.integers(0, largest // 2)),
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_num_seqs=draw(st.integers(max_n, 8)),
        max_model_len=max_prompt + max_new,
        max_chunk_tokens=draw(st.none() | st.integers(1, 16)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        preemption=draw(st.sampled_from(["recompute", "swap"])),
        num_host_blocks=draw(st.integers(0, 3 * largest)),
        enable_prefix_caching=draw(st.booleans()),
    )
    arrivals = {r.request_id: draw(st.integers(0, 5)) for r in requests}
    aborts = {}
    if draw(st.integers(0, 3)) == 0:  # now and then, abort a request at some step
        aborts[draw(st.sampled_from(requests)).request_id] = draw(st.integers(0, 12))
    return Workload(config, tuple(requests), arrivals, aborts)
