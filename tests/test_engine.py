"""Token-exact equivalence: batching never changes what a request generates.

For random arrival patterns, budgets, pool and block sizes, policies and
preemption modes, every sample of every request, run through the engine
(chunked prefill, preemption by recomputation or swapping, prefix-cache hits,
forks with copy-on-write), generates exactly the tokens it generates alone
with plain contiguous attention, greedy and seeded. The Hypothesis runs use
the fast backends (the spec's reference, eager PyTorch); the Triton backend
runs a fixed workload that exercises every path.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings

from conformance.scheduler.workloads import Workload, workloads
from paged_spec.engine.loop import Engine
from paged_spec.engine.tiny_model import SMALL, TinyModel, generate_alone
from paged_spec.engine_demo import make_backend
from spec.backend import Backend, ReferenceBackend
from spec.request import Request
from spec.scheduler import (
    ContinuousScheduler,
    SchedulerConfig,
    SchedulerOutput,
    StaticScheduler,
)

MODEL = TinyModel(SMALL)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny matrices: one thread is ~100x faster than several contending for 2 cores."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _check_equivalent(
    w: Workload, backend: Backend, cls: type[ContinuousScheduler] = ContinuousScheduler
) -> tuple[Engine, list[SchedulerOutput]]:
    engine = Engine(MODEL, backend, cls(w.config))
    outs = []
    pending = sorted(w.requests, key=lambda r: w.arrivals.get(r.request_id, 0))
    step = 0
    while pending or engine.scheduler.has_unfinished():
        while pending and w.arrivals.get(pending[0].request_id, 0) <= step:
            engine.submit(pending.pop(0))
        for rid, when in w.aborts.items():
            if when == step and rid in engine.requests and rid not in engine.finished:
                engine.abort(rid)
        outs.append(engine.step())
        engine.scheduler.manager.check_integrity()
        step += 1
    assert engine.scheduler.manager.pool.num_held == 0
    for r in w.requests:
        done = engine.finished[r.request_id]
        for i, got in enumerate(done.outputs):
            alone = generate_alone(MODEL, r, i)
            if done.aborted:  # what it generated before the abort
                alone = alone[: len(got)]
            assert got == alone, _diff(r, i, got, alone)
        assert done.aborted or len(done.outputs) == r.n
    return engine, outs


def _diff(r: Request, sample: int, got: tuple[int, ...], alone: tuple[int, ...]) -> str:
    j = next((j for j, (a, b) in enumerate(zip(got, alone, strict=False)) if a != b), None)
    where = f"token {j}: {got[j]} vs {alone[j]}" if j is not None else "lengths differ"
    return f"request {r.request_id} sample {sample}: batched {got} vs alone {alone} ({where})"


@pytest.mark.parametrize("cls", [ContinuousScheduler, StaticScheduler], ids=lambda c: c.__name__)
@given(w=workloads(max_requests=6, max_prompt=20, max_new=8, sampling=True))
def test_batched_equals_alone_reference_backend(
    cls: type[ContinuousScheduler], w: Workload
) -> None:
    _check_equivalent(w, ReferenceBackend(), cls)


@given(w=workloads(max_requests=6, max_prompt=20, max_new=8, sampling=True))
def test_batched_equals_alone_torch_backend(w: Workload) -> None:
    _check_equivalent(w, make_backend("torch"))


# The Triton interpreter is slow on CPU: a sixth of the profile's examples.
@settings(max_examples=max(1, settings().max_examples // 6))
@given(w=workloads(max_requests=4, max_prompt=16, max_new=6, sampling=True))
def test_batched_equals_alone_triton_backend(w: Workload) -> None:
    _check_equivalent(w, make_backend("triton"))


# A fixed workload that takes every path: chunked prompts, a shared prefix,
# forks (n = 3), a stop token, and a pool small enough to preempt.
_FIXED_REQUESTS = tuple(
    Request(
        request_id=i,
        prompt=tuple((7 * i + j) % 64 for j in range(3 + (5 * i) % 11))
        if i % 3
        else (1, 2, 3, 4, 5, 6, 7, 8, 9, i),
        max_new_tokens=3 + i % 4,
        n=3 if i == 5 else 1,
        temperature=1.0 if i % 2 else 0.0,
        seed=i,
        stop_tokens=frozenset({5}),
    )
    for i in range(8)
)


def _fixed(preemption: str) -> Workload:
    cfg = SchedulerConfig(
        num_blocks=11,
        block_size=4,
        max_num_batched_tokens=12,
        max_num_seqs=6,
        preemption=preemption,  # type: ignore[arg-type]
        num_host_blocks=12,
        enable_prefix_caching=True,
    )
    return Workload(cfg, _FIXED_REQUESTS, {i: i // 2 for i in range(8)}, aborts={})


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_fixed_workload_takes_every_path(preemption: str) -> None:
    engine, outs = _check_equivalent(_fixed(preemption), ReferenceBackend())
    totals = engine.scheduler.metrics.totals()
    assert totals["preemptions"] > 0 and totals["prefix_hit_rate"] > 0
    assert any(o.batch.copies for o in outs)  # the fork's copy-on-write
    assert max(s.num_tokens for s in engine.scheduler.metrics.steps) == 12  # a chunked step
    if preemption == "swap":
        assert totals["swaps_out"] > 0


def test_triton_backend_is_token_exact() -> None:
    pytest.importorskip("triton")
    _check_equivalent(_fixed("swap"), make_backend("triton"))


class _SkipsCopies(ReferenceBackend):
    def copy_blocks(self, copies: object) -> None:
        pass


def test_equivalence_check_can_fail() -> None:
    """An engine that skips the copy-on-write copies diverges from the unbatched run."""
    with pytest.raises(AssertionError, match="request 5 sample"):
        _check_equivalent(_fixed("recompute"), _SkipsCopies())
