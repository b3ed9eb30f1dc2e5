"""What a scheduler hands out and takes back: the output types and the :class:`Scheduler` protocol.

Each step a scheduler returns a :class:`SchedulerOutput`: the batch layout,
the input token of every row, the :class:`SampleSlot` of every token to
sample, and the memory moves (swap-outs, copies, swap-ins) to execute first.
The caller reports one sampled token per slot, and receives a
:class:`FinishedRequest` for each request that left the system. A step may
also be empty (no rows, no samples): a static scheduler waiting for its batch
to fill (:mod:`spec.sched_static`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from spec.batch import BatchMetadata
from spec.block_manager import BlockManager
from spec.metrics import MetricsRecorder
from spec.request import Request
from spec.sched_policy import SchedulerConfig
from spec.swap import SwapIn, SwapOut

__all__ = ["FinishedRequest", "SampleSlot", "Scheduler", "SchedulerOutput"]


@dataclass(frozen=True)
class SampleSlot:
    """Sample one token for ``seq_id`` from the logits of the last token of batch row ``row``.

    ``position`` is the index of the token to draw among the sample's generated
    tokens (0 for the first). At a fork several slots share one row.
    """

    row: int  # batch row whose last token's logits to sample
    seq_id: int  # the sample that gets the token
    request_id: int  # its request
    sample_index: int  # 0 .. n - 1
    position: int  # index among the sample's generated tokens


@dataclass(frozen=True)
class FinishedRequest:
    """A request that left the system: each sample's generated tokens, and why it stopped."""

    request_id: int  # the request
    outputs: tuple[tuple[int, ...], ...]  # each sample's generated tokens
    seq_ids: tuple[int, ...]  # each sample's sequence id
    aborted: bool = False  # cancelled by the client rather than finished


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's decision.

    Execute in this order: ``swap_out`` (read the device blocks), then
    ``batch.copies``, then ``swap_in`` (write through the new slots), then the
    forward pass over ``token_ids`` laid out by ``batch``.

    A speculative row (``drafts`` names it) ends with its ``k`` drafts: its
    sample reports the accepted drafts and the target's next token, ``1 + a``
    tokens (:func:`spec.speculative.accepted_prefix`), not one.
    """

    step: int  # the step's number, from 0
    batch: BatchMetadata  # where every token's KV goes and is read
    token_ids: tuple[int, ...]  # the input token of every row of the flattened batch
    samples: tuple[SampleSlot, ...]  # one per sequence that samples this step
    preempted: tuple[int, ...] = ()  # sequence ids preempted this step
    resumed: tuple[int, ...] = ()  # sequence ids that came back this step
    swap_out: tuple[SwapOut, ...] = ()  # done first
    swap_in: tuple[SwapIn, ...] = ()  # done after the copies, before the forward pass
    aborted: tuple[int, ...] = ()  # request ids aborted since the last step
    drafts: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (seq_id, drafts) per speculative row

    @property
    def scheduled(self) -> tuple[tuple[int, int], ...]:
        """``(seq_id, num_new_tokens)`` per batch row."""
        b = self.batch
        return tuple((s, b.query_len(i)) for i, s in enumerate(b.seq_ids))


@runtime_checkable
class Scheduler(Protocol):
    """What the engine, the simulator and the invariant checker need from a scheduler.

    Every method either completes or raises a :class:`~spec.errors.SpecError`
    (naming the bad argument) having changed nothing, so a caller can abort
    the offending request and carry on.
    """

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
