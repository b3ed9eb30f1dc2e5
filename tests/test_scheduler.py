"""The scheduler's invariants, on random workloads, for every scheduler implementation.

The checker (:mod:`conformance.scheduler.invariants`) drives a scheduler with a
fixed "sampling" function, so these runs need no model: they check budgets,
seats, slots, integrity, progress, FCFS order, no leaks, and that every
request generates exactly what it generates alone. Deliberately broken
schedulers show the checker can fail. Unit tests pin the preemption rules and
admission control.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.scheduler.executors import default_tokens, expected_outputs
from conformance.scheduler.invariants import run_checked
from conformance.scheduler.rules import SchedulerInvariantError
from conformance.scheduler.workloads import Workload, workloads
from spec.block_manager import cdiv
from spec.errors import CapacityError, InvalidRequestError
from spec.request import Request, SeqStatus, Sequence
from spec.sched_continuous import _Plan
from spec.scheduler import (
    ContinuousScheduler,
    FinishedRequest,
    Scheduler,
    SchedulerConfig,
    StaticScheduler,
)

SCHEDULERS = [ContinuousScheduler, StaticScheduler]


def _run(cls: type[ContinuousScheduler], w: Workload) -> None:
    run_checked(cls, w.config, w.requests, w.arrivals, aborts=w.aborts)


@pytest.mark.parametrize("cls", SCHEDULERS, ids=lambda c: c.__name__)
@given(w=workloads(max_requests=10, max_prompt=24, max_new=10))
def test_invariants_hold_on_random_workloads(cls: type[ContinuousScheduler], w: Workload) -> None:
    _run(cls, w)


@pytest.mark.parametrize("cls", SCHEDULERS, ids=lambda c: c.__name__)
@given(w=workloads(max_requests=8, max_prompt=12, max_new=6))
def test_nearly_full_pool_never_deadlocks(cls: type[ContinuousScheduler], w: Workload) -> None:
    """The smallest pool that admits the largest request: constant preemption, still done."""
    need = max(cdiv(r.max_kv_tokens, w.config.block_size) for r in w.requests)
    cfg = dataclasses.replace(w.config, num_blocks=need)
    report = run_checked(cls, cfg, w.requests, w.arrivals, aborts=w.aborts)
    assert len(report.results) == len(w.requests)


def test_scheduler_protocol_is_satisfied() -> None:
    cfg = SchedulerConfig(num_blocks=4, block_size=4)
    assert isinstance(ContinuousScheduler(cfg), Scheduler)
    assert isinstance(StaticScheduler(cfg), Scheduler)


# -- the checker catches broken schedulers ------------------------------------------------


class _BudgetBlind(ContinuousScheduler):
    """Ignores the token budget when chunking."""

    def _chunk_limit(self, plan: _Plan) -> int:
        return 10**6


class _LeaksFinished(ContinuousScheduler):
    """Forgets to free a sequence that finished."""

    def _release(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            del self._running[seq.seq_id]
        else:
            super()._release(seq)


class _PreemptsScheduled(ContinuousScheduler):
    """Picks the best running sequence as the victim, even one already scheduled this step."""

    def _schedule_running(self, plan: _Plan) -> None:
        for seq in sorted(self._running.values(), key=lambda s: s.rank):
            k = self._chunk(seq, plan)
            if seq.seq_id not in self._running or k == 0:
                continue
            while not self.cache.can_grow(seq.seq_id, k):
                others = sorted(
                    (s for s in self._running.values() if s is not seq), key=lambda s: s.rank
                )
                self._preempt(others[0] if others else seq, plan)
                if not others:
                    break
            else:
                self.cache.grow(seq.seq_id, seq.tokens[seq.num_computed : seq.num_computed + k])
                self._charge(seq, k, plan)


class _SkipsAfterVictim(ContinuousScheduler):
    """Stops scheduling running sequences once it has preempted one."""

    def _preempt(self, seq: Sequence, plan: _Plan) -> None:
        super()._preempt(seq, plan)
        self._stop = True

    def _chunk(self, seq: Sequence, plan: _Plan) -> int:
        if getattr(self, "_stop", False):
            self._stop = False
            return 0
        return super()._chunk(seq, plan)


class _Overtakes(ContinuousScheduler):
    """Admits the newest waiting request first (LIFO)."""

    def _next_candidate(self) -> Sequence | None:
        if self._swapped:
            return super()._next_candidate()
        return max(self._waiting, key=lambda s: s.rank, default=None)


_PRESSURE = SchedulerConfig(num_blocks=8, block_size=2, max_num_batched_tokens=8, max_num_seqs=4)
_REQS = [  # prompts of 1, 4, 2, 5, 3, 1 tokens, 6 new tokens each: 5 preemptions when correct
    Request(request_id=i, prompt=tuple(range(1, 2 + (i * 3) % 5)), max_new_tokens=6, seed=i)
    for i in range(6)
]


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (_BudgetBlind, "budget"),
        (_LeaksFinished, "holds blocks"),
        (_PreemptsScheduled, "raised"),
        (_SkipsAfterVictim, "skipped"),
        (_Overtakes, "FCFS"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else x,
)
def test_checker_catches_broken_schedulers(broken: type[ContinuousScheduler], message: str) -> None:
    assert (
        run_checked(ContinuousScheduler, _PRESSURE, _REQS).preemptions == 5
    )  # the real one passes
    with pytest.raises(SchedulerInvariantError) as info:
        run_checked(broken, _PRESSURE, _REQS)
    assert message in str(info.value)


# -- unit tests: admission control, preemption rules, policies ---------------------------


def test_admission_control_rejects_what_can_never_fit() -> None:
    s = ContinuousScheduler(SchedulerConfig(num_blocks=2, block_size=4, max_model_len=12))
    with pytest.raises(CapacityError, match="exceeds max_model_len 12"):
        s.submit(Request(request_id=0, prompt=(1,) * 10, max_new_tokens=3))
    with pytest.raises(CapacityError, match="need 3 blocks of 4, but the whole pool has 2"):
        s.submit(Request(request_id=1, prompt=(1,) * 9, max_new_tokens=2))
    s.submit(Request(request_id=2, prompt=(1,) * 8, max_new_tokens=1))  # 8 KV tokens: 2 blocks
    assert s.has_unfinished()


def test_preemption_takes_the_latest_arrival_and_keeps_its_tokens() -> None:
    cfg = SchedulerConfig(num_blocks=3, block_size=2, max_num_batched_tokens=16)
    s = ContinuousScheduler(cfg)
    s.submit(Request(request_id=0, prompt=(1, 2, 3), max_new_tokens=3))
    s.submit(Request(request_id=1, prompt=(4,), max_new_tokens=3))
    out = s.step()
    assert out.scheduled == ((0, 3), (1, 1))
    s.update({0: 10, 1: 11})
    out = s.step()  # both decode: 0 fits in its block 2... 1 needs a second block
    s.update({x.seq_id: 12 for x in out.samples})
    out = s.step()  # 0 needs block 3 at position 5: the pool is dry, 1 (later arrival) goes
    assert out.preempted == (1,)
    assert [seq for seq, _ in out.scheduled] == [0]
    assert 1 not in s.manager
    s.update({x.seq_id: 13 for x in out.samples})
    results: dict[int, FinishedRequest] = {}
    while s.has_unfinished():
        out = s.step()
        for done in s.update({x.seq_id: 14 for x in out.samples}):
            results[done.request_id] = done
    assert results[1].outputs == ((11, 12, 14),)  # generated tokens survived recomputation


def test_priority_policy_preempts_lowest_priority_even_if_earlier() -> None:
    cfg = SchedulerConfig(num_blocks=3, block_size=2, max_num_batched_tokens=16, policy="priority")
    s = ContinuousScheduler(cfg)
    s.submit(Request(request_id=0, prompt=(1, 2, 3), max_new_tokens=3, priority=5))
    s.submit(Request(request_id=1, prompt=(4,), max_new_tokens=3, priority=0))
    for _ in range(3):
        out = s.step()
        s.update({x.seq_id: 9 for x in out.samples})
    assert out.preempted == (0,)


def test_swap_preemption_moves_blocks_to_host_and_back() -> None:
    cfg = SchedulerConfig(
        num_blocks=3, block_size=2, max_num_batched_tokens=16, preemption="swap", num_host_blocks=4
    )
    s = ContinuousScheduler(cfg)
    s.submit(Request(request_id=0, prompt=(1, 2, 3), max_new_tokens=3))
    s.submit(Request(request_id=1, prompt=(4,), max_new_tokens=3))
    outs = []
    while s.has_unfinished():
        outs.append(s.step())
        s.update({x.seq_id: 9 for x in outs[-1].samples})
    outs_swap = [o for o in outs if o.swap_out]
    outs_in = [o for o in outs if o.swap_in]
    assert outs_swap and outs_in
    assert outs_swap[0].swap_out[0].seq_id == 1 and outs_in[0].swap_in[0].seq_id == 1
    assert s.host.num_free == 4


def test_step_and_update_must_alternate_and_report_every_sample() -> None:
    s = ContinuousScheduler(SchedulerConfig(num_blocks=4, block_size=4))
    s.submit(Request(request_id=0, prompt=(1, 2), max_new_tokens=2, n=2))
    with pytest.raises(InvalidRequestError, match="without a step"):
        s.update({})
    out = s.step()
    assert [(x.seq_id, x.sample_index) for x in out.samples] == [(0, 0), (1, 1)]
    with pytest.raises(InvalidRequestError, match="update"):
        s.step()
    with pytest.raises(InvalidRequestError, match=r"sampled .* missing \[1\]"):
        s.update({0: 5})
    s.update({0: 5, 1: 6})  # the fork: both samples share the prompt's block
    assert s.manager.block_table(0) == s.manager.block_table(1)
    out = s.step()
    assert out.batch.copies  # the first write into the shared block copies it


def test_abort_frees_blocks_now() -> None:
    s = ContinuousScheduler(SchedulerConfig(num_blocks=4, block_size=4))
    s.submit(Request(request_id=0, prompt=(1, 2, 3, 4, 5), max_new_tokens=4))
    s.update({x.seq_id: 1 for x in s.step().samples})
    assert s.manager.pool.num_held == 2
    s.abort(0)
    assert s.manager.pool.num_held == 0 and s.result(0).aborted
    assert not s.has_unfinished()


@given(st.integers(1, 6), st.integers(1, 40))
def test_static_batching_never_refills_mid_batch(n_requests: int, budget: int) -> None:
    cfg = SchedulerConfig(
        num_blocks=64, block_size=4, max_num_batched_tokens=budget, max_num_seqs=2
    )
    reqs = [
        Request(request_id=i, prompt=(i + 1,) * 3, max_new_tokens=1 + 2 * i)
        for i in range(n_requests)
    ]
    s = StaticScheduler(cfg)
    for r in reqs:
        s.submit(r)
    batches: list[set[int]] = []
    while s.has_unfinished():
        out = s.step()
        ids = {x.request_id for x in out.samples}
        if ids and (not batches or not ids <= batches[-1]):
            batches.append(set(ids))
        s.update({x.seq_id: default_tokens(reqs[x.request_id], 0, x.position) for x in out.samples})
    for r in reqs:
        assert s.result(r.request_id).outputs == expected_outputs(r)
    # requests 0,1 form the first batch; 2 cannot start until both are done
    assert batches[0] <= {0, 1}


@given(w=workloads(max_requests=8, max_prompt=16, max_new=8))
def test_host_pool_holds_exactly_the_swapped_sequences(w: Workload) -> None:
    """Every step, the host blocks held are those of swapped sequences, none twice."""
    cfg = SchedulerConfig(
        num_blocks=w.config.num_blocks,
        block_size=w.config.block_size,
        max_num_batched_tokens=w.config.max_num_batched_tokens,
        max_num_seqs=w.config.max_num_seqs,
        max_model_len=w.config.max_model_len,
        preemption="swap",
        num_host_blocks=w.config.num_host_blocks,
    )
    s = ContinuousScheduler(cfg)
    for r in w.requests:
        s.submit(r)
    while s.has_unfinished():
        out = s.step()
        for swap in out.swap_out:
            assert len(swap.device_blocks) == len(swap.host_blocks)
        s.update(
            {x.seq_id: default_tokens(w.requests[x.request_id], 0, x.position) for x in out.samples}
        )
        swapped = [q.seq_id for q in s.sequences() if q.status is SeqStatus.SWAPPED]
        held = [b for seq_id in swapped for b in s.cache.host_blocks(seq_id)]
        s.host.check_integrity(held)
        s.check_integrity()
    assert s.host.num_free == cfg.num_host_blocks


def test_bad_update_changes_nothing() -> None:
    s = ContinuousScheduler(SchedulerConfig(num_blocks=4, block_size=4))
    s.submit(Request(request_id=0, prompt=(1, 2), max_new_tokens=2, n=2))
    out = s.step()
    with pytest.raises(InvalidRequestError, match="token id >= 0"):
        s.update({0: 5, 1: -1})
    assert list(s.manager.sequence_ids()) == [0]  # no fork happened
    s.update({0: 5, 1: 6})
    assert sorted(s.manager.sequence_ids()) == [0, 1] and out.step == 0
