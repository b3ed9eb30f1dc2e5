"""Metrics agree with what the scheduler did, per step and per request class.

Per step, the pool's blocks add up and the counters match the step outputs;
per request, queue delay <= time to first token, one token step per token;
with a clock of equal steps, seconds are steps times the step length.
"""

from __future__ import annotations

from hypothesis import given

from conformance.scheduler.invariants import run_checked
from conformance.scheduler.workloads import Workload, workloads
from spec.scheduler import ContinuousScheduler, SchedulerConfig


@given(w=workloads(max_requests=8))
def test_metrics_match_the_run(w: Workload) -> None:
    made: list[ContinuousScheduler] = []

    def make(cfg: SchedulerConfig) -> ContinuousScheduler:
        made.append(ContinuousScheduler(cfg))
        return made[-1]

    report = run_checked(make, w.config, w.requests, w.arrivals, aborts=w.aborts)
    sched, cfg = made[0], w.config
    steps = sched.metrics.steps
    assert [s.step for s in steps] == list(range(report.steps))
    for s in steps:
        assert s.free_blocks + s.cached_blocks + s.used_blocks == cfg.num_blocks
        assert s.tail_waste <= (cfg.block_size - 1) * s.num_running
        assert s.num_tokens <= cfg.max_num_batched_tokens
    assert sum(s.preemptions for s in steps) == report.preemptions
    totals = sched.metrics.totals()
    assert totals["prefix_hit_rate"] == sched.manager.prefix_stats.hit_rate
    assert totals["tokens"] == report.tokens

    length = 0.25
    ends = [length * (i + 1) for i in range(report.steps)]
    for rid, t in sched.metrics.timelines.items():
        result = report.results[rid]
        assert sum(len(v) for v in t.token_steps.values()) == sum(map(len, result.outputs))
        if result.aborted or t.ttft_steps is None:
            continue
        assert t.queue_delay_steps is not None and 0 <= t.queue_delay_steps < t.ttft_steps
        assert t.ttft_seconds(ends) == length * t.ttft_steps
        if t.itl_steps is not None:
            assert abs(t.itl_seconds(ends) - length * t.itl_steps) < 1e-9  # type: ignore[operator]
    by_class = {
        c.request_class: (c.num_requests, c.num_aborted) for c in sched.metrics.summarize(ends)
    }
    for name in {r.request_class for r in w.requests}:
        ids = [r.request_id for r in w.requests if r.request_class == name]
        aborted = sum(report.results[i].aborted for i in ids)
        assert by_class.get(name, (0, 0)) == (len(ids) - aborted, aborted)


def test_every_preempted_sequence_is_reported_when_it_resumes() -> None:
    """Also one preempted by recomputation mid-prefill, before it generated anything."""
    from spec.request import Request

    s = ContinuousScheduler(
        SchedulerConfig(num_blocks=3, block_size=2, max_num_batched_tokens=8, max_chunk_tokens=2)
    )
    s.submit(Request(0, (1, 2, 3), max_new_tokens=3))
    s.submit(Request(1, (4, 5, 6, 7, 8), max_new_tokens=1))
    preempted: list[int] = []
    resumed: list[int] = []
    while s.has_unfinished():
        out = s.step()
        preempted += out.preempted
        resumed += out.resumed
        s.update({x.seq_id: 9 for x in out.samples})
    assert preempted, "the workload is meant to preempt"
    assert sorted(preempted) == sorted(resumed)


def test_aborted_requests_are_counted_apart_from_the_means() -> None:
    from spec.request import Request

    s = ContinuousScheduler(SchedulerConfig(num_blocks=8, block_size=2))
    s.submit(Request(0, (1, 2), max_new_tokens=2))
    s.submit(Request(1, (3, 4), max_new_tokens=5))
    out = s.step()
    s.update({x.seq_id: 9 for x in out.samples})
    s.abort(1)
    while s.has_unfinished():
        out = s.step()
        s.update({x.seq_id: 9 for x in out.samples})
    (summary,) = s.metrics.summarize()
    assert (summary.num_requests, summary.num_aborted) == (1, 1)
