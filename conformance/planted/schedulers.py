"""Deliberately broken schedulers: the scheduler suite must catch every one.

Each is a small, realistic mistake in the spec's
:class:`~spec.scheduler.ContinuousScheduler`. Most wrap it through the public
:class:`~spec.scheduler.Scheduler` protocol, building it with a wrong limit
or rewriting what its :meth:`step` returns; three break its preemption loop
and its cleanup, and so override its internal hooks (``_release``,
``_preempt``, ``_chunk``, ``_schedule_running``, ``_charge``, its
``_running`` table, the ``cache`` it asks for blocks): if those change, the
self-test reports them as missed.

The suite finds the first seven and the two speculative ones (the last two) with
the model-free invariants, the three after the first seven only with the engine
loop: the invariants cannot see a lost copy, a lost swap or a sample read from
the wrong row, but what the requests generate can.

>>> len(PLANTED), len(ENGINE_ONLY)
(12, 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from spec.block_manager import BlockManager
from spec.metrics import MetricsRecorder
from spec.request import Request, SeqStatus, Sequence
from spec.scheduler import (
    ContinuousScheduler,
    FinishedRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)


class _Wrapped:
    """A :class:`ContinuousScheduler` behind the protocol, with one thing changed.

    ``inner_config`` is what the inner scheduler is built with (the outside
    sees the real config); ``rewrite`` changes what each step returns.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self.inner: Scheduler = ContinuousScheduler(self.inner_config(config))

    def inner_config(self, config: SchedulerConfig) -> SchedulerConfig:
        return config

    def rewrite(self, out: SchedulerOutput, before: set[int]) -> SchedulerOutput:
        """``before``: the sequences that held blocks before this step."""
        return out

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @property
    def manager(self) -> BlockManager:
        return self.inner.manager

    @property
    def metrics(self) -> MetricsRecorder:
        return self.inner.metrics

    def submit(self, request: Request) -> None:
        self.inner.submit(request)

    def abort(self, request_id: int) -> None:
        self.inner.abort(request_id)

    def step(self) -> SchedulerOutput:
        before = set(self.manager.sequence_ids())
        return self.rewrite(self.inner.step(), before)

    def update(self, sampled: Mapping[int, int]) -> list[FinishedRequest]:
        return self.inner.update(sampled)

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def result(self, request_id: int) -> FinishedRequest:
        return self.inner.result(request_id)


# -- caught by the invariants ---------------------------------------------------------------


class BudgetPerSequence(_Wrapped):
    """Charges the token budget per sequence, not per step: a step may take it many times over."""

    def inner_config(self, config: SchedulerConfig) -> SchedulerConfig:
        budget = config.max_num_batched_tokens * config.max_num_seqs
        return dataclasses.replace(config, max_num_batched_tokens=budget)


class SeatsOffByTwo(_Wrapped):
    """Lets two sequences more than ``max_num_seqs`` run at once."""

    def inner_config(self, config: SchedulerConfig) -> SchedulerConfig:
        return dataclasses.replace(config, max_num_seqs=config.max_num_seqs + 2)


class AdmitsNewestFirst(_Wrapped):
    """Queues new requests last-in first-out: of those submitted together, the newest goes first."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._queued: list[Request] = []

    def submit(self, request: Request) -> None:
        self._queued.append(request)

    def _flush(self) -> None:
        while self._queued:
            self.inner.submit(self._queued.pop())

    def abort(self, request_id: int) -> None:
        self._flush()
        self.inner.abort(request_id)

    def step(self) -> SchedulerOutput:
        self._flush()
        return super().step()

    def has_unfinished(self) -> bool:
        return bool(self._queued) or self.inner.has_unfinished()


class FeedsPromptFromStart(_Wrapped):
    """After a prefix-cache hit, feeds the prompt from its start, not its first uncached token."""

    def rewrite(self, out: SchedulerOutput, before: set[int]) -> SchedulerOutput:
        b, ids = out.batch, list(out.token_ids)
        swapped_in = {s.seq_id for s in out.swap_in}
        for i, seq_id in enumerate(b.seq_ids):
            start, n = b.query_start_loc[i], b.query_len(i)
            if seq_id not in before and seq_id not in swapped_in and b.seq_lens[i] > n:
                ids[start : start + n] = self.manager.tokens(seq_id)[:n]
        return dataclasses.replace(out, token_ids=tuple(ids))


class LeaksFinished(ContinuousScheduler):
    """Forgets to free a sequence that finished (hook: ``_release``)."""

    def _release(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            del self._running[seq.seq_id]  # and the blocks stay held
        else:
            super()._release(seq)


class PreemptsScheduledVictim(ContinuousScheduler):
    """Picks the best running sequence as the victim, even one already scheduled this step.

    (Hook: ``_schedule_running``.) Its slots were granted, so the batch it is
    building refers to blocks it no longer holds.
    """

    def _schedule_running(self, plan: Any) -> None:
        for seq in sorted(self._running.values(), key=_rank):
            k = self._chunk(seq, plan)
            if seq.seq_id not in self._running or k == 0:
                continue
            while not self.cache.can_grow(seq.seq_id, k):
                others = sorted((s for s in self._running.values() if s is not seq), key=_rank)
                self._preempt(others[0] if others else seq, plan)
                if not others:
                    break
            else:
                self.cache.grow(seq.seq_id, seq.tokens[seq.num_computed : seq.num_computed + k])
                self._charge(seq, k, plan)


class SkipsAfterVictim(ContinuousScheduler):
    """Skips the next running sequence after a preemption (hooks: ``_preempt``, ``_chunk``)."""

    _stop = False

    def _preempt(self, seq: Sequence, plan: Any) -> None:
        super()._preempt(seq, plan)
        self._stop = True

    def _chunk(self, seq: Sequence, plan: Any) -> int:
        if self._stop:
            self._stop = False
            return 0
        return super()._chunk(seq, plan)


def _rank(seq: Sequence) -> Any:
    return seq.rank


# -- caught only by the engine loop (token-exact equivalence) -------------------------------


class DropsCopies(_Wrapped):
    """Leaves the copy-on-write copies out of the batch: a fork's first write lands in garbage."""

    def rewrite(self, out: SchedulerOutput, before: set[int]) -> SchedulerOutput:
        return dataclasses.replace(out, batch=dataclasses.replace(out.batch, copies=()))


class SwapsInWholeBlocks(_Wrapped):
    """Swaps a sequence back in whole blocks only: the tokens of its last partial block are lost."""

    def rewrite(self, out: SchedulerOutput, before: set[int]) -> SchedulerOutput:
        b = self._config.block_size
        swaps = tuple(
            dataclasses.replace(s, slots=s.slots[: len(s.slots) // b * b]) for s in out.swap_in
        )
        return dataclasses.replace(out, swap_in=swaps)


class ForkReadsRowZero(_Wrapped):
    """At a fork, the extra samples read the logits of batch row 0, not the prompt's own row."""

    def rewrite(self, out: SchedulerOutput, before: set[int]) -> SchedulerOutput:
        samples = tuple(
            dataclasses.replace(s, row=0) if s.sample_index > 0 and s.position == 0 else s
            for s in out.samples
        )
        return dataclasses.replace(out, samples=samples)


class SpecBudgetOneToken(ContinuousScheduler):
    """Counts one token per speculative decode in the budget: its drafts ride free (hook:
    ``_charge``), so a step of speculative rows passes ``max_num_batched_tokens``."""

    def _charge(self, seq: Sequence, k: int, plan: Any, drafts: tuple[int, ...] = ()) -> None:
        super()._charge(seq, k, plan, drafts)
        plan.budget += len(drafts)


class SpecKeepsRejected(ContinuousScheduler):
    """Verifies every draft on the memory side, whatever the target accepted (hook:
    ``_verify``): the block manager keeps rejected tokens the sequence never had."""

    def _verify(self, seq: Sequence, drafted: int, accepted: int) -> None:
        super()._verify(seq, drafted, drafted)


PLANTED: dict[str, Callable[[SchedulerConfig], Scheduler]] = {
    "budget per sequence, not per step": BudgetPerSequence,
    "max_num_seqs + 2 running": SeatsOffByTwo,
    "admits the newest waiting request first (LIFO)": AdmitsNewestFirst,
    "feeds the prompt from its start after a prefix-cache hit": FeedsPromptFromStart,
    "a finished sequence keeps its blocks": LeaksFinished,
    "preempts a victim already scheduled this step": PreemptsScheduledVictim,
    "skips the next running sequence after a preemption": SkipsAfterVictim,
    "copy-on-write copies left out of the batch": DropsCopies,
    "swap-in drops the last partial block": SwapsInWholeBlocks,
    "a fork's samples read row 0's logits": ForkReadsRowZero,
    "speculative decode counted as one token in the budget": SpecBudgetOneToken,
    "rejected drafts kept as verified in memory": SpecKeepsRejected,
}
"""Each planted bug, by what it breaks, and the class (a factory taking a config)."""

ENGINE_ONLY: frozenset[Callable[[SchedulerConfig], Scheduler]] = frozenset(
    {DropsCopies, SwapsInWholeBlocks, ForkReadsRowZero}
)
"""The planted bugs only the engine loop's token-exact check can see."""
