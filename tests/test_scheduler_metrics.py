"""Metrics agree with what the scheduler did, per step and per request class.

Per step, the pool's blocks add up and the counters match the step outputs;
per request, queue delay <= time to first token, one token step per token;
with a clock of equal steps, seconds are steps times the step length.
"""

from __future__ import annotations

from hypothesis import given

from conformance.scheduler_invariants import run_checked
from conformance.scheduler_workloads import Workload, workloads
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
    by_class = {c.request_class: c.num_requests for c in sched.metrics.summarize(ends)}
    for name in {r.request_class for r in w.requests}:
        want = sum(r.request_class == name for r in w.requests)
        assert by_class.get(name, 0) == want
