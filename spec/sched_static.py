"""Static batching, the baseline continuous batching replaces: form a batch, run it to the end.

Static batching (what Orca, Yu et al., OSDI 2022, calls request-level
scheduling) waits until a batch fills, then runs every member to completion.
The GPU goes idle when short sequences finish, late joiners wait for the next
batch, and tail latency follows the longest member.

:class:`StaticScheduler` does exactly that, with one knob, ``max_wait_steps``:

* ``max_wait_steps > 0``: **static batching as defined above.** While no batch is
  running, requests gather in a lobby. A batch starts when it is *full*: its
  members take every seat (``max_num_seqs``), or the next request in line
  would not fit the pool at its worst case beside them. So that the last,
  never-full batch still runs, a batch also starts once the oldest request in
  the lobby has waited ``max_wait_steps`` steps since it was submitted. A step
  spent waiting to fill computes nothing (an empty batch, no samples).
* ``max_wait_steps = 0`` (the default): **take what is waiting.** A batch
  starts the moment the previous one ends, with whoever is in the lobby then
  (up to the same seat and worst-case limits). It never idles, so it isolates
  the one thing static batching loses even with no waiting: the refill. A
  finished request's seat stays empty until the whole batch ends.

Either way a batch's members are its requests in rank order (the same
:mod:`~spec.sched_policy` as the continuous scheduler), they run under the
same token budget (prompts are chunked), nobody joins until every member has
finished, and a batch's worst case fits the pool, so it never preempts (only
a lone request whose ``n`` samples together exceed the pool may, as a batch
always takes at least one request).

Cost: while a batch is in flight the lobby is not looked at; between batches
each step looks at the lobby's first ``max_num_seqs`` requests (O(W log S)
for ``W`` waiting and ``S`` seats).

Three requests of 3 new tokens each, submitted before steps 0, 1 and 2, two
seats. Taking what is waiting runs request 0 alone, and the other two wait
for it. Waiting to fill (``max_wait_steps=3``) idles one step, runs 0 and 1
together, then idles again until the last request, alone in the lobby, has
waited 3 steps.

>>> from spec.request import Request
>>> def first_steps(sched, arrivals):
...     steps = {}
...     for step in range(40):
...         for rid in [r for r, a in arrivals.items() if a == step]:
...             sched.submit(Request(request_id=rid, prompt=(1, 2), max_new_tokens=3))
...         out = sched.step()
...         for x in out.samples:
...             steps.setdefault(x.request_id, step)
...         _ = sched.update({x.seq_id: 5 for x in out.samples})
...     return steps
>>> cfg = SchedulerConfig(num_blocks=16, block_size=2, max_num_seqs=2)
>>> first_steps(StaticScheduler(cfg), {0: 0, 1: 1, 2: 2})    # step of each first token
{0: 0, 1: 3, 2: 3}
>>> first_steps(StaticScheduler(cfg, max_wait_steps=3), {0: 0, 1: 1, 2: 2})
{0: 1, 1: 1, 2: 5}
"""

from __future__ import annotations

from spec.request import SeqStatus, Sequence
from spec.sched_continuous import ContinuousScheduler, _Plan
from spec.sched_policy import SchedulerConfig
from spec.sched_queue import RankedQueue
from spec.validate import check_int

__all__ = ["StaticScheduler"]


class StaticScheduler(ContinuousScheduler):
    """Static batching: a batch forms, runs to completion, and only then does the next one form.

    ``max_wait_steps``: how many steps a batch may wait to fill (see the
    module docstring). ``StaticScheduler(config, max_wait_steps=K)`` with
    ``K > 0`` is static batching as defined above; the default 0 takes whatever is
    waiting, never idling. Use ``functools.partial(StaticScheduler,
    max_wait_steps=K)`` where a factory of one argument (the config) is wanted.
    """

    def __init__(self, config: SchedulerConfig, *, max_wait_steps: int = 0) -> None:
        super().__init__(config)
        self._max_wait_steps = check_int("max_wait_steps", max_wait_steps, low=0)
        self._lobby = RankedQueue()  # submitted, not yet in a batch
        self._batch: frozenset[int] = frozenset()  # request ids of the batch in flight

    @property
    def max_wait_steps(self) -> int:
        """Steps a batch may wait to fill (0: it never waits)."""
        return self._max_wait_steps

    @property
    def batch_running(self) -> bool:
        """Is a batch in flight (some member not finished)? Then nobody else may join."""
        return bool(self._waiting or self._swapped or self._running)

    @property
    def batch(self) -> frozenset[int]:
        """Request ids of the batch in flight (empty between batches)."""
        return self._batch if self.batch_running else frozenset()

    def has_unfinished(self) -> bool:
        return bool(self._lobby) or super().has_unfinished()

    def waiting_to_fill(self) -> bool:
        """Would the next step idle because the lobby's batch is not full and has time left?"""
        return not self.batch_running and bool(self._lobby) and self._launch_size() == 0

    # -- the hooks -------------------------------------------------------------------

    def _enqueue_new(self, seq: Sequence) -> None:
        self._lobby.push(seq)

    def _num_waiting(self) -> int:
        return len(self._waiting) + len(self._lobby)

    def _release(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.WAITING and seq in self._lobby:
            self._lobby.discard(seq)
        else:
            super()._release(seq)

    def _admit(self, plan: _Plan) -> None:
        """Start the next batch if none is in flight and it is full or timed out; admit members."""
        if not self.batch_running:
            members = [self._lobby.pop() for _ in range(self._launch_size())]
            for seq in members:
                self._waiting.push(seq)  # batch members wait as usual
            self._batch = frozenset(s.request.request_id for s in members)
        super()._admit(plan)

    def _launch_size(self) -> int:
        """How many of the lobby's first requests start a batch now (0: keep waiting to fill).

        The batch is the longest prefix of the lobby, in rank order, whose
        samples fit the seats and whose worst cases fit the pool together
        (at least one request). It starts if it is full (someone in the lobby
        is left out, every seat is taken, or its one request alone exceeds the
        pool) or the request at the head of the lobby has waited
        ``max_wait_steps`` steps since it was submitted; with 0, always.
        """
        head, max_seats = self._lobby.peek(), self._config.max_num_seqs
        if head is None:
            return 0
        candidates, seats = [], 0
        for seq in self._lobby.first(max_seats):  # n >= 1 each: no more than that fit the seats
            if seats + seq.request.n > max_seats:
                break
            candidates.append(seq)
            seats += seq.request.n
        fit = self._cache.worst_case_fit(s.request for s in candidates)
        size = max(1, fit)
        taken = sum(s.request.n for s in candidates[:size])
        full = size < len(self._lobby) or taken == max_seats or fit == 0
        timed_out = self._step - head.submit_step >= self._max_wait_steps
        return size if full or timed_out else 0

    def check_integrity(self) -> None:
        super().check_integrity()
        for seq in self._lobby:
            assert seq.status is SeqStatus.WAITING and not self._cache.holds(seq.seq_id)
