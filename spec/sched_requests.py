"""The scheduler's ledger of requests: each request's samples, their ids, and its result.

A request enters with sample 0, which runs the prompt; the other ``n - 1`` are forked
from it at the prompt's end. It leaves with a :class:`~spec.sched_types.FinishedRequest`
when every sample has finished, or at once when aborted.
"""

from __future__ import annotations

from collections.abc import Iterator

from spec.errors import ArgumentValueError, CapacityError
from spec.request import Request, SeqStatus, Sequence
from spec.sched_policy import SchedulerConfig, rank
from spec.sched_types import FinishedRequest, SampleSlot
from spec.validate import check_instance, check_int


class RequestBook:
    """Every request submitted: its samples, and its result once it has left.

    Invariant: a request's samples are its sample 0 until the fork, then all
    ``n``; it has a result exactly when it finished or was aborted.
    """

    def __init__(self) -> None:
        self._samples: dict[int, list[Sequence]] = {}  # request id -> its sequences
        self._results: dict[int, FinishedRequest] = {}  # request id -> how it left
        self._arrivals = 0  # requests submitted so far: the next one's arrival
        self._next_seq_id = 0

    def check_new(self, request: Request, config: SchedulerConfig) -> Request:
        """``request``, if it was never submitted and ``config`` could ever run it."""
        request = check_instance("request", request, Request)
        rid = request.request_id
        if rid in self._samples:
            raise ArgumentValueError(f"request_id {rid} was already submitted")
        total = len(request.prompt) + request.max_new_tokens
        if total > config.max_model_len:
            raise CapacityError(
                f"request {rid}: prompt {len(request.prompt)} + max_new_tokens "
                f"{request.max_new_tokens} = {total} tokens exceeds "
                f"max_model_len {config.max_model_len}"
            )
        if request.n > config.max_num_seqs:
            raise CapacityError(
                f"request {rid}: n = {request.n} samples exceeds max_num_seqs {config.max_num_seqs}"
            )
        return request

    def add(self, request: Request, config: SchedulerConfig, step: int) -> Sequence:
        """Start ``request``'s sample 0, ranked as submitted before ``step``."""
        seq = Sequence(
            self.new_seq_id(),
            request,
            0,
            self._arrivals,
            list(request.prompt),
            rank(
                config,
                priority=request.priority,
                submit_step=step,
                arrival=self._arrivals,
                sample_index=0,
            ),
            submit_step=step,
        )
        seq.forked = request.n == 1
        self._arrivals += 1
        self._samples[request.request_id] = [seq]
        return seq

    def fork(self, parent: Sequence, slot: SampleSlot) -> Sequence:
        """Start sample ``slot.sample_index`` as a copy of the prompt's sequence ``parent``."""
        virtual, arrival, _ = parent.rank
        child = Sequence(
            slot.seq_id,
            parent.request,
            slot.sample_index,
            parent.arrival,
            list(parent.tokens),
            (virtual, arrival, slot.sample_index),
            submit_step=parent.submit_step,
            num_computed=parent.num_computed,
            status=SeqStatus.RUNNING,
            forked=True,
        )
        parent.forked = True
        self._samples[parent.request.request_id].append(child)
        return child

    def samples(self, request_id: int) -> list[Sequence]:
        return self._samples[request_id]

    def in_flight(self, request_id: int) -> list[Sequence]:
        """The samples of ``request_id``, which must be submitted and not yet left."""
        seqs = self._samples.get(request_id)
        if seqs is None or request_id in self._results:
            raise ArgumentValueError(f"request_id {request_id} is not in flight")
        return seqs

    def all_finished(self, request_id: int) -> bool:
        """Have all ``n`` samples of ``request_id`` been forked, and finished?"""
        seqs = self._samples[request_id]
        n = seqs[0].request.n
        return not (len(seqs) < n or any(s.status is not SeqStatus.FINISHED for s in seqs))

    def finish(self, request_id: int, *, aborted: bool) -> FinishedRequest:
        """Record how ``request_id`` left: each sample's outputs, in sample order."""
        seqs = sorted(self._samples[request_id], key=lambda s: s.sample_index)
        self._results[request_id] = FinishedRequest(
            request_id, tuple(s.outputs for s in seqs), tuple(s.seq_id for s in seqs), aborted
        )
        return self._results[request_id]

    def result(self, request_id: int) -> FinishedRequest:
        request_id = check_int("request_id", request_id)
        try:
            return self._results[request_id]
        except KeyError:
            raise ArgumentValueError(f"request_id {request_id} has not finished") from None

    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def sequences(self) -> Iterator[Sequence]:
        """Every sequence ever created, request by request."""
        for seqs in self._samples.values():
            yield from seqs
