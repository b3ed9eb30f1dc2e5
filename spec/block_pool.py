"""The block pool: physical KV memory cut into fixed-size blocks.

The pool knows nothing about sequences. It hands out block ids, counts how many
holders each block has, and takes blocks back. Every block is in exactly one of
three states:

* **free**: reference count 0, no cached content. It sits in the free list.
* **held**: reference count >= 1. Some sequence's block table (or a pending
  copy) points at it.
* **cached**: reference count 0, but it holds a full block whose content is
  registered in the prefix cache. It stays resident so that a later prompt with
  the same prefix can reuse it, and is evicted least-recently-used when the
  free list runs dry.

Allocation and release are O(1): the free list is a deque, the cached blocks an
insertion-ordered dict used as an LRU queue. Nothing ever scans or sorts the pool.
Every operation checks its arguments (:mod:`spec.validate`) before it changes
anything: a block id is an ``int`` in ``0 .. num_blocks - 1``, never a bool.

>>> pool = BlockPool(num_blocks=4, block_size=16)
>>> a, b = pool.allocate(), pool.allocate()
>>> (a, b, pool.num_free)
(0, 1, 2)
>>> pool.incref(a)            # a second holder (a fork) shares block 0
>>> pool.ref_count(a)
2
>>> pool.decref(a); pool.decref(a); pool.num_free
3
>>> pool.decref(a)
Traceback (most recent call last):
...
spec.errors.DoubleFreeError: block 0 is already free (reference count 0)
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping

from spec.errors import BlockStateError, DoubleFreeError, OutOfBlocksError, UnknownBlockError
from spec.validate import check_hash, check_int, check_positive

BlockHash = bytes
"""The identity of a full block's content: see :mod:`spec.prefix_cache`."""


class BlockPool:
    """``num_blocks`` physical blocks of ``block_size`` token slots each.

    Invariant: ``num_free + num_held + num_cached == num_blocks``, and a block's
    reference count is zero exactly when it is free or cached.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = check_positive("num_blocks", num_blocks)
        self.block_size = check_positive("block_size", block_size)
        self._ref_counts = [0] * self.num_blocks
        self._free: deque[int] = deque(range(self.num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, LRU first
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self.num_evictions = 0
        self.num_allocation_failures = 0

    # -- counts -------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with no holder and no cached content."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks with no holder that keep a cached prefix (evictable)."""
        return len(self._evictable)

    @property
    def num_held(self) -> int:
        """Blocks with at least one holder."""
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Blocks an allocation can obtain right now: free ones, then evictable ones."""
        return self.num_free + self.num_cached

    def ref_count(self, block: int) -> int:
        return self._ref_counts[self._block("block", block)]

    # -- allocate and release -----------------------------------------------

    def allocate(self) -> int:
        """Take one block, with reference count 1.

        A free block if there is one; otherwise the least recently used cached
        block, whose hash entry is dropped the moment it is reused, so that a
        later lookup can never return content that has been overwritten.
        A failure changes nothing but ``num_allocation_failures``, which counts it.
        """
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self.num_evictions += 1
        else:
            self.num_allocation_failures += 1
            raise OutOfBlocksError(f"no free block: all {self.num_blocks} blocks are held")
        self._ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Add a holder to a held or cached block (a fork, or a prefix-cache hit)."""
        b = self._block("block", block)
        if self._ref_counts[b] == 0:
            if b not in self._evictable:
                raise BlockStateError(f"block {b} is free: allocate it, do not share it")
            del self._evictable[b]
        self._ref_counts[b] += 1

    def decref(self, block: int) -> None:
        """Drop one holder. At zero the block becomes cached if it has a hash, else free."""
        b = self._block("block", block)
        if self._ref_counts[b] == 0:
            raise DoubleFreeError(f"block {b} is already free (reference count 0)")
        self._ref_counts[b] -= 1
        if self._ref_counts[b] == 0:
            if b in self._hash_of:
                self._evictable[b] = None  # most recently used end
            else:
                self._free.append(b)

    # -- prefix cache index -------------------------------------------------

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding content with this hash, if it is resident."""
        return self._block_of.get(check_hash("block_hash", block_hash))

    def block_hash(self, block: int) -> BlockHash | None:
        return self._hash_of.get(self._block("block", block))

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Record that a held, full block holds the content named by ``block_hash``.

        Returns False (and records nothing) when another block already holds
        that content, or this block is already registered: one hash, one block.
        """
        b = self._block("block", block)
        h = check_hash("block_hash", block_hash)
        if self._ref_counts[b] == 0:
            raise BlockStateError(f"block {b} is not held: only held blocks are cached")
        if h in self._block_of or b in self._hash_of:
            return False
        self._block_of[h] = b
        self._hash_of[b] = h
        return True

    def unregister(self, block: int) -> bool:
        """Forget a held block's content hash; return whether it had one.

        For a block whose content will never be written after all (its
        sequence is freed before its step runs): it must never be found, and
        at reference count zero it goes to the free list, not the cache.
        """
        b = self._block("block", block)
        if self._ref_counts[b] == 0:
            raise BlockStateError(f"block {b} is not held: only a holder may unregister it")
        h = self._hash_of.pop(b, None)
        if h is None:
            return False
        del self._block_of[h]
        return True

    def reset_cache(self) -> None:
        """Forget every cached prefix; cached blocks become free."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._free.append(block)
        self._hash_of.clear()
        self._block_of.clear()

    # -- checks -------------------------------------------------------------

    def check_integrity(self, holders: Mapping[int, int] | None = None) -> None:
        """Assert the pool's invariants; with ``holders``, also that refcounts match them.

        ``holders`` maps block id to the number of references that the caller
        knows about (block-table entries plus pending copies).
        """
        free = set(self._free)
        cached = set(self._evictable)
        assert len(free) == len(self._free), "a block appears twice in the free list"
        assert not free & cached, f"blocks both free and cached: {sorted(free & cached)}"
        for block in range(self.num_blocks):
            count = self._ref_counts[block]
            assert count >= 0, f"block {block} has reference count {count}"
            if count == 0:
                assert block in free or block in cached, f"block {block} is lost"
            else:
                assert block not in free and block not in cached, (
                    f"held block {block} is also free or cached"
                )
            if block in cached:
                assert block in self._hash_of, f"cached block {block} has no hash"
            if block in free:
                assert block not in self._hash_of, f"free block {block} has a hash"
        held = sum(1 for count in self._ref_counts if count > 0)
        assert len(free) + len(cached) + held == self.num_blocks, (
            f"{len(free)} free + {len(cached)} cached + {held} held != {self.num_blocks} blocks"
        )
        assert len(self._hash_of) == len(self._block_of), "hash index is not one-to-one"
        for block, block_hash in self._hash_of.items():
            assert self._block_of.get(block_hash) == block, f"hash index broken at block {block}"
        if holders is not None:
            for block in range(self.num_blocks):
                expected = holders.get(block, 0)
                assert self._ref_counts[block] == expected, (
                    f"block {block}: reference count {self._ref_counts[block]}, "
                    f"but {expected} holders"
                )

    def _block(self, name: str, value: object) -> int:
        """``value`` as a block id: an int in ``0 .. num_blocks - 1``."""
        b = check_int(name, value)
        if not 0 <= b < self.num_blocks:
            raise UnknownBlockError(
                f"{name} must be a block id in 0..{self.num_blocks - 1}, got {b}"
            )
        return b
