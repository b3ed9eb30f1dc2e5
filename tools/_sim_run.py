"""One simulated serving run: a trace, the spec's real scheduler, and a roofline clock.

The loop is the engine's, with the forward pass replaced by its cost: submit
every request that has arrived, ask the scheduler for a step, advance the
clock by :func:`step_seconds` of that step's work, and report one sampled
token per sample slot. A request generates token ``1`` until its trace output
length, then the stop token ``0``; its ``max_new_tokens`` is the most the
model's context allows, because a server does not know output lengths in
advance (that is what makes reservation wasteful).

Three policies share the scheduler code and the pool's bytes:

* ``static``: :class:`~spec.scheduler.StaticScheduler` on 16-token blocks: a batch
  forms, runs to completion, and only then does the next one form.
* ``contiguous``: :class:`~spec.scheduler.ContinuousScheduler` whose block size
  is the maximum model length: every sequence holds one slab of that many
  slots from admission to finish, the pre-paging contiguous reservation.
* ``paged``: :class:`~spec.scheduler.ContinuousScheduler` on 16-token blocks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spec.metrics import StepStats
from spec.request import Request
from spec.scheduler import ContinuousScheduler, Scheduler, SchedulerConfig, StaticScheduler
from tools._sim_cost import Gpu, ModelCost, step_seconds
from tools._sim_traffic import TraceRequest

POLICIES = ("static", "contiguous", "paged")
STOP, TOKEN = 0, 1


@dataclass(frozen=True)
class EngineConfig:
    """The served model, the device, the KV pool and the scheduler's limits."""

    gpu: Gpu
    model: ModelCost
    pool_tokens: int  # KV slots in the pool (the same bytes for every policy)
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 2048

    def scheduler(self, policy: str) -> Scheduler:
        """A fresh scheduler of ``policy`` over this pool."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        block = self.max_model_len if policy == "contiguous" else self.block_size
        if self.pool_tokens < self.max_model_len:
            raise ValueError(
                f"a pool of {self.pool_tokens} tokens cannot hold one "
                f"{self.max_model_len}-token sequence"
            )
        config = SchedulerConfig(
            num_blocks=self.pool_tokens // block,
            block_size=block,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        return StaticScheduler(config) if policy == "static" else ContinuousScheduler(config)


@dataclass
class Timeline:
    """Per step: end time (s), sequences in the batch, KV utilization, requests waiting."""

    end: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    kv_util: list[float] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    members: dict[int, list[list[int]]] = field(default_factory=dict)  # request -> step runs


Progress = Callable[[int, int, float], None]  # (finished, total, simulated seconds)


def run(
    policy: str,
    trace: Sequence[TraceRequest],
    engine: EngineConfig,
    *,
    member_steps: int = 0,
    progress: Progress | None = None,
) -> tuple[dict[str, Any], Timeline]:
    """Serve ``trace`` under ``policy``; return its metrics and per-step timeline.

    ``member_steps``: record which requests are in the batch during that many first steps.
    """
    sched = engine.scheduler(policy)
    clock, nxt, done = 0.0, 0, 0
    tl = Timeline()
    last_report = time.monotonic()
    slots = sched.config.num_blocks * sched.config.block_size
    while nxt < len(trace) or sched.has_unfinished():
        while nxt < len(trace) and trace[nxt].arrival <= clock:
            sched.submit(_request(nxt, trace[nxt], engine.max_model_len))
            nxt += 1
        if not sched.has_unfinished():
            clock = trace[nxt].arrival  # idle: jump to the next arrival
            continue
        out = sched.step()
        b = out.batch
        work = [(b.query_len(i), b.seq_lens[i]) for i in range(b.num_seqs)]
        if not work:
            raise RuntimeError(f"{policy}: step {out.step} scheduled nothing with work queued")
        clock += step_seconds(engine.gpu, engine.model, work)
        stats = sched.metrics.steps[-1]
        tl.end.append(clock)
        tl.batch.append(b.num_seqs)
        tl.kv_util.append(_kv_util(stats, sched.config.block_size, slots))
        tl.waiting.append(stats.num_waiting)
        if out.step < member_steps:
            _record_members(tl.members, out.step, b.seq_ids)
        sampled = {s.seq_id: _next_token(s.position, trace[s.request_id]) for s in out.samples}
        done += len(sched.update(sampled))
        if progress and time.monotonic() - last_report > 1.0:
            progress(done, len(trace), clock)
            last_report = time.monotonic()
    return _summarize(sched, trace, tl), tl


def _request(i: int, r: TraceRequest, max_model_len: int) -> Request:
    prompt_len = min(r.prompt_len, max_model_len - 1)
    return Request(
        request_id=i,
        prompt=(TOKEN,) * prompt_len,
        max_new_tokens=max_model_len - prompt_len,
        stop_tokens=frozenset({STOP}),
        arrival_time=r.arrival,
    )


def _next_token(position: int, r: TraceRequest) -> int:
    """Token ``position`` (0-based) of the output: the last one of the trace's length stops it."""
    return STOP if position + 1 >= r.output_len else TOKEN


def _record_members(members: dict[int, list[list[int]]], step: int, seq_ids: Sequence[int]) -> None:
    """Extend each request's run of consecutive steps, or start a new run ``[step, step]``.

    One sample per request, so sequence ids are request ids (both count submissions).
    """
    for rid in seq_ids:
        runs = members.setdefault(rid, [])
        if runs and runs[-1][1] == step - 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])


def _kv_util(stats: StepStats, block_size: int, slots: int) -> float:
    """Slots holding a token's KV over all slots (no block is shared: one sample per request)."""
    return (stats.used_blocks * block_size - stats.tail_waste) / slots


def _pct(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def _summarize(sched: Scheduler, trace: Sequence[TraceRequest], tl: Timeline) -> dict[str, Any]:
    """Throughput, latency percentiles, KV utilization and preemptions of one run."""
    ends = tl.end
    ttft: list[float] = []
    itl: list[float] = []
    out_tokens, finish = 0, 0.0
    for rid, t in sched.metrics.timelines.items():
        steps = t.token_steps.get(0, [])
        out_tokens += len(steps)
        if steps:
            ttft.append(ends[steps[0]] - trace[rid].arrival)
            itl.extend(ends[b] - ends[a] for a, b in itertools.pairwise(steps))
            finish = max(finish, ends[steps[-1]])
    span = finish - trace[0].arrival
    durations = np.diff([0.0, *ends])
    util = np.asarray(tl.kv_util)
    pressure = np.asarray(tl.waiting) > 0
    totals = sched.metrics.totals()
    return {
        "requests": len(trace),
        "output_tokens": out_tokens,
        "makespan_s": span,
        "throughput_tok_s": out_tokens / span if span > 0 else 0.0,
        "throughput_req_s": len(trace) / span if span > 0 else 0.0,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50),
        "itl_p99_s": _pct(itl, 99),
        "kv_util_mean": float(np.average(util, weights=durations)),
        "kv_util_under_pressure": (
            float(np.average(util[pressure], weights=durations[pressure]))
            if pressure.any()
            else None
        ),
        "pressure_time_share": float(durations[pressure].sum() / durations.sum()),
        "mean_batch": float(np.average(tl.batch, weights=durations)),
        "steps": len(ends),
        "preemptions": int(totals["preemptions"]),
        "num_blocks": sched.config.num_blocks,
        "block_size": sched.config.block_size,
    }
