"""The host pool: where a preempted sequence's KV waits when it is swapped out.

Swapping trades host memory and transfer time for recomputation: the
sequence's device blocks are copied to host blocks and returned to the device
pool; later its KV is copied back into freshly allocated device blocks, and it
resumes without recomputing anything. Host blocks are never shared: swapping
out one of several forked samples copies the shared blocks for it alone.

The spec only decides *which* blocks move (:class:`SwapOut`, :class:`SwapIn`);
the engine moves the data through the backend: a swap-out reads the device
blocks (``Backend.read_cache``), a swap-in writes them through the new slots
(``Backend.write_kv``).

>>> host = HostPool(num_blocks=3)
>>> host.allocate(2), host.num_free
([0, 1], 1)
>>> host.free([1, 0]); host.num_free
3
>>> host.allocate(4)
Traceback (most recent call last):
...
spec.errors.OutOfBlocksError: host pool: 4 blocks wanted, 3 free
>>> host.free([True])
Traceback (most recent call last):
...
spec.errors.ArgumentTypeError: blocks[0] must be an int, got bool True
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from spec.errors import DoubleFreeError, OutOfBlocksError
from spec.validate import check_int, check_ints


@dataclass(frozen=True)
class SwapOut:
    """Copy device block ``device_blocks[i]`` to host block ``host_blocks[i]``, every layer.

    Executed first in a step, before any copy or write: the device blocks are
    already back in the pool and may be reused by this very step.
    """

    seq_id: int
    device_blocks: tuple[int, ...]
    host_blocks: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class SwapIn:
    """Write token ``p``'s KV from host block ``host_blocks[p // B]``, offset ``p % B``,
    into device slot ``slots[p]``, for ``p`` in ``0 .. len(slots) - 1``, every layer.

    Executed after swap-outs and copy-on-write copies, before the forward pass.
    """

    seq_id: int
    host_blocks: tuple[int, ...]
    slots: tuple[int, ...]


class HostPool:
    """``num_blocks`` host blocks: a free list and nothing else (no sharing, no cache)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = check_int("num_host_blocks", num_blocks, low=0)
        self._free: deque[int] = deque(range(num_blocks))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks, or raise and take none."""
        count = check_int("count", count, low=0)
        if count > len(self._free):
            raise OutOfBlocksError(f"host pool: {count} blocks wanted, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        self._held.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Return blocks, or raise and return none."""
        blocks = check_ints("blocks", blocks, low=0, high=self.num_blocks - 1)
        if len(set(blocks)) != len(blocks) or not self._held.issuperset(blocks):
            raise DoubleFreeError(f"host pool: {list(blocks)} are not all held")
        self._held.difference_update(blocks)
        self._free.extend(blocks)

    def check_integrity(self, holders: Sequence[int]) -> None:
        """Assert the held blocks are exactly ``holders`` (every swapped sequence's blocks)."""
        assert len(holders) == len(set(holders)), "a host block is held twice"
        assert set(holders) == self._held, f"host blocks held {sorted(self._held)} != {holders}"
        assert self.num_free + self.num_held == self.num_blocks, "host blocks lost"
