"""Scheduler invariants, checked every step, against any :class:`spec.scheduler.Scheduler`.

A scheduler plugs in like a backend: give :func:`run_checked` a factory that
builds it from a :class:`~spec.scheduler.SchedulerConfig`, some requests and
their arrival steps. It drives the scheduler without a model, "sampling" token
``j`` of sample ``i`` of a request as a fixed function of ``(request, i, j)``,
and checks after every step:

* scheduled tokens <= ``max_num_batched_tokens``; running sequences <= ``max_num_seqs``;
* no running sequence is skipped while budget is left (a victim's removal must
  not make the loop skip the next sequence);
* every scheduled token has a slot: in the pool, no two tokens in one slot,
  and exactly where the sequence's block table puts its position;
* the block manager's and the pool's own invariants (``check_integrity``);
* finished and aborted requests hold no blocks, from the step they finish;
* the scheduler's own calls do not raise (preempting a victim that already has
  slots this step, for one, breaks the batch it is building);
* progress: a step that has work left computes a token or frees blocks (no deadlock);
* bounded wait: under FCFS no request is first scheduled before one that arrived
  earlier, and every request finishes within a step bound;
* at the end: no blocks leaked, and each sample generated exactly the tokens
  its sampling function dictates, cut at its stop token or its length.

Every violation raises :class:`SchedulerInvariantError` naming the step and the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from typing import TypeVar

from spec.block_manager import cdiv
from spec.request import Request
from spec.scheduler import FinishedRequest, Scheduler, SchedulerConfig, SchedulerOutput

TokenFn = Callable[[Request, int, int], int]
T = TypeVar("T")


class SchedulerInvariantError(AssertionError):
    """A scheduler broke one of the invariants above."""


def default_tokens(request: Request, sample_index: int, position: int) -> int:
    """A deterministic stand-in for sampling: depends only on who and where, never on batching."""
    return (request.request_id * 7919 + sample_index * 104729 + position * 31 + request.seed) % 61


@dataclass
class RunReport:
    """What a checked run saw."""

    steps: int = 0
    tokens: int = 0
    preemptions: int = 0
    swaps: int = 0
    max_running: int = 0
    results: dict[int, FinishedRequest] = field(default_factory=dict)


def expected_outputs(
    request: Request, tokens: TokenFn = default_tokens
) -> tuple[tuple[int, ...], ...]:
    """Each sample's outputs when run alone: draw until a stop token or ``max_new_tokens``."""
    outs = []
    for i in range(request.n):
        out: list[int] = []
        while len(out) < request.max_new_tokens:
            out.append(tokens(request, i, len(out)))
            if out[-1] in request.stop_tokens:
                break
        outs.append(tuple(out))
    return tuple(outs)


def run_checked(
    make: Callable[[SchedulerConfig], Scheduler],
    config: SchedulerConfig,
    requests: Sequence[Request],
    arrivals: Mapping[int, int] | None = None,
    *,
    aborts: Mapping[int, int] | None = None,
    tokens: TokenFn = default_tokens,
    max_steps: int | None = None,
) -> RunReport:
    """Drive ``make(config)`` through ``requests``, checking every step.

    ``arrivals[id]``: the step before which the request is submitted (default 0).
    ``aborts[id]``: the step before which it is aborted, if it is still in flight.
    """
    sched = make(config)
    arrive = dict(arrivals or {})
    pending = sorted(requests, key=lambda r: arrive.get(r.request_id, 0))
    by_id = {r.request_id: r for r in requests}
    bound = max_steps if max_steps is not None else _step_bound(requests, arrive)
    report = RunReport()
    submitted: list[int] = []
    while pending or sched.has_unfinished():
        while pending and arrive.get(pending[0].request_id, 0) <= report.steps:
            sched.submit(pending[0])
            submitted.append(pending.pop(0).request_id)
        _abort_due(sched, aborts or {}, submitted, report)
        _check(report.steps < bound, report.steps, f"not finished within {bound} steps")
        busy = sched.has_unfinished()
        out = _call(sched.step, report.steps, "step()")
        _check_step(sched, out, report, busy=busy)
        sampled = {}
        for s in out.samples:
            sampled[s.seq_id] = tokens(by_id[s.request_id], s.sample_index, s.position)
        for done in _call(partial(sched.update, sampled), report.steps, "update()"):
            _finished(sched, done, report)
        _integrity(sched, out.step)
        report.steps += 1
    _check_end(sched, requests, submitted, report, tokens)
    return report


def _abort_due(
    sched: Scheduler, aborts: Mapping[int, int], submitted: list[int], report: RunReport
) -> None:
    """Abort each submitted, unfinished request whose abort step has come."""
    for rid in submitted:
        if aborts.get(rid) == report.steps and rid not in report.results:
            _call(partial(sched.abort, rid), report.steps, f"abort({rid})")
            _finished(sched, sched.result(rid), report)
            _integrity(sched, report.steps)


def _finished(sched: Scheduler, done: FinishedRequest, report: RunReport) -> None:
    report.results[done.request_id] = done
    for seq_id in done.seq_ids:
        _check(
            seq_id not in sched.manager,
            report.steps,
            f"request {done.request_id} finished but sequence {seq_id} holds blocks",
        )


def _call(fn: Callable[[], T], step: int, what: str) -> T:
    """Run a scheduler call; its own crash is a violation too (it broke its own state)."""
    try:
        return fn()
    except SchedulerInvariantError:
        raise
    except Exception as e:
        raise SchedulerInvariantError(f"step {step}: {what} raised {type(e).__name__}: {e}") from e


def _check(ok: bool, step: int, message: str) -> None:
    if not ok:
        raise SchedulerInvariantError(f"step {step}: {message}")


def _integrity(sched: Scheduler, step: int) -> None:
    try:
        sched.manager.check_integrity()
    except AssertionError as e:
        raise SchedulerInvariantError(f"step {step}: block manager integrity: {e}") from e


def _step_bound(requests: Sequence[Request], arrivals: Mapping[int, int]) -> int:
    """Generous: every token of every sample, recomputed once per request, plus arrivals."""
    work = sum(r.n * (len(r.prompt) + r.max_new_tokens) for r in requests)
    return (work + 1) * (len(requests) + 2) + max(arrivals.values(), default=0)


def _check_step(sched: Scheduler, out: SchedulerOutput, report: RunReport, *, busy: bool) -> None:
    cfg, m, b = sched.config, sched.manager, out.batch
    step = out.step
    _check(
        b.num_tokens <= cfg.max_num_batched_tokens,
        step,
        f"{b.num_tokens} tokens scheduled, budget {cfg.max_num_batched_tokens}",
    )
    _check(len(out.token_ids) == b.num_tokens, step, "token_ids and batch disagree in length")
    running = len(m.sequence_ids())
    _check(
        b.num_seqs <= cfg.max_num_seqs and running <= cfg.max_num_seqs,
        step,
        f"{b.num_seqs} scheduled, {running} running; max_num_seqs {cfg.max_num_seqs}",
    )
    _check_slots(sched, out)
    idle = set(m.sequence_ids()) - set(b.seq_ids)
    _check(
        not idle or b.num_tokens == cfg.max_num_batched_tokens,
        step,
        f"running sequences {sorted(idle)} skipped with "
        f"{cfg.max_num_batched_tokens - b.num_tokens} tokens of budget left",
    )
    progress = b.num_tokens > 0 or out.preempted or out.swap_out or out.aborted
    _check(bool(progress) or not busy, step, "work left, but no token computed and nothing freed")
    _integrity(sched, step)
    report.tokens += b.num_tokens
    report.preemptions += len(out.preempted)
    report.swaps += len(out.swap_out) + len(out.swap_in)
    report.max_running = max(report.max_running, running)


def _check_slots(sched: Scheduler, out: SchedulerOutput) -> None:
    m, b, step = sched.manager, out.batch, out.step
    num_slots = sched.config.num_blocks * sched.config.block_size
    slots = b.slot_mapping
    _check(len(set(slots)) == len(slots), step, "two scheduled tokens share a slot")
    for i, seq_id in enumerate(b.seq_ids):
        _check(seq_id in m, step, f"sequence {seq_id} is scheduled but holds no blocks")
        table = m.block_table(seq_id)
        _check(
            len(table) == cdiv(b.seq_lens[i], b.block_size),
            step,
            f"sequence {seq_id}: {len(table)} blocks for {b.seq_lens[i]} tokens",
        )
        for j in range(b.query_start_loc[i], b.query_start_loc[i + 1]):
            pos, slot = b.positions[j], slots[j]
            _check(
                0 <= slot < num_slots and slot == m.slot(seq_id, pos),
                step,
                f"sequence {seq_id} position {pos}: slot {slot}, table says "
                f"{m.slot(seq_id, pos) if 0 <= pos < m.num_tokens(seq_id) else 'nothing'}",
            )


def _check_end(
    sched: Scheduler,
    requests: Sequence[Request],
    submitted: list[int],
    report: RunReport,
    tokens: TokenFn,
) -> None:
    m, end = sched.manager, report.steps
    _check(not m.sequence_ids(), end, f"sequences left holding blocks: {m.sequence_ids()}")
    _check(m.pool.num_held == 0, end, f"{m.pool.num_held} blocks leaked")
    for r in requests:
        got = report.results.get(r.request_id)
        _check(got is not None, end, f"request {r.request_id} never finished")
        assert got is not None
        want = expected_outputs(r, tokens)
        if got.aborted:  # whatever it generated before the abort is a prefix of the truth
            want = tuple(w[: len(g)] for w, g in zip(want, got.outputs, strict=False))
        _check(
            got.outputs == want,
            end,
            f"request {r.request_id} generated {got.outputs}, alone it generates {want}",
        )
    if sched.config.policy == "fcfs":
        started = [rid for rid in submitted if not report.results[rid].aborted]
        firsts = [(rid, sched.metrics.timelines[rid].first_scheduled_step) for rid in started]
        for (a, fa), (b, fb) in pairwise(firsts):
            _check(
                fa is not None and fb is not None and fa <= fb,
                end,
                f"FCFS: request {b} (first scheduled at step {fb}) overtook earlier request {a} "
                f"(first scheduled at step {fa})",
            )
