"""Host memory: where a swapped-out sequence's KV and state wait until it swaps back in.

Two host pools, of blocks (every paged group's KV) and of state slots. A *parked*
sequence holds host memory only: its device memory comes back fresh at swap-in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spec.errors import UnknownSequenceError
from spec.swap import HostPool, SwapOut
from spec.validate import check_int


@dataclass(frozen=True)
class Parked:
    """A swapped-out sequence: its host blocks per paged group, where each group's held
    entries began, and its state's host slot."""

    out: SwapOut  # the swap-out the engine was handed
    host_blocks: tuple[tuple[int, ...], ...]  # per paged group, its host blocks
    released: tuple[int, ...]  # per paged group, where its held entries began
    host_state: int | None  # the state's host slot; None: no state group


class HostMemory:
    """The host pools, and the sequences parked in them.

    Invariant: the host blocks and state slots held are exactly the parked sequences'.
    """

    def __init__(self, num_blocks: int, num_state_slots: int) -> None:
        self.blocks = HostPool(num_blocks)
        self.state_slots = HostPool(check_int("num_host_state_slots", num_state_slots, low=0))
        self._parked: dict[int, Parked] = {}  # seq id -> where its memory went

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._parked

    def ids(self) -> list[int]:
        return list(self._parked)

    def can_park(self, num_blocks: int, state: bool) -> bool:
        """Are ``num_blocks`` host blocks free, and a state slot if ``state``?"""
        return num_blocks <= self.blocks.num_free and (not state or self.state_slots.num_free > 0)

    def park(
        self,
        seq_id: int,
        held: Sequence[tuple[int, ...]],
        released: tuple[int, ...],
        num_tokens: int,
        state: int | None,
    ) -> SwapOut:
        """Give ``seq_id`` host blocks for ``held`` (each paged group's device blocks), and a
        host slot for the device state slot ``state``; return the copies that move them."""
        hosts = self.blocks.allocate(sum(len(h) for h in held))
        per_group, start = [], 0
        for h in held:
            per_group.append(tuple(hosts[start : start + len(h)]))
            start += len(h)
        pair = None if state is None else (state, self.state_slots.allocate(1)[0])
        device = tuple(b for h in held for b in h)
        out = SwapOut(seq_id, device, tuple(hosts), num_tokens, pair)
        host_state = None if pair is None else pair[1]
        self._parked[seq_id] = Parked(out, tuple(per_group), released, host_state)
        return out

    def parked(self, seq_id: int) -> Parked:
        """Where parked ``seq_id``'s memory waits."""
        swapped = self._parked.get(check_int("seq_id", seq_id, low=0))
        if swapped is None:
            raise UnknownSequenceError(f"sequence {seq_id} is not swapped out")
        return swapped

    def unpark(self, seq_id: int) -> None:
        """Free parked ``seq_id``'s host memory: it swapped in, or finished."""
        parked = self._parked.pop(seq_id)
        self.blocks.free(parked.out.host_blocks)
        if parked.host_state is not None:
            self.state_slots.free([parked.host_state])

    def check_integrity(self) -> None:
        """Assert that the host pools hold exactly the parked sequences' blocks and slots."""
        self.blocks.check_integrity([b for p in self._parked.values() for b in p.out.host_blocks])
        self.state_slots.check_integrity(
            [p.host_state for p in self._parked.values() if p.host_state is not None]
        )
