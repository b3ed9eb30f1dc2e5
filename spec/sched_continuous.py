"""The continuous (iteration-level) scheduler: the rules of one step, in the order they apply.

Read :mod:`spec.scheduler` first: it states the loop and the rules, with a
worked example. This module is those rules as code. It decides *who*
computes *how many* tokens; every question about memory goes to the
:class:`~spec.cache_manager.CacheManager`, as a query before its command, so
no block arithmetic happens here.

Every public call either completes or raises a :class:`~spec.errors.SpecError`
before it changes anything: ``submit`` checks the request fully (including
whether it could ever fit), ``update`` checks every sampled token before it
appends one, and ``step`` has no input to check; inside it each memory
command is issued only after its query said yes, so it cannot fail half-way.
A caller whose call was refused can abort the offending request and carry on.

What a step costs, with ``R`` running and ``W`` waiting sequences: ordering
the running ones is a sort of a list that is mostly in order already
(Timsort: O(R) when nothing joined, O(R log R) at worst); admission looks
only at the heads of the waiting and swapped queues, O(log W) per sequence
admitted and O(1) when no seat or budget is free; nothing is ever re-sorted
as sequences wait (:mod:`spec.sched_policy`). The layout and the metrics are
O(R + tokens). ``python -m benchmarks.scheduler`` measures it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Tokens
from dataclasses import asdict, dataclass, field
from operator import attrgetter

from spec.batch import BatchMetadata
from spec.block_manager import BlockManager
from spec.cache_manager import CacheManager
from spec.errors import ArgumentTypeError, ArgumentValueError, InvalidRequestError
from spec.metrics import MetricsRecorder, StepStats
from spec.request import Request, SeqStatus, Sequence
from spec.sched_policy import SchedulerConfig
from spec.sched_queue import RankedQueue
from spec.sched_requests import RequestBook
from spec.sched_types import FinishedRequest, SampleSlot, SchedulerOutput
from spec.swap import HostPool, SwapIn, SwapOut
from spec.validate import check_instance, check_int, check_token_id, check_token_ids, is_int

__all__ = ["ContinuousScheduler"]

_RANK = attrgetter("rank")


@dataclass
class _Plan:
    """One step being decided."""

    budget: int  # tokens left to give out this step
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[int] = field(default_factory=list)  # sequence ids preempted this step
    resumed: list[int] = field(default_factory=list)  # sequence ids back from preemption this step
    swap_out: list[SwapOut] = field(default_factory=list)  # copies to the host, done first
    swap_in: list[SwapIn] = field(default_factory=list)  # copies back from the host
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq id -> drafts to verify
    allocation_failures: int = 0  # times a sequence found too few blocks

    def charge(self, seq: Sequence, k: int, drafts: tuple[int, ...]) -> None:
        """``seq``'s next ``k`` tokens and ``drafts`` (with slots now) compute this step: all of
        them count in the budget; only the ``k`` count as computed until verified."""
        seq.num_computed += k
        self.budget -= k + len(drafts)
        self.scheduled.append((seq, k))
        if drafts:
            self.drafts[seq.seq_id] = drafts

    def rows(self) -> list[tuple[int, int]]:
        """The batch's ``(seq_id, query tokens)`` rows: each row's tokens, then its drafts."""
        return [(s.seq_id, k + len(self.drafts.get(s.seq_id, ()))) for s, k in self.scheduled]

    def token_ids(self) -> tuple[int, ...]:
        """The step's input tokens, row after row: the ``k`` charged, then the drafts."""
        token_ids: list[int] = []
        for seq, k in self.scheduled:
            token_ids.extend(seq.tokens[seq.num_computed - k : seq.num_computed])
            token_ids.extend(self.drafts.get(seq.seq_id, ()))
        return tuple(token_ids)

    def output(
        self, step: int, batch: BatchMetadata, samples: list[SampleSlot], aborted: tuple[int, ...]
    ) -> SchedulerOutput:
        """The step as the engine reads it: the batch, its inputs, and what moved."""
        return SchedulerOutput(
            step=step,
            batch=batch,
            token_ids=self.token_ids(),
            samples=tuple(samples),
            preempted=tuple(self.preempted),
            resumed=tuple(self.resumed),
            swap_out=tuple(self.swap_out),
            swap_in=tuple(self.swap_in),
            aborted=aborted,
            drafts=tuple(self.drafts.items()),
        )


class ContinuousScheduler:
    """Iteration-level scheduling over one :class:`CacheManager` (see :mod:`spec.scheduler`)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = check_instance("config", config, SchedulerConfig)
        self._cache = CacheManager.from_config(config)
        self._metrics = MetricsRecorder()
        self._book = RequestBook()  # every request: its samples, ids and result
        self._waiting = RankedQueue()  # never admitted, or preempted by recomputation
        self._swapped = RankedQueue()  # preempted by swapping: their KV is on the host
        self._running: dict[int, Sequence] = {}  # seq id -> sequence; they hold device blocks
        self._pending: SchedulerOutput | None = None
        self._proposals: dict[int, tuple[int, ...]] = {}  # seq id -> drafts for the next step
        self._aborted: list[int] = []
        self._step = 0

    # -- the protocol ------------------------------------------------------------

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @property
    def cache(self) -> CacheManager:
        """The memory side: every block this scheduler's sequences hold, device and host."""
        return self._cache

    @property
    def manager(self) -> BlockManager:
        """The device block manager (read-only use: the invariant checker, tests, tools)."""
        return self._cache.manager

    @property
    def host(self) -> HostPool:
        return self._cache.host

    @property
    def metrics(self) -> MetricsRecorder:
        return self._metrics

    def submit(self, request: Request) -> None:
        """Queue ``request``; reject it now if it could never run (admission control).

        Refused, changing nothing: a non-:class:`Request` (``ArgumentTypeError``),
        a ``request_id`` already submitted (``ArgumentValueError``), and with
        :class:`CapacityError` a prompt + ``max_new_tokens`` over
        ``max_model_len``, more samples than ``max_num_seqs``, or a sample that
        could not fit the whole pool.
        """
        request = self._book.check_new(request, self._config)
        self._cache.check_admissible(request)
        self._enqueue_new(self._book.add(request, self._config, self._step))
        self._metrics.on_submit(
            request.request_id,
            request.request_class,
            step=self._step,
            arrival_time=request.arrival_time,
        )

    def abort(self, request_id: int) -> None:
        """Drop a request (between steps): free its device and host blocks now."""
        request_id = check_int("request_id", request_id)
        seqs = self._book.in_flight(request_id)
        if self._pending is not None:
            raise InvalidRequestError("abort() between update() and step(), not mid-step")
        for seq in seqs:
            if seq.status in (SeqStatus.FINISHED, SeqStatus.ABORTED):
                continue
            self._release(seq)
            seq.status = SeqStatus.ABORTED
        self._book.finish(request_id, aborted=True)
        self._metrics.on_finish(request_id, step=self._step, aborted=True)
        self._aborted.append(request_id)

    def propose(self, seq_id: int, drafts: Tokens[int]) -> None:
        """Offer draft tokens for running ``seq_id``'s next step (between ``update`` and ``step``).

        The next step verifies up to ``num_speculative_tokens`` of them if the
        sequence is decoding, the budget has ``1 + k`` tokens for it and memory
        has lookahead slots for them (else it decodes one token as usual).
        Proposals last one step.
        """
        sid = check_int("seq_id", seq_id, low=0)
        toks = check_token_ids("drafts", drafts)
        if self._pending is not None:
            raise InvalidRequestError("propose() between update() and step(), not mid-step")
        if sid not in self._running:
            raise ArgumentValueError(f"seq_id {sid} is not a running sequence")
        self._proposals[sid] = toks

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._swapped or self._running or self._pending)

    def result(self, request_id: int) -> FinishedRequest:
        return self._book.result(request_id)

    def step(self) -> SchedulerOutput:
        """Decide this step: running first, then (if nothing was preempted) admissions."""
        if self._pending is not None:
            raise InvalidRequestError("step() again: update() must report the previous step first")
        plan = _Plan(budget=self._config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._admit(plan)
        out = self._emit(plan)
        self._pending = out
        self._proposals = {}
        return out

    def update(self, sampled: Mapping[int, int | Tokens[int]]) -> list[FinishedRequest]:
        """Append each sampled token; fork at a prompt's end; finish on stop or length.

        ``sampled`` maps every ``SampleSlot.seq_id`` of the last step, and
        nothing else, to a token id; a speculative row's (``out.drafts``) may
        map to its accepted drafts then the target's next token, which
        verifies them (the memory side rejects the rest). Checked in full before any token is
        appended: a refused call changes nothing and may be retried.
        """
        out = self._pending
        if out is None:
            raise InvalidRequestError("update() without a step() to report")
        tokens = _check_sampled(out, sampled)
        for slot in out.samples:  # forks first: the children copy the prompt, not the token
            if slot.sample_index > 0 and slot.seq_id not in self._running:
                self._fork(self._book.samples(slot.request_id)[0], slot)
        finished = []
        drafts = dict(out.drafts)
        for slot in out.samples:
            seq, toks = self._running[slot.seq_id], tokens[slot.seq_id]
            if slot.seq_id in drafts:
                self._verify(seq, len(drafts[slot.seq_id]), len(toks) - 1)
            for j, token in enumerate(toks):
                done = self._append_token(seq, token)
                if done is not None:
                    finished.append(done)
                if seq.status is not SeqStatus.RUNNING:
                    break  # a stop token among the accepted drafts ends the sample there
                if j < len(toks) - 1:
                    seq.num_computed += 1  # an accepted draft: this step computed its KV
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
        queue = deque(sorted(self._running.values(), key=_RANK))
        while queue:
            seq = queue.popleft()
            k = self._chunk(seq, plan)
            if k == 0:
                continue  # budget spent: it keeps its blocks and runs next step
            drafts = self._drafts(seq, k, plan)
            if drafts and not self._cache.can_grow(
                seq.seq_id, k + len(drafts), num_draft=len(drafts)
            ):
                drafts = ()  # no room for the lookahead: decode one token, preempt no one for it
            while not self._cache.can_grow(seq.seq_id, k):
                plan.allocation_failures += 1
                if not queue:
                    self._preempt(seq, plan)
                    break
                self._preempt(queue.pop(), plan)
            else:
                new = seq.tokens[seq.num_computed : seq.num_computed + k] + list(drafts)
                self._cache.grow(seq.seq_id, new, num_draft=len(drafts))
                self._charge(seq, k, plan, drafts)

    def _drafts(self, seq: Sequence, k: int, plan: _Plan) -> tuple[int, ...]:
        """The proposed drafts ``seq`` verifies this step: none unless it decodes one token.

        At most ``num_speculative_tokens``, what the budget (and chunk cap)
        leaves after the verified token, and what ``max_new_tokens`` leaves
        room for: ``1 + a`` new tokens must never pass it.
        """
        proposed = self._proposals.get(seq.seq_id, ())
        if not proposed or k != 1 or seq.remaining != 1 or not seq.forked:
            return ()
        room = seq.request.max_new_tokens - seq.num_generated - 1
        n = min(self._config.num_speculative_tokens, self._chunk_limit(plan) - 1, room)
        return proposed[: max(0, n)]

    def _verify(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Keep ``accepted`` of the step's ``drafted`` drafts; the memory side rejects the rest."""
        self._cache.verify(seq.seq_id, accepted)
        self._metrics.on_verify(step=self._step, drafted=drafted, accepted=accepted)

    def _preempt(self, seq: Sequence, plan: _Plan) -> None:
        """Take ``seq``'s blocks back now: to the host pool if swapping and room, else drop them."""
        swap = self._config.preemption == "swap" and self._cache.can_swap_out(seq.seq_id)
        swapped = self._cache.preempt(seq.seq_id, swap=swap)
        del self._running[seq.seq_id]
        if swapped is not None:
            plan.swap_out.append(swapped)
            seq.status = SeqStatus.SWAPPED
            self._swapped.push(seq)
        else:
            seq.reset_for_recompute()
            self._waiting.push(seq)
        seq.preempted = True
        plan.preempted.append(seq.seq_id)
        self._metrics.on_preempt(seq.request.request_id)

    # -- step, part 2: admission -----------------------------------------------------

    def _admit(self, plan: _Plan) -> None:
        """Bring sequences in, best first, until one does not fit (then stop: no overtaking).

        Only the heads of the queues are looked at: with no seat or no budget
        free, this returns at once, however many are waiting.
        """
        seats = sum(s.seats for s in self._running.values())
        while plan.budget > 0 and seats < self._config.max_num_seqs:
            seq = self._next_candidate()
            if seq is None or seats + seq.seats > self._config.max_num_seqs:
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

    def _next_candidate(self) -> Sequence | None:
        """The best-ranked of the swapped and waiting queues' heads."""
        waiting, swapped = self._waiting.peek(), self._swapped.peek()
        if waiting is None or swapped is None:
            return waiting or swapped
        return swapped if swapped.rank < waiting.rank else waiting

    def _start(self, seq: Sequence, plan: _Plan) -> bool:
        """Admit a waiting sequence: prefix-cache hits first, then its first chunk."""
        limit = self._chunk_limit(plan)
        if not self._cache.can_admit(seq.tokens, limit):
            return False
        admitted = self._cache.admit(seq.seq_id, seq.tokens, limit)
        self._waiting.discard(seq)
        seq.num_computed = admitted.cached_tokens
        seq.status = SeqStatus.RUNNING
        self._running[seq.seq_id] = seq
        if seq.preempted:
            seq.preempted = False
            plan.resumed.append(seq.seq_id)
        self._charge(seq, admitted.new_tokens, plan)
        return True

    def _swap_in(self, seq: Sequence, plan: _Plan) -> bool:
        """Bring a swapped sequence back into fresh blocks, and schedule its next tokens."""
        k = min(seq.remaining, self._chunk_limit(plan))
        if not self._cache.can_swap_in(seq.seq_id, k):
            return False
        plan.swap_in.append(self._cache.swap_in(seq.seq_id, seq.tokens, k))
        self._swapped.discard(seq)
        seq.status = SeqStatus.RUNNING
        seq.preempted = False
        self._running[seq.seq_id] = seq
        plan.resumed.append(seq.seq_id)
        self._charge(seq, k, plan)
        return True

    # -- step, part 3: the batch -------------------------------------------------------

    def _charge(self, seq: Sequence, k: int, plan: _Plan, drafts: tuple[int, ...] = ()) -> None:
        """Charge ``seq``'s ``k`` tokens and ``drafts`` to the step (:meth:`_Plan.charge`)."""
        plan.charge(seq, k, drafts)
        self._metrics.on_scheduled(seq.request.request_id, step=self._step)

    def _emit(self, plan: _Plan) -> SchedulerOutput:
        batch = self._cache.layout(plan.rows())
        samples: list[SampleSlot] = []
        for row, (seq, _) in enumerate(plan.scheduled):
            if seq.num_computed == len(seq.tokens):
                samples.extend(self._sample_slots(row, seq))
        self._record(plan, batch.num_seqs, batch.num_tokens)
        aborted, self._aborted = tuple(self._aborted), []
        return plan.output(self._step, batch, samples, aborted)

    def _sample_slots(self, row: int, seq: Sequence) -> list[SampleSlot]:
        """One slot for a caught-up sequence; ``n`` at a fork, children's ids reserved now."""
        rid = seq.request.request_id
        slots = [SampleSlot(row, seq.seq_id, rid, seq.sample_index, seq.num_generated)]
        if not seq.forked:
            for i in range(1, seq.request.n):
                slots.append(SampleSlot(row, self._book.new_seq_id(), rid, i, 0))
        return slots

    def _record(self, plan: _Plan, num_seqs: int, num_tokens: int) -> None:
        """The step's statistics: the batch, the queues, the plan's events and the pool's usage."""
        self._metrics.add_step(
            StepStats(
                step=self._step,
                num_seqs=num_seqs,
                num_tokens=num_tokens,
                num_waiting=self._num_waiting(),
                num_running=len(self._running),
                num_swapped=len(self._swapped),
                allocation_failures=plan.allocation_failures,
                preemptions=len(plan.preempted),
                swaps_out=len(plan.swap_out),
                swaps_in=len(plan.swap_in),
                **asdict(self._cache.usage()),
            )
        )

    # -- update ----------------------------------------------------------------------

    def _fork(self, parent: Sequence, slot: SampleSlot) -> None:
        """Start sample ``slot.sample_index`` as a copy-on-write fork of the prompt's sequence."""
        self._cache.fork(parent.seq_id, slot.seq_id)
        self._running[slot.seq_id] = self._book.fork(parent, slot)

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
        if not self._book.all_finished(rid):
            return None
        result = self._book.finish(rid, aborted=False)
        self._metrics.on_finish(rid, step=self._step)
        return result

    # -- hooks a variant may change ------------------------------------------------------

    def _enqueue_new(self, seq: Sequence) -> None:
        """Where a submitted request waits: the waiting queue, admitted best rank first."""
        self._waiting.push(seq)

    def _num_waiting(self) -> int:
        return len(self._waiting)

    def _release(self, seq: Sequence) -> None:
        """Free whatever ``seq`` holds, device or host, and drop it from every queue."""
        if seq.status is SeqStatus.RUNNING:
            self._cache.release(seq.seq_id)
            del self._running[seq.seq_id]
        elif seq.status is SeqStatus.SWAPPED:
            self._cache.release(seq.seq_id)
            self._swapped.discard(seq)
        elif seq.status is SeqStatus.WAITING:
            self._waiting.discard(seq)

    # -- helpers -----------------------------------------------------------------------

    def _chunk_limit(self, plan: _Plan) -> int:
        cap = self._config.max_chunk_tokens
        return plan.budget if cap is None else min(plan.budget, cap)

    def _chunk(self, seq: Sequence, plan: _Plan) -> int:
        return min(seq.remaining, self._chunk_limit(plan))

    # -- inspection ----------------------------------------------------------------------

    def sequences(self) -> Iterable[Sequence]:
        """Every sequence ever created (read-only use: tests and tools inspect them)."""
        return self._book.sequences()

    def check_integrity(self) -> None:
        """Assert that queues, statuses and memory agree (tests call this after every call).

        Running sequences are exactly the device holders, swapped ones exactly
        the host holders, waiting ones hold nothing; seats are within
        ``max_num_seqs``; and the memory side's own invariants hold.
        """
        self._cache.check_integrity()
        device = set(self._cache.manager.sequence_ids())
        assert device == set(self._running), f"running {sorted(self._running)}, device {device}"
        assert all(s.status is SeqStatus.RUNNING for s in self._running.values())
        swapped = {s.seq_id for s in self._swapped}
        assert swapped == set(self._cache.swapped_ids()), f"swapped {swapped} disagree with host"
        assert all(s.status is SeqStatus.SWAPPED for s in self._swapped)
        for seq in self._waiting:
            assert seq.status is SeqStatus.WAITING and not self._cache.holds(seq.seq_id)
        seats = sum(s.seats for s in self._running.values())
        assert seats <= self._config.max_num_seqs, f"{seats} seats taken"
        if self._pending is None:
            drafting = [s for s in self._running if self._cache.num_drafts(s)]
            assert not drafting, f"sequences {drafting} have drafts in flight between steps"


def _check_sampled(out: SchedulerOutput, sampled: object) -> dict[int, tuple[int, ...]]:
    """``sampled`` as ``{seq_id: tokens}``, if it names exactly the step's samples, each a token;
    a speculative row's sample may instead be its accepted drafts then one more token."""
    if not isinstance(sampled, Mapping):
        raise ArgumentTypeError(
            f"sampled must be a mapping from seq_id to token id, got {type(sampled).__name__}"
        )
    for key in sampled:
        if not is_int(key):
            raise ArgumentTypeError(
                f"sampled keys must be seq_ids (ints), got {type(key).__name__} {key!r}"
            )
    expected = {s.seq_id for s in out.samples}
    keys = {int(k) for k in sampled}
    if keys != expected:
        raise ArgumentValueError(
            f"sampled must name exactly the sequences step {out.step} samples "
            f"{sorted(expected)}: missing {sorted(expected - keys)}, "
            f"unexpected {sorted(keys - expected)}"
        )
    drafts = dict(out.drafts)
    return {
        int(k): _sampled_tokens(f"sampled[{k}]", v, drafts.get(int(k), ()))
        for k, v in sampled.items()
    }


def _sampled_tokens(name: str, value: object, drafts: tuple[int, ...]) -> tuple[int, ...]:
    """One token, or for a row with ``k`` drafts ``1 + a`` tokens whose first ``a`` are drafts."""
    if is_int(value) or not drafts:
        return (check_token_id(name, value),)
    tokens = check_token_ids(name, value)
    if not 1 <= len(tokens) <= len(drafts) + 1:
        raise ArgumentValueError(
            f"{name} must hold 1 + a tokens, a in 0..{len(drafts)} (the accepted drafts, then "
            f"the next token), got {len(tokens)}"
        )
    if tokens[:-1] != drafts[: len(tokens) - 1]:
        raise ArgumentValueError(
            f"{name} must start with accepted drafts {drafts[: len(tokens) - 1]}, got {tokens}"
        )
    return tokens
