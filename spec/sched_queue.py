"""The scheduler's queues: sequences kept in rank order without ever re-sorting.

A sequence's rank is fixed for its life (:mod:`spec.sched_policy`), so a
waiting queue is a binary heap keyed once at insertion. What each operation
costs, for a queue of ``n`` sequences:

* ``push``, ``pop``: O(log n);
* ``peek``: O(1), plus the amortised cost of dropping entries discarded earlier;
* ``discard`` (an abort): O(1); its heap entry is dropped lazily, and the heap
  is rebuilt (O(n)) when dead entries outnumber live ones, so that is
  amortised O(1) too;
* ``first(k)``: O(n log k), for the static scheduler's batch formation only;
* iteration in rank order: O(n log n), for inspection (tests, tools), never per step.

Admission only ever looks at the head (the first that does not fit stops
it), so a step that finds no seat or budget free costs O(1) here, however
long the queue.

>>> from spec.request import Request
>>> q = RankedQueue()
>>> r = Request(request_id=0, prompt=(1,), max_new_tokens=1)
>>> for seq_id, rank in [(0, (5, 0, 0)), (1, (2, 1, 0)), (2, (9, 2, 0))]:
...     q.push(Sequence(seq_id, r, 0, seq_id, [1], rank))
>>> q.peek().seq_id, len(q)
(1, 3)
>>> q.discard(q.peek()); q.pop().seq_id, [s.seq_id for s in q]
(0, [2])
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from spec.errors import ArgumentValueError
from spec.request import Sequence

__all__ = ["RankedQueue"]


class RankedQueue:
    """Sequences by rank, smallest first. A sequence is in the queue at most once."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int, int], int]] = []
        self._live: dict[int, Sequence] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, seq: Sequence) -> bool:
        return self._live.get(seq.seq_id) is seq

    def __iter__(self) -> Iterator[Sequence]:
        """In rank order (a sorted copy: for inspection, not for the per-step path)."""
        return iter(sorted(self._live.values(), key=lambda s: s.rank))

    def push(self, seq: Sequence) -> None:
        if seq.seq_id in self._live:
            raise ArgumentValueError(f"sequence {seq.seq_id} is already queued")
        self._live[seq.seq_id] = seq
        heapq.heappush(self._heap, (seq.rank, seq.seq_id))

    def peek(self) -> Sequence | None:
        """The best-ranked sequence, or None when the queue is empty."""
        heap = self._heap
        while heap and heap[0][1] not in self._live:
            heapq.heappop(heap)  # discarded earlier
        return self._live[heap[0][1]] if heap else None

    def pop(self) -> Sequence:
        seq = self.peek()
        if seq is None:
            raise ArgumentValueError("pop from an empty queue")
        heapq.heappop(self._heap)
        del self._live[seq.seq_id]
        return seq

    def discard(self, seq: Sequence) -> None:
        """Take ``seq`` out, wherever it is (lazily: its heap entry is skipped later)."""
        if self._live.get(seq.seq_id) is not seq:
            raise ArgumentValueError(f"sequence {seq.seq_id} is not in this queue")
        del self._live[seq.seq_id]
        if len(self._heap) > 2 * len(self._live) + 16:  # mostly dead entries: rebuild
            self._heap = [(s.rank, s.seq_id) for s in self._live.values()]
            heapq.heapify(self._heap)

    def first(self, k: int) -> list[Sequence]:
        """The ``k`` best-ranked sequences, in rank order."""
        return heapq.nsmallest(k, self._live.values(), key=lambda s: s.rank)
