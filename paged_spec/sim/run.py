"""One simulated serving run: a trace, the spec's real scheduler, and a roofline clock.

The loop is the engine's, with the forward pass replaced by its cost: submit
every request that has arrived, ask the scheduler for a step, advance the
clock by :func:`step_seconds` of that step's work, and report one sampled
token per sample slot; with nothing unfinished, the clock jumps to the next
arrival. A request generates token ``1`` until its trace output length, then
the stop token ``0``; its ``max_new_tokens`` is the most the model's context
allows, because a server does not know output lengths in advance (that is
what makes reservation wasteful).

**Idle steps.** A static batch that waits to fill
(:meth:`~spec.scheduler.StaticScheduler.waiting_to_fill`) runs steps that
compute nothing, and its timeout is counted in the scheduler's steps: the
spec has no clock, and the simulator does not overrule its decision. So that
the timeout is a time, an idle step lasts a fixed tick,
:func:`~paged_spec.sim.cost.idle_step_seconds`, as if the engine looked at its
queue once a tick: the clock runs through such ticks until the next arrival
(seen at the next tick) or the scheduler's deadline starts the batch,
whichever comes first. The tick is the shortest real step (one decode token
of one sequence, the weights' streaming time: 3.3 ms for the 8B), and a small
batch decodes at that same flat rate, so a step of waiting lasts about as
long whether the engine idles or runs a small batch: a timeout of ``K``
steps is about ``K`` ticks from the head request's arrival.

Four policies share the scheduler code and the pool's bytes:

* ``static``: request-level static batching, :class:`~spec.scheduler.StaticScheduler`
  on 16-token blocks with ``max_wait_steps=static_wait_steps``: a batch waits
  until it is full (every seat taken, or the next request would not fit the
  pool at its worst case) or its head request has waited that many steps,
  then runs to completion, and only then does the next one form.
* ``static-eager``: the same with ``max_wait_steps=0``: a batch starts with
  whoever is waiting the moment the last one ends, never idling.
* ``contiguous``: :class:`~spec.scheduler.ContinuousScheduler` whose block size
  is the maximum model length: every sequence holds one slab of that many
  slots from admission to finish, the pre-paging contiguous reservation.
* ``paged``: :class:`~spec.scheduler.ContinuousScheduler` on 16-token blocks.

A hybrid model (one with a fixed-size state per sequence, ``ModelCost.state_bytes``)
runs over two KV cache groups, full attention and the state
(:mod:`spec.kv_groups`): its pool's bytes hold ``max_num_seqs`` state slots
(every seat has one) and the blocks the rest pays for (``pool_tokens``).

Two switches serve the lessons on admission control and chunked prefill:
``admission_blocks`` puts a front door before the scheduler that rejects a
request at arrival, with a :class:`~spec.errors.CapacityError`, when the
blocks it and the work already queued would need exceed a cap
(:func:`admission_error`); ``max_chunk_tokens`` is the scheduler's own cap on
one sequence's tokens per step. Every request keeps its trace class, and the
metrics are reported per class too (``classes``), from :mod:`spec.metrics`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from paged_spec.sim.cost import Gpu, ModelCost, idle_step_seconds, step_seconds
from paged_spec.sim.traffic import TraceRequest
from spec.block_manager import cdiv
from spec.cache_manager import FIXED_STATE, FULL_ATTENTION
from spec.errors import CapacityError
from spec.metrics import RequestTimeline, StepStats
from spec.request import Request
from spec.scheduler import ContinuousScheduler, Scheduler, SchedulerConfig, StaticScheduler

POLICIES = ("static", "static-eager", "contiguous", "paged")
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
    max_chunk_tokens: int | None = None  # per sequence per step; None: the whole budget
    admission_blocks: int | None = None  # the front door's cap; None: admit everything
    policy: Literal["fcfs", "priority"] = "fcfs"
    class_priority: tuple[tuple[str, int], ...] = ()  # (class, priority); smaller runs first
    aging_steps: int = 100  # priority policy: steps of waiting worth one priority level
    static_wait_steps: int = 300  # ``static``: steps a batch may wait to fill (8B: 1 s idle)

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
            max_chunk_tokens=self.max_chunk_tokens,
            policy=self.policy,
            aging_steps=self.aging_steps,
            kv_groups=(FULL_ATTENTION, FIXED_STATE) if self.model.state_bytes else (),
        )
        if policy == "static":
            return StaticScheduler(config, max_wait_steps=self.static_wait_steps)
        return StaticScheduler(config) if policy == "static-eager" else ContinuousScheduler(config)


@dataclass
class Timeline:
    """Per step: end time (s), sequences in the batch, KV utilization, requests waiting,
    slots held and tail waste; at the end, every request's spec timeline."""

    end: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    kv_util: list[float] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    held_slots: list[int] = field(default_factory=list)  # slots of blocks held by sequences
    tail_waste: list[int] = field(default_factory=list)  # held slots that hold no token
    running: list[int] = field(default_factory=list)  # sequences holding blocks
    idle_steps: int = 0  # steps a static batch spent waiting to fill
    idle_s: float = 0.0  # their time
    members: dict[int, list[list[float]]] = field(default_factory=dict)  # request -> (start, end) s
    requests: dict[int, RequestTimeline] = field(default_factory=dict)  # spec.metrics, at the end
    rejections: dict[int, str] = field(default_factory=dict)  # request -> the front door's error


Progress = Callable[[int, int, float], None]  # (finished, total, simulated seconds)


def run(
    policy: str,
    trace: Sequence[TraceRequest],
    engine: EngineConfig,
    *,
    member_seconds: float = 0.0,
    progress: Progress | None = None,
    progress_every: float = 1.0,
) -> tuple[dict[str, Any], Timeline]:
    """Serve ``trace`` under ``policy``; return its metrics and per-step timeline.

    ``progress``: called every ``progress_every`` seconds of wall time, and
    once more when the trace is served.

    ``member_seconds``: record which requests are in the batch in the steps that
    start in that many first seconds (``Timeline.members``).
    """
    sched = engine.scheduler(policy)
    tick = idle_step_seconds(engine.gpu, engine.model)
    clock, nxt, done = 0.0, 0, 0
    tl = Timeline()
    last_report = time.monotonic()
    queued: dict[int, int] = {}  # submitted, never scheduled: request -> its prompt's blocks
    rejected: dict[int, str] = {}
    while nxt < len(trace) or sched.has_unfinished():
        while nxt < len(trace) and trace[nxt].arrival <= clock:
            request = _request(nxt, trace[nxt], engine)
            error = admission_error(engine.admission_blocks, sched, queued, request)
            if error is None:
                sched.submit(request)
                queued[nxt] = cdiv(len(request.prompt), sched.config.block_size)
            else:
                rejected[nxt] = str(error)
            nxt += 1
        if not sched.has_unfinished():
            clock = trace[nxt].arrival  # nothing to do: jump to the next arrival
            continue
        idle = isinstance(sched, StaticScheduler) and sched.waiting_to_fill()
        out = sched.step()
        b = out.batch
        work = [(b.query_len(i), b.seq_lens[i]) for i in range(b.num_seqs)]
        if not work and not idle:
            raise RuntimeError(f"{policy}: step {out.step} scheduled nothing with work queued")
        extended = _record_members(tl.members, clock, b.seq_ids) if clock < member_seconds else []
        clock += tick if idle else step_seconds(engine.gpu, engine.model, work)
        tl.idle_steps, tl.idle_s = tl.idle_steps + idle, tl.idle_s + tick * idle
        _record_step(tl, sched, clock)
        for member_run in extended:
            member_run[1] = clock
        for rid in [
            r for r in queued if sched.metrics.timelines[r].first_scheduled_step is not None
        ]:
            del queued[rid]
        sampled = {s.seq_id: _next_token(s.position, trace[s.request_id]) for s in out.samples}
        done += len(sched.update(sampled))
        if progress and time.monotonic() - last_report >= progress_every:
            progress(done, len(trace), clock)
            last_report = time.monotonic()
    if progress:
        progress(done, len(trace), clock)
    tl.requests, tl.rejections = dict(sched.metrics.timelines), rejected
    return _summarize(sched, trace, tl, rejected), tl


def _record_step(tl: Timeline, sched: Scheduler, clock: float) -> None:
    """Append the step that just ended at ``clock`` to the timeline."""
    stats, block_size = sched.metrics.steps[-1], sched.config.block_size
    tl.end.append(clock)
    tl.batch.append(stats.num_seqs)
    tl.kv_util.append(_kv_util(stats, block_size, sched.config.num_blocks * block_size))
    tl.waiting.append(stats.num_waiting)
    tl.held_slots.append(stats.used_blocks * block_size)
    tl.tail_waste.append(stats.tail_waste)
    tl.running.append(stats.num_running)


def admission_error(
    cap: int | None, sched: Scheduler, queued: dict[int, int], request: Request
) -> CapacityError | None:
    """The front door's rule, in blocks: admit only while the pool can hold the work.

    The blocks held now, plus the prompt blocks of every request still queued,
    plus this request's prompt blocks, must not exceed ``cap`` (``None``: no
    cap). A rejected request learns it at once, with the numbers, instead of
    waiting in a queue that cannot drain in time.
    """
    if cap is None:
        return None
    need = cdiv(len(request.prompt), sched.config.block_size)
    held, waiting = sched.manager.pool.num_held, sum(queued.values())
    if held + waiting + need <= cap:
        return None
    return CapacityError(
        f"request {request.request_id}: its prompt needs {need} blocks; {held} blocks are held "
        f"and {waiting} more are queued, over the admission cap of {cap} blocks"
    )


def _request(i: int, r: TraceRequest, engine: EngineConfig) -> Request:
    prompt_len = min(r.prompt_len, engine.max_model_len - 1)
    return Request(
        request_id=i,
        prompt=(TOKEN,) * prompt_len,
        max_new_tokens=engine.max_model_len - prompt_len,
        stop_tokens=frozenset({STOP}),
        priority=dict(engine.class_priority).get(r.request_class, 0),
        request_class=r.request_class,
        arrival_time=r.arrival,
    )


def _next_token(position: int, r: TraceRequest) -> int:
    """Token ``position`` (0-based) of the output: the last one of the trace's length stops it."""
    return STOP if position + 1 >= r.output_len else TOKEN


def _record_members(
    members: dict[int, list[list[float]]], start: float, seq_ids: Sequence[int]
) -> list[list[float]]:
    """Extend each request's run of consecutive steps, or start a new one, at ``start`` (s).

    A run is ``[start, end]`` in seconds; return the runs this step extends, whose
    end the caller sets when the step's time is known. One sample per request, so
    sequence ids are request ids (both count submissions).
    """
    extended = []
    for rid in seq_ids:
        runs = members.setdefault(rid, [])
        if not runs or runs[-1][1] != start:
            runs.append([start, start])
        extended.append(runs[-1])
    return extended


def _kv_util(stats: StepStats, block_size: int, slots: int) -> float:
    """Slots holding a token's KV over all slots (no block is shared: one sample per request)."""
    return (stats.used_blocks * block_size - stats.tail_waste) / slots


def _pct(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def _summarize(
    sched: Scheduler, trace: Sequence[TraceRequest], tl: Timeline, rejected: dict[int, str]
) -> dict[str, Any]:
    """Throughput, latency percentiles, KV utilization and preemptions of one run, and the
    same latencies per request class."""
    ends = tl.end
    served = sched.metrics.timelines
    out_tokens = sum(len(t.token_steps.get(0, [])) for t in served.values())
    finish = max((ends[s[-1]] for t in served.values() if (s := t.token_steps.get(0))), default=0.0)
    span = finish - trace[0].arrival
    durations = np.diff([0.0, *ends])
    util = np.asarray(tl.kv_util)
    pressure = np.asarray(tl.waiting) > 0
    totals = sched.metrics.totals()
    overall = _latencies(list(served.values()), ends)
    classes = sorted({r.request_class for r in trace})
    return {
        "requests": len(trace),
        "rejected": len(rejected),
        "output_tokens": out_tokens,
        "makespan_s": span,
        "throughput_tok_s": out_tokens / span if span > 0 else 0.0,
        "throughput_req_s": len(served) / span if span > 0 else 0.0,
        **{k: overall[k] for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")},
        "queue_delay_p50_s": overall["queue_delay_p50_s"],
        "queue_delay_p99_s": overall["queue_delay_p99_s"],
        "kv_util_mean": float(np.average(util, weights=durations)),
        "kv_util_under_pressure": (
            float(np.average(util[pressure], weights=durations[pressure]))
            if pressure.any()
            else None
        ),
        "pressure_time_share": float(durations[pressure].sum() / durations.sum()),
        "mean_batch": float(np.average(tl.batch, weights=durations)),
        "steps": len(ends),
        "idle_steps": tl.idle_steps,
        "idle_s": tl.idle_s,
        "preemptions": int(totals["preemptions"]),
        "preemption_steps": sum(s.preemptions > 0 for s in sched.metrics.steps),
        "num_blocks": sched.config.num_blocks,
        "block_size": sched.config.block_size,
        "overall": overall,
        "classes": {
            c: _latencies([t for t in served.values() if t.request_class == c], ends)
            | {"rejected": sum(trace[r].request_class == c for r in rejected)}
            for c in classes
        },
    }


def _latencies(timelines: Sequence[RequestTimeline], ends: Sequence[float]) -> dict[str, Any]:
    """Means and percentiles (seconds) of TTFT, queue delay, inter-token gaps and end-to-end
    latency (arrival to last token), and the preemptions, over some requests'
    :class:`~spec.metrics.RequestTimeline`."""
    ttft = [x for t in timelines if (x := t.ttft_seconds(ends)) is not None]
    queue = [x for t in timelines if (x := t.queue_delay_seconds(ends)) is not None]
    gaps = [
        ends[b] - ends[a]
        for t in timelines
        for a, b in itertools.pairwise(t.token_steps.get(0, []))
    ]
    e2e = [
        ends[t.finish_step] - t.arrival_time
        for t in timelines
        if t.finish_step is not None and t.arrival_time is not None
    ]
    return {
        "requests": len(timelines),
        "preemptions": sum(t.preemptions for t in timelines),
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "queue_delay_mean_s": _mean(queue),
        "queue_delay_p50_s": _pct(queue, 50),
        "queue_delay_p99_s": _pct(queue, 99),
        "itl_mean_s": _mean(gaps),
        "itl_p50_s": _pct(gaps, 50),
        "itl_p99_s": _pct(gaps, 99),
        "itl_max_s": max(gaps, default=None),
        "e2e_mean_s": _mean(e2e),
        "e2e_p99_s": _pct(e2e, 99),
    }


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None
