"""Who is served first: priority with aging has a bounded wait, and a full queue costs nothing.

The bound (:mod:`spec.sched_policy`): only requests submitted before
``overtake_horizon`` can rank ahead of a request. Under a saturating stream of
better-priority arrivals, a low-priority request is therefore admitted after
at most those requests, served ``max_num_seqs`` at a time. Without aging
(a huge ``aging_steps``) the same stream starves it: the property can fail.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from spec import sched_queue
from spec.block_manager import cdiv
from spec.request import Request
from spec.sched_policy import overtake_horizon, rank
from spec.scheduler import ContinuousScheduler, SchedulerConfig


def _first_admission_of_the_low_request(
    aging_steps: int, gap: int, seats: int, new_tokens: int, per_step: int, prompt: int, steps: int
) -> int | None:
    """Run a stream of priority-0 arrivals behind one priority-``gap`` request; its first step."""
    cfg = SchedulerConfig(
        num_blocks=(seats + 1) * cdiv(prompt + new_tokens, 4),  # no preemption, ever
        block_size=4,
        max_num_batched_tokens=seats * (prompt + 1),  # every prompt in one step
        max_num_seqs=seats,
        max_model_len=prompt + new_tokens,
        policy="priority",
        aging_steps=aging_steps,
    )
    s = ContinuousScheduler(cfg)
    s.submit(Request(request_id=0, prompt=(1,) * prompt, max_new_tokens=new_tokens, priority=gap))
    rid = 1
    for _ in range(steps):
        for _ in range(per_step):
            s.submit(Request(request_id=rid, prompt=(2,) * prompt, max_new_tokens=new_tokens))
            rid += 1
        out = s.step()
        s.update({x.seq_id: 3 for x in out.samples})
    return s.metrics.timelines[0].first_scheduled_step


@given(
    aging_steps=st.integers(1, 6),
    gap=st.integers(1, 4),
    seats=st.integers(1, 3),
    new_tokens=st.integers(1, 4),
    per_step=st.integers(1, 3),
    prompt=st.integers(1, 5),
)
def test_priority_aging_bounds_the_wait_under_a_saturating_stream(
    aging_steps: int, gap: int, seats: int, new_tokens: int, per_step: int, prompt: int
) -> None:
    """Admitted by ``(ceil((ahead + 1) / seats) - 1) * new_tokens``, ``ahead`` from the horizon.

    Each seat turns over every ``new_tokens`` steps (prefill samples the first
    token, then one decode per token) and is refilled the next step, and
    while the low request waits no later-ranked request is admitted.
    """
    assume(per_step * new_tokens > seats)  # more work arrives than is served: saturating
    cfg = SchedulerConfig(num_blocks=1, block_size=1, policy="priority", aging_steps=aging_steps)
    horizon = overtake_horizon(cfg, priority=gap, submit_step=0, best_priority=0)
    ahead = per_step * horizon  # every request submitted before the horizon step
    bound = (cdiv(ahead + 1, seats) - 1) * new_tokens
    first = _first_admission_of_the_low_request(
        aging_steps, gap, seats, new_tokens, per_step, prompt, steps=bound + 1
    )
    assert first is not None and first <= bound, (first, bound)


def test_without_aging_the_same_stream_starves_it() -> None:
    """The control: strict priority (aging far slower than the run) never admits it."""
    args: dict[str, Any] = {"gap": 1, "seats": 2, "new_tokens": 2, "per_step": 2, "prompt": 2}
    horizon = 4 * 1  # aging_steps * gap
    bound = (cdiv(2 * horizon + 1, 2) - 1) * 2
    assert _first_admission_of_the_low_request(4, **args, steps=bound + 1) is not None
    assert _first_admission_of_the_low_request(10**9, **args, steps=20 * bound) is None


@pytest.mark.parametrize(("aging_steps", "victim"), [(2, 1), (10, 0)])
def test_preemption_victims_are_chosen_by_the_aged_rank(aging_steps: int, victim: int) -> None:
    """A priority-1 request submitted at step 0 against a priority-0 one submitted at step 3.

    With ``aging_steps=2`` the first has waited more than a level's worth
    (rank 2 against 3) and the newcomer is preempted; with 10 it is the victim.
    """
    cfg = SchedulerConfig(
        num_blocks=4,
        block_size=2,
        max_num_batched_tokens=16,
        policy="priority",
        aging_steps=aging_steps,
    )
    s = ContinuousScheduler(cfg)
    s.submit(Request(request_id=0, prompt=(1, 2, 3), max_new_tokens=6, priority=1))
    for _ in range(3):  # steps 0, 1, 2: it holds 3 of the 4 blocks
        out = s.step()
        s.update({x.seq_id: 9 for x in out.samples})
    s.submit(Request(request_id=1, prompt=(4,), max_new_tokens=4, priority=0))
    preempted: list[int] = []
    while s.has_unfinished():
        out = s.step()
        preempted += out.preempted
        s.update({x.seq_id: 9 for x in out.samples})
    assert preempted and set(preempted) == {victim}


def test_the_rank_is_fixed_and_orders_like_aged_priority() -> None:
    """``priority - waited / K`` compares like ``submit_step + K * priority`` at every step."""
    cfg = SchedulerConfig(num_blocks=1, block_size=1, policy="priority", aging_steps=5)
    reqs = [(0, 3, 0), (1, 0, 7), (2, 1, 12), (3, 2, 4)]  # (arrival, priority, submit step)
    ranks = {a: rank(cfg, priority=p, submit_step=t, arrival=a, sample_index=0) for a, p, t in reqs}
    for now in range(12, 40):
        aged = sorted(reqs, key=lambda r: (r[1] - (now - r[2]) / 5, r[0]))
        assert [r[0] for r in aged] == sorted(ranks, key=ranks.__getitem__)
    fcfs = SchedulerConfig(num_blocks=1, block_size=1)
    assert rank(fcfs, priority=9, submit_step=3, arrival=4, sample_index=1) == (0, 4, 1)


def _counting_heapq(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count every heap operation the scheduler's queues make."""
    counts = {"ops": 0}

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts["ops"] += 1
            return fn(*args, **kwargs)

        return wrapper

    class Counting:
        heappush = staticmethod(counted(heapq.heappush))
        heappop = staticmethod(counted(heapq.heappop))
        heapify = staticmethod(counted(heapq.heapify))
        nsmallest = staticmethod(counted(heapq.nsmallest))

    monkeypatch.setattr(sched_queue, "heapq", Counting)
    return counts


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_queue_that_cannot_be_admitted_is_not_touched(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every seat taken, a step makes no heap operation and never sorts the waiting queue."""
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=2, policy=policy)  # type: ignore[arg-type]
    s = ContinuousScheduler(cfg)
    for rid in range(200):
        s.submit(Request(request_id=rid, prompt=(1, 2), max_new_tokens=50, priority=rid % 3))
    out = s.step()
    s.update({x.seq_id: 5 for x in out.samples})
    counts = _counting_heapq(monkeypatch)
    monkeypatch.setattr(sched_queue.RankedQueue, "__iter__", _refuse)
    for _ in range(10):
        out = s.step()
        assert len(out.samples) == 2
        s.update({x.seq_id: 5 for x in out.samples})
    assert counts["ops"] == 0


def _refuse(*args: object) -> None:
    raise AssertionError("the waiting queue was iterated during a step")
