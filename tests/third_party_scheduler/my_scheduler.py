"""A scheduler written outside this project: first-come first-served, prompts in chunks of 8.

This file plays the part of a third party's code. It imports only the
contract (``spec.scheduler``'s protocol types, ``spec.block_manager``,
``spec.batch``, ``spec.metrics``, ``spec.request``), never ``conformance``,
and is checked with (from the repository root)::

    python -m conformance scheduler \
        --scheduler tests/third_party_scheduler/my_scheduler.py:MyScheduler

The policy: every step, the running sequences first, best first (arrival, or
priority then arrival), each computing at most ``CHUNK`` tokens, so that a
long prompt never holds the decodes back; then waiting requests, in the same
order, while seats, budget and blocks last (the first that does not fit stops
admission: nobody overtakes). When a running sequence cannot get a block,
the worst running sequence not yet scheduled this step is preempted by
recomputation: its blocks go back now, its generated tokens stay. This
scheduler never swaps (with ``preemption="swap"`` it recomputes too) and
records no per-step statistics, only request timelines.

:class:`MyBrokenScheduler` is the same with one mistake: decodes are not
charged to the token budget.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from spec.batch import build_batch
from spec.block_manager import BlockManager, cdiv
from spec.errors import CapacityError, InvalidRequestError
from spec.metrics import MetricsRecorder
from spec.request import Request
from spec.scheduler import FinishedRequest, SampleSlot, SchedulerConfig, SchedulerOutput

CHUNK = 8
"""The most tokens one sequence computes in one step (less if ``max_chunk_tokens`` says so)."""


@dataclass(eq=False)
class _Seq:
    """One sample of a request: its tokens, and how many of them have KV in the cache."""

    seq_id: int
    request: Request
    sample: int
    arrival: int
    tokens: list[int]
    computed: int = 0
    forked: bool = False  # all n samples exist (always true when n == 1)
    done: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def seats(self) -> int:
        return 1 if self.forked else self.request.n


class MyScheduler:
    """Chunk-capped FCFS over the spec's :class:`BlockManager` (see the module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._manager = BlockManager(
            config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self._metrics = MetricsRecorder()
        self._chunk = min(CHUNK, config.max_chunk_tokens or CHUNK)
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._samples: dict[int, list[_Seq]] = {}
        self._results: dict[int, FinishedRequest] = {}
        self._pending: SchedulerOutput | None = None
        self._aborted: list[int] = []
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._step = 0

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @property
    def manager(self) -> BlockManager:
        return self._manager

    @property
    def metrics(self) -> MetricsRecorder:
        return self._metrics

    def submit(self, request: Request) -> None:
        cfg, rid = self._config, request.request_id
        if rid in self._samples:
            raise InvalidRequestError(f"request {rid} was already submitted")
        if len(request.prompt) + request.max_new_tokens > cfg.max_model_len:
            raise CapacityError(f"request {rid} is longer than max_model_len {cfg.max_model_len}")
        if cdiv(request.max_kv_tokens, cfg.block_size) > cfg.num_blocks:
            raise CapacityError(f"request {rid} needs more blocks than the pool has")
        if request.n > cfg.max_num_seqs:
            raise CapacityError(f"request {rid} wants more samples than max_num_seqs")
        seq = _Seq(next(self._ids), request, 0, next(self._arrivals), list(request.prompt))
        seq.forked = request.n == 1
        self._samples[rid] = [seq]
        self._waiting.append(seq)
        self._metrics.on_submit(
            rid, request.request_class, step=self._step, arrival_time=request.arrival_time
        )

    def abort(self, request_id: int) -> None:
        if self._pending is not None:
            raise InvalidRequestError("abort() between update() and step()")
        if request_id not in self._samples or request_id in self._results:
            raise InvalidRequestError(f"request {request_id} is not in flight")
        for seq in self._samples[request_id]:
            self._drop(seq)
        self._results[request_id] = self._result(request_id, aborted=True)
        self._metrics.on_finish(request_id, step=self._step, aborted=True)
        self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def result(self, request_id: int) -> FinishedRequest:
        if request_id not in self._results:
            raise InvalidRequestError(f"request {request_id} has not finished")
        return self._results[request_id]

    # -- a step ------------------------------------------------------------------------

    def step(self) -> SchedulerOutput:
        if self._pending is not None:
            raise InvalidRequestError("update() must report the previous step first")
        budget = self._config.max_num_batched_tokens
        rows: list[tuple[_Seq, int]] = []
        preempted: list[int] = []
        queue = sorted(self._running, key=self._key)
        while queue:
            seq = queue.pop(0)
            k = min(len(seq.tokens) - seq.computed, self._chunk, budget)
            if k == 0:
                continue  # the budget is spent: it keeps its blocks, and runs next step
            while not self._manager.can_append(seq.seq_id, k):
                victim = queue.pop() if queue else seq  # the worst not yet scheduled
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            else:
                self._grant(seq, k, rows)
                budget -= self._charge(seq, k)
        if not preempted:  # nothing comes in in a step that had to push someone out
            self._admit(rows, budget)
        return self._emit(rows, preempted)

    def _charge(self, seq: _Seq, k: int) -> int:
        """What computing ``k`` tokens of ``seq`` costs against the step's token budget."""
        return k

    def _admit(self, rows: list[tuple[_Seq, int]], budget: int) -> None:
        seats = sum(s.seats for s in self._running)
        for seq in sorted(self._waiting, key=self._key):
            if budget == 0 or seats + seq.seats > self._config.max_num_seqs:
                return
            cached = self._manager.add_sequence(seq.seq_id, seq.tokens)
            k = min(len(seq.tokens) - cached, self._chunk, budget)
            if not self._manager.can_append(seq.seq_id, k):
                self._manager.free(seq.seq_id)  # give the cached blocks back: try next step
                return
            seq.computed = cached
            self._waiting.remove(seq)
            self._running.append(seq)
            self._grant(seq, k, rows)
            budget -= self._charge(seq, k)
            seats += seq.seats

    def _grant(self, seq: _Seq, k: int, rows: list[tuple[_Seq, int]]) -> None:
        self._manager.append_slots(seq.seq_id, seq.tokens[seq.computed : seq.computed + k])
        seq.computed += k
        rows.append((seq, k))
        self._metrics.on_scheduled(seq.request.request_id, step=self._step)

    def _preempt(self, seq: _Seq) -> None:
        self._running.remove(seq)
        self._manager.free(seq.seq_id)
        seq.computed = 0
        self._waiting.append(seq)
        self._metrics.on_preempt(seq.request.request_id)

    def _emit(self, rows: list[tuple[_Seq, int]], preempted: list[int]) -> SchedulerOutput:
        batch = build_batch(self._manager, [(s.seq_id, k) for s, k in rows])
        token_ids: list[int] = []
        samples: list[SampleSlot] = []
        for row, (seq, k) in enumerate(rows):
            token_ids += seq.tokens[seq.computed - k : seq.computed]
            if seq.computed < len(seq.tokens):
                continue  # a prompt chunk: nothing to sample yet
            rid = seq.request.request_id
            samples.append(SampleSlot(row, seq.seq_id, rid, seq.sample, seq.generated))
            if not seq.forked:  # the prompt is done: the other samples start here
                samples += [
                    SampleSlot(row, next(self._ids), rid, i, 0) for i in range(1, seq.seats)
                ]
        aborted, self._aborted = tuple(self._aborted), []
        self._pending = SchedulerOutput(
            step=self._step,
            batch=batch,
            token_ids=tuple(token_ids),
            samples=tuple(samples),
            preempted=tuple(preempted),
            aborted=aborted,
        )
        return self._pending

    # -- after the step ------------------------------------------------------------------

    def update(self, sampled: Mapping[int, int]) -> list[FinishedRequest]:
        out = self._pending
        if out is None:
            raise InvalidRequestError("update() without a step()")
        if set(sampled) != {s.seq_id for s in out.samples}:
            raise InvalidRequestError(f"expected tokens for {[s.seq_id for s in out.samples]}")
        seqs = {s.seq_id: s for s in self._running}
        for slot in out.samples:  # fork first: the new samples copy the prompt, not a token
            if slot.seq_id not in seqs:
                seqs[slot.seq_id] = self._fork(slot)
        finished = []
        for slot in out.samples:
            done = self._append(seqs[slot.seq_id], sampled[slot.seq_id])
            if done is not None:
                finished.append(done)
        self._pending = None
        self._step += 1
        return finished

    def _fork(self, slot: SampleSlot) -> _Seq:
        """Start sample ``slot.sample_index``: it shares the prompt's blocks (copy-on-write)."""
        parent = self._samples[slot.request_id][0]
        self._manager.fork(parent.seq_id, slot.seq_id)
        child = _Seq(slot.seq_id, parent.request, slot.sample_index, parent.arrival, [])
        child.tokens, child.computed, child.forked = list(parent.tokens), parent.computed, True
        parent.forked = True
        self._samples[slot.request_id].append(child)
        self._running.append(child)
        return child

    def _append(self, seq: _Seq, token: int) -> FinishedRequest | None:
        seq.forked = True
        seq.tokens.append(token)
        rid = seq.request.request_id
        self._metrics.on_token(rid, sample=seq.sample, step=self._step)
        if token not in seq.request.stop_tokens and seq.generated < seq.request.max_new_tokens:
            return None
        self._drop(seq)
        seq.done = True
        samples = self._samples[rid]
        if len(samples) < seq.request.n or not all(s.done for s in samples):
            return None
        self._results[rid] = self._result(rid, aborted=False)
        self._metrics.on_finish(rid, step=self._step)
        return self._results[rid]

    # -- helpers ---------------------------------------------------------------------------

    def _drop(self, seq: _Seq) -> None:
        if seq in self._running:
            self._running.remove(seq)
            self._manager.free(seq.seq_id)
        elif seq in self._waiting:
            self._waiting.remove(seq)

    def _result(self, request_id: int, *, aborted: bool) -> FinishedRequest:
        samples = sorted(self._samples[request_id], key=lambda s: s.sample)
        outputs = tuple(tuple(s.tokens[len(s.request.prompt) :]) for s in samples)
        return FinishedRequest(request_id, outputs, tuple(s.seq_id for s in samples), aborted)

    def _key(self, seq: _Seq) -> tuple[int, int, int]:
        by_priority = self._config.policy == "priority"
        return (seq.request.priority if by_priority else 0, seq.arrival, seq.sample)


class MyBrokenScheduler(MyScheduler):
    """The same, but decodes are "free": only prompt tokens are charged to the budget."""

    def _charge(self, seq: _Seq, k: int) -> int:
        return 0 if seq.generated > 0 and k == 1 else k
