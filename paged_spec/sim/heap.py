"""External fragmentation, measured: a paged run's allocations replayed on a contiguous heap.

A block pool cannot fragment externally: any free block serves any sequence.
A contiguous allocator can. To measure how much, take a simulated paged run,
and replay its requests on a first-fit heap with the same number of slots:
each request reserves one contiguous range from the step it was first
scheduled to the step it finished, sized to its *final* length (prompt plus
output, which no real server knows: the best case for the heap). An allocation
fails with *external* fragmentation when the free slots add up to enough but
no single hole is large enough.

>>> heap = FirstFitHeap(10)
>>> a, b, c = heap.allocate(3), heap.allocate(3), heap.allocate(3)
>>> heap.free(a); heap.free(c)
>>> heap.free_slots, heap.largest_hole, heap.allocate(5)   # 7 free, in holes of 3 and 4
(7, 4, None)
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

from paged_spec.sim.traffic import TraceRequest
from spec.metrics import RequestTimeline


class FirstFitHeap:
    """``size`` slots; ranges taken from the lowest hole that fits, and returned whole."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._used: list[tuple[int, int]] = []  # sorted (start, length)

    def _holes(self) -> list[tuple[int, int]]:
        holes, at = [], 0
        for start, length in self._used:
            if start > at:
                holes.append((at, start - at))
            at = start + length
        if at < self.size:
            holes.append((at, self.size - at))
        return holes

    def allocate(self, length: int) -> int | None:
        """The start of a fresh range of ``length`` slots, or None if no hole is large enough."""
        for start, hole in self._holes():
            if hole >= length:
                bisect.insort(self._used, (start, length))
                return start
        return None

    def free(self, start: int) -> None:
        i = next(i for i, (s, _) in enumerate(self._used) if s == start)
        del self._used[i]

    @property
    def free_slots(self) -> int:
        return self.size - sum(length for _, length in self._used)

    @property
    def largest_hole(self) -> int:
        return max((hole for _, hole in self._holes()), default=0)


@dataclass(frozen=True)
class HeapReplay:
    """How a contiguous heap fared on a paged run's allocations."""

    allocations: int  # requests the paged run admitted
    failed: int  # the heap had no hole large enough
    failed_with_room: int  # ... although its free slots added up to enough: external
    free_share_at_failures: float  # mean share of the heap free when those failed
    largest_hole_share: float  # mean largest hole / free slots at those moments


def replay(
    requests: Mapping[int, RequestTimeline], trace: list[TraceRequest], slots: int
) -> HeapReplay:
    """Replay ``requests`` (a paged run's spec timelines) on a :class:`FirstFitHeap` of ``slots``.

    At each step the requests that finished in the step before release their
    ranges, then the requests first scheduled in this step reserve theirs, in
    arrival order. A request whose reservation fails is left out of the replay.
    """
    heap = FirstFitHeap(slots)
    starts = sorted(
        (t.first_scheduled_step, rid)
        for rid, t in requests.items()
        if t.first_scheduled_step is not None
    )
    never = len(trace) + 10**12  # a request that never finished holds its range to the end
    ends = {rid: never if t.finish_step is None else t.finish_step for rid, t in requests.items()}
    held: dict[int, int] = {}  # request -> start of its range
    failed = with_room = 0
    free_shares: list[float] = []
    hole_shares: list[float] = []
    for step, rid in starts:
        for other in [r for r in held if ends[r] < step]:
            heap.free(held.pop(other))
        need = trace[rid].prompt_len + trace[rid].output_len
        start = heap.allocate(need)
        if start is not None:
            held[rid] = start
            continue
        failed += 1
        if heap.free_slots >= need:
            with_room += 1
            free_shares.append(heap.free_slots / slots)
            hole_shares.append(heap.largest_hole / heap.free_slots)
    return HeapReplay(len(starts), failed, with_room, _mean(free_shares), _mean(hole_shares))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
