"""Static (request-level) batching: wait until a batch fills, then run it to completion.

A driver submits requests at random steps to ``StaticScheduler(config,
max_wait_steps=K)`` and checks every step: nobody joins a batch in flight; a
batch starts only when it is full (every seat taken, or the next request
would not fit the pool at its worst case) or its first request has waited
``K`` steps; it never idles when it could start; a batch never preempts; and
each request generates exactly what it generates alone, every block returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.scheduler.executors import default_tokens, expected_outputs
from conformance.scheduler.invariants import run_checked
from spec.block_manager import cdiv
from spec.errors import ArgumentTypeError, ArgumentValueError
from spec.request import Request
from spec.scheduler import SchedulerConfig, StaticScheduler


@dataclass
class _Batch:
    start: int
    members: set[int]
    lobby_before: list[int]  # request ids waiting when it started, in arrival order


def _drive(
    sched: StaticScheduler, requests: list[Request], arrivals: dict[int, int]
) -> list[_Batch]:
    """Run to the end, checking the static rules each step; return the batches seen."""
    cfg, k = sched.config, sched.max_wait_steps
    by_id = {r.request_id: r for r in requests}
    submitted_at: dict[int, int] = {}
    lobby: list[int] = []
    batches: list[_Batch] = []
    step = 0
    work = sum((k + 2 + len(r.prompt) + r.max_new_tokens) * r.n for r in requests)
    while step <= max(arrivals.values()) or sched.has_unfinished():
        assert step < max(arrivals.values()) + work, f"not finished within {step} steps"
        for r in requests:
            if arrivals[r.request_id] == step:
                sched.submit(r)
                submitted_at[r.request_id] = step
                lobby.append(r.request_id)
        in_flight = sched.batch_running
        filling = sched.waiting_to_fill()
        out = sched.step()
        assert not out.preempted, f"step {step}: a static batch preempted"
        started = {x.request_id for x in _rows(sched, out.batch.seq_ids)}
        assert started <= sched.batch, f"step {step}: {started} are not in {sched.batch}"
        launched = not in_flight and bool(sched.batch)
        if launched:
            batch = _Batch(step, set(sched.batch), list(lobby))
            _check_launch(cfg, k, batch, by_id, submitted_at, step)
            batches.append(batch)
            lobby = [rid for rid in lobby if rid not in batch.members]
        else:
            assert not in_flight or sched.batch == batches[-1].members, f"step {step}: joined"
        assert filling == (not in_flight and bool(lobby) and not launched), f"step {step}"
        if filling:  # idle: not full, and time is left
            assert not out.scheduled and step - submitted_at[lobby[0]] < k, f"step {step}"
        sampled = {
            x.seq_id: default_tokens(by_id[x.request_id], x.sample_index, x.position)
            for x in out.samples
        }
        sched.update(sampled)
        sched.check_integrity()
        step += 1
    for r in requests:
        assert sched.result(r.request_id).outputs == expected_outputs(r)
    assert sched.manager.pool.num_held == 0
    return batches


def _rows(sched: StaticScheduler, seq_ids: tuple[int, ...]) -> list[Request]:
    """The request of each scheduled sequence."""
    by_seq = {s.seq_id: s.request for s in sched.sequences()}
    return [by_seq[s] for s in seq_ids]


def _check_launch(
    cfg: SchedulerConfig,
    k: int,
    batch: _Batch,
    by_id: dict[int, Request],
    submitted_at: dict[int, int],
    step: int,
) -> None:
    """A batch is the lobby's longest fitting prefix, and it started full or timed out."""
    lobby = batch.lobby_before
    size = len(batch.members)
    assert batch.members == set(lobby[:size]), f"step {step}: {batch.members} not a prefix"
    seats = sum(by_id[r].n for r in lobby[:size])
    worst = sum(by_id[r].n * cdiv(by_id[r].max_kv_tokens, cfg.block_size) for r in lobby[:size])
    if size < len(lobby):  # the next one was left out: it must not have fitted
        nxt = by_id[lobby[size]]
        extra = nxt.n * cdiv(nxt.max_kv_tokens, cfg.block_size)
        assert seats + nxt.n > cfg.max_num_seqs or worst + extra > cfg.num_blocks or size == 1
    full = size < len(lobby) or seats == cfg.max_num_seqs or worst > cfg.num_blocks
    assert full or step - submitted_at[lobby[0]] >= k, f"step {step}: started neither full nor late"


@given(
    seats=st.integers(1, 4),
    k=st.integers(1, 6),
    spec=st.lists(
        st.tuples(
            st.integers(0, 12), st.integers(1, 6), st.integers(1, 5), st.sampled_from([1, 2])
        ),
        min_size=1,
        max_size=8,
    ),
    spare=st.integers(0, 12),
)
def test_a_batch_waits_to_fill_then_runs_to_completion(
    seats: int, k: int, spec: list[tuple[int, int, int, int]], spare: int
) -> None:
    seats = max(seats, max(n for *_, n in spec))
    requests = [
        Request(request_id=i, prompt=(i + 1,) * p, max_new_tokens=m, n=n, seed=i)
        for i, (_, p, m, n) in enumerate(spec)
    ]
    arrivals = {i: a for i, (a, *_) in enumerate(spec)}
    largest = max(r.n * cdiv(r.max_kv_tokens, 2) for r in requests)
    cfg = SchedulerConfig(
        num_blocks=largest + spare, block_size=2, max_num_batched_tokens=16, max_num_seqs=seats
    )
    _drive(StaticScheduler(cfg, max_wait_steps=k), requests, arrivals)


def test_a_batch_that_fills_its_seats_starts_at_once() -> None:
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=3)
    reqs = [Request(request_id=i, prompt=(1, 2), max_new_tokens=2) for i in range(4)]
    batches = _drive(StaticScheduler(cfg, max_wait_steps=50), reqs, {0: 0, 1: 2, 2: 4, 3: 5})
    assert [(b.start, b.members) for b in batches] == [(4, {0, 1, 2}), (55, {3})]


def test_a_batch_the_pool_cannot_grow_starts_at_once() -> None:
    """The pool holds two requests' worst case: the third waits, and the first two go now."""
    cfg = SchedulerConfig(num_blocks=4, block_size=4, max_num_seqs=8)
    reqs = [Request(request_id=i, prompt=(1,) * 5, max_new_tokens=4) for i in range(3)]  # 2 blocks
    batches = _drive(StaticScheduler(cfg, max_wait_steps=50), reqs, {0: 0, 1: 0, 2: 0})
    assert [(b.start, b.members) for b in batches] == [(0, {0, 1}), (50, {2})]


def test_taking_what_is_waiting_never_idles_and_passes_the_invariants() -> None:
    """``max_wait_steps=0``: the greedy variant; the scheduler-invariant checker accepts it."""
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=3)
    reqs = [Request(request_id=i, prompt=(1, 2), max_new_tokens=2) for i in range(4)]
    batches = _drive(StaticScheduler(cfg), reqs, {0: 0, 1: 2, 2: 4, 3: 5})
    assert [(b.start, b.members) for b in batches] == [(0, {0}), (2, {1}), (4, {2}), (6, {3})]
    report = run_checked(partial(StaticScheduler, max_wait_steps=0), cfg, reqs)
    assert len(report.results) == 4


@pytest.mark.parametrize(("value", "error"), [(-1, ArgumentValueError), (2.0, ArgumentTypeError)])
def test_max_wait_steps_is_checked(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="max_wait_steps"):
        StaticScheduler(SchedulerConfig(num_blocks=4, block_size=4), max_wait_steps=value)  # type: ignore[arg-type]
