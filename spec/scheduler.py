"""Continuous batching: which sequences compute which tokens in each step.

The API, for an engine or a simulator that drives a scheduler from outside:

```python
sched = ContinuousScheduler(SchedulerConfig(num_blocks=64, block_size=16))
sched.submit(request)              # CapacityError now if it could never fit
while sched.has_unfinished():
    out = sched.step()             # SchedulerOutput: who computes which tokens, and where
    # run the model on out.batch / out.token_ids (or cost it), then sample
    # one token for every entry of out.samples (all of them share a row's logits
    # when a request forks), and report them:
    done = sched.update({s.seq_id: token for s in out.samples})
sched.metrics                      # spec.metrics.MetricsRecorder: steps and timelines
sched.result(request_id)           # FinishedRequest: each sample's generated tokens
```

Between ``update`` and the next ``step`` a caller may ``submit`` more requests
or ``abort`` one. Any implementation of the :class:`Scheduler` protocol plugs
into the engine, the simulator and ``conformance.scheduler_invariants``.

Each step (:meth:`ContinuousScheduler.step`):

1. **Running sequences first**, best first (priority, then arrival). Each gets
   the tokens it still has to compute, up to the step's token budget
   (``max_num_batched_tokens``) and ``max_chunk_tokens``: a decode is one
   token, a long prompt is cut into chunks. If the pool cannot hold them,
   the worst running sequence not yet scheduled this step is preempted (it
   may be the sequence itself), and its blocks return to the pool at once.
2. **Then, unless something was preempted**, swapped-out and waiting
   sequences are taken in the same order while seats (``max_num_seqs``),
   budget and blocks last; the first that does not fit stops admission, so
   no one overtakes the head of the queue (FCFS has bounded wait).
3. The step's work is laid out as :class:`spec.batch.BatchMetadata`.

A preempted sequence keeps the tokens it generated. By **recomputation** it
goes back to waiting and later recomputes prompt and generated tokens as one
long prefill; by **swapping** its KV moves to a host pool and comes back into
fresh blocks. Either way no sampled token is drawn again.

With ``n > 1`` samples a request runs its prompt once; when the prompt's last
token is computed the request forks (:meth:`BlockManager.fork`): all samples
share the prompt's blocks, and the first write into a shared partial block
copies it. It reserves ``n`` seats from admission, so the fork always fits.

A worked example: a budget of 8 tokens chunks a 10-token prompt, and a second
request joins as soon as the first is decoding.

>>> sched = ContinuousScheduler(
...     SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=8, max_num_seqs=4))
>>> sched.submit(Request(request_id=0, prompt=tuple(range(10)), max_new_tokens=2))
>>> out = sched.step()
>>> out.scheduled, out.samples                    # 8 of 10 prompt tokens; nothing to sample yet
(((0, 8),), ())
>>> _ = sched.update({})
>>> sched.submit(Request(request_id=1, prompt=(1, 2, 3), max_new_tokens=1))
>>> out = sched.step()
>>> out.scheduled                                 # the prompt's last 2 tokens, then request 1
((0, 2), (1, 3))
>>> [(s.seq_id, s.request_id) for s in out.samples]
[(0, 0), (1, 1)]
>>> [r.request_id for r in sched.update({0: 42, 1: 7})]     # request 1 is done after 1 token
[1]
>>> sched.step().scheduled, sched.manager.block_table(0)    # request 0 decodes token 42
(((0, 1),), (0, 1, 2))
>>> [(r.request_id, r.outputs) for r in sched.update({0: 43})]
[(0, ((42, 43),))]
>>> sched.has_unfinished(), sched.manager.pool.num_held
(False, 0)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from spec.batch import BatchMetadata, build_batch
from spec.block_manager import BlockManager, cdiv
from spec.errors import CapacityError, InvalidRequestError
from spec.metrics import MetricsRecorder, StepStats
from spec.prefix_cache import prompt_block_hashes
from spec.request import Request, SeqStatus, Sequence
from spec.swap import HostPool, SwapIn, SwapOut

__all__ = [
    "ContinuousScheduler",
    "FinishedRequest",
    "Request",
    "SampleSlot",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StaticScheduler",
]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policies. Defaults are small; vLLM's are 2048 tokens and 128 sequences."""

    num_blocks: int
    block_size: int
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 16
    max_model_len: int = 1024
    max_chunk_tokens: int | None = None  # per sequence per step; None: the whole budget
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption: Literal["recompute", "swap"] = "recompute"
    num_host_blocks: int = 0  # the host pool for swapping
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise InvalidRequestError(f"max_chunk_tokens must be >= 1, got {self.max_chunk_tokens}")
        if self.policy not in ("fcfs", "priority"):
            raise InvalidRequestError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.preemption not in ("recompute", "swap"):
            raise InvalidRequestError(
                f"preemption must be 'recompute' or 'swap', got {self.preemption!r}"
            )


@dataclass(frozen=True)
class SampleSlot:
    """Sample one token for ``seq_id`` from the logits of the last token of batch row ``row``.

    ``position`` is the index of the token to draw among the sample's generated
    tokens (0 for the first). At a fork several slots share one row.
    """

    row: int
    seq_id: int
    request_id: int
    sample_index: int
    position: int


@dataclass(frozen=True)
class FinishedRequest:
    """A request that left the system: each sample's generated tokens, and why it stopped."""

    request_id: int
    outputs: tuple[tuple[int, ...], ...]
    seq_ids: tuple[int, ...]
    aborted: bool = False


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's decision.

    Execute in this order: ``swap_out`` (read the device blocks), then
    ``batch.copies``, then ``swap_in`` (write through the new slots), then the
    forward pass over ``token_ids`` laid out by ``batch``.
    """

    step: int
    batch: BatchMetadata
    token_ids: tuple[int, ...]  # the input token of every row of the flattened batch
    samples: tuple[SampleSlot, ...]
    preempted: tuple[int, ...] = ()  # sequence ids preempted this step
    resumed: tuple[int, ...] = ()  # sequence ids that came back this step
    swap_out: tuple[SwapOut, ...] = ()
    swap_in: tuple[SwapIn, ...] = ()
    aborted: tuple[int, ...] = ()  # request ids aborted since the last step

    @property
    def scheduled(self) -> tuple[tuple[int, int], ...]:
        """``(seq_id, num_new_tokens)`` per batch row."""
        b = self.batch
        return tuple((s, b.query_len(i)) for i, s in enumerate(b.seq_ids))


@runtime_checkable
class Scheduler(Protocol):
    """What the engine, the simulator and the invariant checker need from a scheduler."""

    @property
    def config(self) -> SchedulerConfig: ...

    @property
    def manager(self) -> BlockManager: ...

    @property
    def metrics(self) -> MetricsRecorder: ...

    def submit(self, request: Request) -> None:
        """Queue a request, or raise :class:`CapacityError` if it can never fit."""
        ...

    def abort(self, request_id: int) -> None:
        """Drop a request now; its blocks go back to the pool."""
        ...

    def step(self) -> SchedulerOutput:
        """Decide the next step. Call :meth:`update` before the next ``step``."""
        ...

    def update(self, sampled: Mapping[int, int]) -> list[FinishedRequest]:
        """Report one sampled token per ``SampleSlot.seq_id``; return the requests that finished."""
        ...

    def has_unfinished(self) -> bool: ...

    def result(self, request_id: int) -> FinishedRequest: ...


@dataclass
class _Plan:
    """One step being decided."""

    budget: int
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    resumed: list[int] = field(default_factory=list)
    swap_out: list[SwapOut] = field(default_factory=list)
    swap_in: list[SwapIn] = field(default_factory=list)
    allocation_failures: int = 0


class ContinuousScheduler:
    """Iteration-level scheduling over one :class:`BlockManager` (see the module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._manager = BlockManager(
            config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.host = HostPool(config.num_host_blocks)
        self._metrics = MetricsRecorder()
        self._requests: dict[int, list[Sequence]] = {}
        self._results: dict[int, FinishedRequest] = {}
        self._waiting: list[Sequence] = []  # never admitted, or preempted by recomputation
        self._swapped: list[Sequence] = []
        self._running: list[Sequence] = []
        self._pending: SchedulerOutput | None = None
        self._aborted: list[int] = []
        self._next_seq_id = 0
        self._arrivals = 0
        self._step = 0

    # -- the protocol ------------------------------------------------------------

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
        """Queue ``request``; reject it now if it could never fit (admission control)."""
        cfg, rid = self._config, request.request_id
        if rid in self._requests:
            raise InvalidRequestError(f"request {rid} was already submitted")
        total = len(request.prompt) + request.max_new_tokens
        if total > cfg.max_model_len:
            raise CapacityError(
                f"request {rid}: prompt {len(request.prompt)} + max_new_tokens "
                f"{request.max_new_tokens} = {total} tokens exceeds "
                f"max_model_len {cfg.max_model_len}"
            )
        need = cdiv(request.max_kv_tokens, cfg.block_size)
        if need > cfg.num_blocks:
            raise CapacityError(
                f"request {rid}: {request.max_kv_tokens} tokens of KV need {need} blocks of "
                f"{cfg.block_size}, but the whole pool has {cfg.num_blocks}"
            )
        if request.n > cfg.max_num_seqs:
            raise CapacityError(
                f"request {rid}: n = {request.n} samples exceeds max_num_seqs {cfg.max_num_seqs}"
            )
        seq = Sequence(self._new_seq_id(), request, 0, self._arrivals, list(request.prompt))
        seq.forked = request.n == 1
        self._arrivals += 1
        self._requests[rid] = [seq]
        self._waiting.append(seq)
        self._metrics.on_submit(
            rid, request.request_class, step=self._step, arrival_time=request.arrival_time
        )

    def abort(self, request_id: int) -> None:
        """Drop a request (between steps): free its device and host blocks now."""
        if self._pending is not None:
            raise InvalidRequestError("abort() between update() and step(), not mid-step")
        seqs = self._requests.get(request_id)
        if seqs is None or request_id in self._results:
            raise InvalidRequestError(f"request {request_id} is not in flight")
        for seq in seqs:
            if seq.status in (SeqStatus.FINISHED, SeqStatus.ABORTED):
                continue
            self._release(seq)
            seq.status = SeqStatus.ABORTED
        self._results[request_id] = self._result(request_id, aborted=True)
        self._metrics.on_finish(request_id, step=self._step, aborted=True)
        self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._swapped or self._running or self._pending)

    def result(self, request_id: int) -> FinishedRequest:
        try:
            return self._results[request_id]
        except KeyError:
            raise InvalidRequestError(f"request {request_id} has not finished") from None

    def step(self) -> SchedulerOutput:
        """Decide this step: running first, then (if nothing was preempted) admissions."""
        if self._pending is not None:
            raise InvalidRequestError("update() must report the previous step first")
        plan = _Plan(budget=self._config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._admit(plan)
        out = self._emit(plan)
        self._pending = out
        return out

    def update(self, sampled: Mapping[int, int]) -> list[FinishedRequest]:
        """Append each sampled token; fork at a prompt's end; finish on stop or length."""
        out = self._pending
        if out is None:
            raise InvalidRequestError("update() without a step() to report")
        expected = {s.seq_id for s in out.samples}
        if set(sampled) != expected:
            raise InvalidRequestError(
                f"step {out.step} samples sequences {sorted(expected)}, got {sorted(sampled)}"
            )
        bad = {k: t for k, t in sampled.items() if not isinstance(t, int) or t < 0}
        if bad:
            raise InvalidRequestError(f"sampled tokens must be ids >= 0, got {bad}")
        seqs = {s.seq_id: s for s in self._running}
        for slot in out.samples:  # forks first: the children copy the prompt, not the token
            if slot.sample_index > 0 and slot.seq_id not in seqs:
                seqs[slot.seq_id] = self._fork(
                    seqs[self._requests[slot.request_id][0].seq_id], slot
                )
        finished = []
        for slot in out.samples:
            done = self._append_token(seqs[slot.seq_id], sampled[slot.seq_id])
            if done is not None:
                finished.append(done)
        self._pending = None
        self._step += 1
        return finished

    # -- step, part 1: running sequences --------------------------------------------

    def _schedule_running(self, plan: _Plan) -> None:
        """Give each running sequence its next tokens; preempt from the back when blocks run out.

        The queue holds only sequences not yet scheduled this step, so a victim
        is never one that already has slots, and popping from the front never
        skips a sequence when a victim is removed from the back.
        """
        queue = deque(sorted(self._running, key=self._key))
        while queue:
            seq = queue.popleft()
            k = self._chunk(seq, plan)
            if k == 0:
                continue  # budget spent: it keeps its blocks and runs next step
            while not self._manager.can_append(seq.seq_id, k):
                plan.allocation_failures += 1
                if not queue:
                    self._preempt(seq, plan)
                    break
                self._preempt(queue.pop(), plan)
            else:
                self._schedule(seq, k, plan)

    def _preempt(self, seq: Sequence, plan: _Plan) -> None:
        """Take ``seq``'s blocks back now: to the host pool if swapping and room, else drop them."""
        table = self._manager.block_table(seq.seq_id)
        swap = self._config.preemption == "swap" and self.host.num_free >= len(table)
        self._running.remove(seq)
        if swap:
            host = self.host.allocate(len(table))
            plan.swap_out.append(SwapOut(seq.seq_id, table, tuple(host), seq.num_computed))
            self._manager.free(seq.seq_id)
            seq.host_blocks = host
            seq.status = SeqStatus.SWAPPED
            self._swapped.append(seq)
        else:
            self._manager.free(seq.seq_id)
            seq.reset_for_recompute()
            self._waiting.append(seq)
        seq.preempted = True
        plan.preempted.append(seq.seq_id)
        self._metrics.on_preempt(seq.request.request_id)

    # -- step, part 2: admission -----------------------------------------------------

    def _candidates(self) -> list[Sequence]:
        """Swapped and waiting sequences, best first. Subclasses may narrow this."""
        return sorted(self._swapped + self._waiting, key=self._key)

    def _admit(self, plan: _Plan) -> None:
        """Bring sequences in, best first, until one does not fit (then stop: no overtaking)."""
        seats = sum(s.seats for s in self._running)
        for seq in self._candidates():
            if seats + seq.seats > self._config.max_num_seqs or plan.budget == 0:
                return
            ok = (
                self._swap_in(seq, plan)
                if seq.status is SeqStatus.SWAPPED
                else self._start(seq, plan)
            )
            if not ok:
                plan.allocation_failures += 1
                return
            seats += seq.seats

    def _start(self, seq: Sequence, plan: _Plan) -> bool:
        """Admit a waiting sequence: prefix-cache hits first, then its first chunk."""
        cached, cost = self._admission_cost(seq.tokens, plan)
        k = min(len(seq.tokens) - cached, self._chunk_limit(plan))
        cost += cdiv(cached + k, self._config.block_size) - cached // self._config.block_size
        if cost > self._manager.pool.num_available:
            return False
        got = self._manager.add_sequence(seq.seq_id, seq.tokens)
        assert got == cached, f"sequence {seq.seq_id}: {got} cached tokens, {cached} predicted"
        seq.num_computed = cached
        self._enter_running(seq, plan)
        self._schedule(seq, k, plan)
        return True

    def _admission_cost(self, tokens: list[int], plan: _Plan) -> tuple[int, int]:
        """Prompt tokens the cache will supply, and how many of those blocks are evictable now.

        A hit on an evictable block takes it out of the available count just
        like an allocation, so the check must count it; querying (not adding
        and rolling back) keeps the prefix-cache statistics honest.
        """
        cached = self._manager.cached_prefix(tokens)
        pool, b = self._manager.pool, self._config.block_size
        hashes = prompt_block_hashes(tokens, b)[: cached // b] if cached else []
        evictable = 0
        for h in hashes:
            block = pool.cached_block(h)
            evictable += block is not None and pool.ref_count(block) == 0
        return cached, evictable

    def _swap_in(self, seq: Sequence, plan: _Plan) -> bool:
        """Bring a swapped sequence back into fresh blocks, and schedule its next tokens."""
        k = min(seq.remaining, self._chunk_limit(plan))
        need = cdiv(seq.num_computed + k, self._config.block_size)
        if need > self._manager.pool.num_available:
            return False
        self._manager.add_sequence(seq.seq_id, [])
        slots = self._manager.append_slots(seq.seq_id, seq.tokens[: seq.num_computed])
        self._manager.mark_written(seq.seq_id)  # the swap-in writes their KV, not the batch
        plan.swap_in.append(SwapIn(seq.seq_id, tuple(seq.host_blocks), tuple(slots)))
        self.host.free(seq.host_blocks)
        seq.host_blocks = []
        self._swapped.remove(seq)
        seq.status = SeqStatus.RUNNING
        seq.preempted = False
        self._running.append(seq)
        plan.resumed.append(seq.seq_id)
        self._schedule(seq, k, plan)
        return True

    def _enter_running(self, seq: Sequence, plan: _Plan) -> None:
        self._waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self._running.append(seq)
        if seq.preempted:
            seq.preempted = False
            plan.resumed.append(seq.seq_id)

    # -- step, part 3: the batch -------------------------------------------------------

    def _schedule(self, seq: Sequence, k: int, plan: _Plan) -> None:
        """Give slots to ``seq``'s next ``k`` tokens and charge them to the budget."""
        start = seq.num_computed
        self._manager.append_slots(seq.seq_id, seq.tokens[start : start + k])
        seq.num_computed += k
        plan.budget -= k
        plan.scheduled.append((seq, k))
        self._metrics.on_scheduled(seq.request.request_id, step=self._step)

    def _emit(self, plan: _Plan) -> SchedulerOutput:
        batch = build_batch(self._manager, [(s.seq_id, k) for s, k in plan.scheduled])
        token_ids: list[int] = []
        samples: list[SampleSlot] = []
        for row, (seq, k) in enumerate(plan.scheduled):
            token_ids.extend(seq.tokens[seq.num_computed - k : seq.num_computed])
            if seq.num_computed == len(seq.tokens):
                samples.extend(self._sample_slots(row, seq))
        self._record(plan, batch)
        aborted, self._aborted = tuple(self._aborted), []
        return SchedulerOutput(
            step=self._step,
            batch=batch,
            token_ids=tuple(token_ids),
            samples=tuple(samples),
            preempted=tuple(plan.preempted),
            resumed=tuple(plan.resumed),
            swap_out=tuple(plan.swap_out),
            swap_in=tuple(plan.swap_in),
            aborted=aborted,
        )

    def _sample_slots(self, row: int, seq: Sequence) -> list[SampleSlot]:
        """One slot for a caught-up sequence; ``n`` at a fork, children's ids reserved now."""
        rid = seq.request.request_id
        slots = [SampleSlot(row, seq.seq_id, rid, seq.sample_index, seq.num_generated)]
        if not seq.forked:
            for i in range(1, seq.request.n):
                slots.append(SampleSlot(row, self._new_seq_id(), rid, i, 0))
        return slots

    def _record(self, plan: _Plan, batch: BatchMetadata) -> None:
        m, pool = self._manager, self._manager.pool
        self._metrics.add_step(
            StepStats(
                step=self._step,
                num_seqs=batch.num_seqs,
                num_tokens=batch.num_tokens,
                num_waiting=len(self._waiting),
                num_running=len(self._running),
                num_swapped=len(self._swapped),
                free_blocks=pool.num_free,
                cached_blocks=pool.num_cached,
                used_blocks=pool.num_held,
                tail_waste=sum(m.tail_waste(s.seq_id) for s in self._running),
                allocation_failures=plan.allocation_failures,
                preemptions=len(plan.preempted),
                swaps_out=len(plan.swap_out),
                swaps_in=len(plan.swap_in),
                prefix_queried_tokens=m.prefix_stats.queried_tokens,
                prefix_hit_tokens=m.prefix_stats.hit_tokens,
            )
        )

    # -- update ----------------------------------------------------------------------

    def _fork(self, parent: Sequence, slot: SampleSlot) -> Sequence:
        """Start sample ``slot.sample_index`` as a copy-on-write fork of the prompt's sequence."""
        self._manager.fork(parent.seq_id, slot.seq_id)
        child = Sequence(
            slot.seq_id, parent.request, slot.sample_index, parent.arrival, list(parent.tokens)
        )
        child.num_computed, child.forked, child.status = (
            parent.num_computed,
            True,
            SeqStatus.RUNNING,
        )
        parent.forked = True
        self._requests[parent.request.request_id].append(child)
        self._running.append(child)
        return child

    def _append_token(self, seq: Sequence, token: int) -> FinishedRequest | None:
        """Add a sampled token; on stop or length, free the sequence's blocks now."""
        seq.forked = True  # n == 1, or the fork above has happened
        seq.tokens.append(token)
        rid = seq.request.request_id
        self._metrics.on_token(rid, sample=seq.sample_index, step=self._step)
        if token not in seq.request.stop_tokens and seq.num_generated < seq.request.max_new_tokens:
            return None
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seqs = self._requests[rid]
        if len(seqs) < seq.request.n or any(s.status is not SeqStatus.FINISHED for s in seqs):
            return None
        self._results[rid] = self._result(rid, aborted=False)
        self._metrics.on_finish(rid, step=self._step)
        return self._results[rid]

    # -- helpers -----------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        """Free whatever ``seq`` holds, device or host, and drop it from every queue."""
        if seq.status is SeqStatus.RUNNING:
            self._manager.free(seq.seq_id)
            self._running.remove(seq)
        elif seq.status is SeqStatus.SWAPPED:
            self.host.free(seq.host_blocks)
            seq.host_blocks = []
            self._swapped.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self._waiting.remove(seq)

    def _result(self, request_id: int, *, aborted: bool) -> FinishedRequest:
        seqs = sorted(self._requests[request_id], key=lambda s: s.sample_index)
        return FinishedRequest(
            request_id, tuple(s.outputs for s in seqs), tuple(s.seq_id for s in seqs), aborted
        )

    def _key(self, seq: Sequence) -> tuple[int, int, int]:
        return seq.order_key(self._config.policy == "priority")

    def _chunk_limit(self, plan: _Plan) -> int:
        cap = self._config.max_chunk_tokens
        return plan.budget if cap is None else min(plan.budget, cap)

    def _chunk(self, seq: Sequence, plan: _Plan) -> int:
        return min(seq.remaining, self._chunk_limit(plan))

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def sequences(self) -> Iterable[Sequence]:
        """Every sequence ever created (read-only use: tests and tools inspect them)."""
        for seqs in self._requests.values():
            yield from seqs


class StaticScheduler(ContinuousScheduler):
    """The baseline: form a batch, run it to completion, only then form the next.

    A batch takes requests in order while their worst case (every sample
    reaching ``max_new_tokens``, nothing shared) fits the pool, so it never
    preempts. Prompts are still chunked under the token budget, so both
    schedulers obey the same invariants; what static batching loses is the
    refill: a finished request's seat stays empty until the whole batch ends.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._batch: set[int] = set()  # request ids of the current batch

    def _candidates(self) -> list[Sequence]:
        live = self._running + self._waiting + self._swapped
        self._batch &= {s.request.request_id for s in live}
        if not self._batch:
            self._form_batch()
        return [s for s in super()._candidates() if s.request.request_id in self._batch]

    def _form_batch(self) -> None:
        cfg = self._config
        blocks = seats = 0
        for seq in sorted(self._waiting, key=self._key):
            r = seq.request
            worst = r.n * cdiv(r.max_kv_tokens, cfg.block_size)
            full = blocks + worst > cfg.num_blocks or seats + r.n > cfg.max_num_seqs
            if full and self._batch:
                break  # the first request always goes in: a lone request may still preempt
            blocks, seats = blocks + worst, seats + r.n
            self._batch.add(r.request_id)
