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

from spec.errors import DoubleFreeError, InvalidRequestError, OutOfBlocksError, UnknownBlockError

BlockHash = bytes
"""The identity of a full block's content: see :mod:`spec.prefix_cache`."""


class BlockPool:
    """``num_blocks`` physical blocks of ``block_size`` token slots each.

    Invariant: ``num_free + num_held + num_cached == num_blocks``, and a block's
    reference count is zero exactly when it is free or cached.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise InvalidRequestError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
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
        self._check_id(block)
        return self._ref_counts[block]

    # -- allocate and release -----------------------------------------------

    def allocate(self) -> int:
        """Take one block, with reference count 1.

        A free block if there is one; otherwise the least recently used cached
        block, whose hash entry is dropped the moment it is reused, so that a
        later lookup can never return content that has been overwritten.
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
        self._check_id(block)
        if self._ref_counts[block] == 0:
            if block not in self._evictable:
                raise InvalidRequestError(f"block {block} is free: allocate it, do not share it")
            del self._evictable[block]
        self._ref_counts[block] += 1

    def decref(self, block: int) -> None:
        """Drop one holder. At zero the block becomes cached if it has a hash, else free."""
        self._check_id(block)
        if self._ref_counts[block] == 0:
            raise DoubleFreeError(f"block {block} is already free (reference count 0)")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None  # most recently used end
            else:
                self._free.append(block)

    # -- prefix cache index -------------------------------------------------

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding content with this hash, if it is resident."""
        return self._block_of.get(block_hash)

    def block_hash(self, block: int) -> BlockHash | None:
        self._check_id(block)
        return self._hash_of.get(block)

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Record that a held, full block holds the content named by ``block_hash``.

        Returns False (and records nothing) when another block already holds
        that content, or this block is already registered: one hash, one block.
        """
        self._check_id(block)
        if self._ref_counts[block] == 0:
            raise InvalidRequestError(f"block {block} is not held: only held blocks are cached")
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
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
                assert (block in free) != (block in cached), f"block {block} is lost"
            else:
                assert block not in free and block not in cached, f"held block {block} is free"
            if block in cached:
                assert block in self._hash_of, f"cached block {block} has no hash"
        assert self.num_free + self.num_held + self.num_cached == self.num_blocks
        assert len(self._hash_of) == len(self._block_of), "hash index is not one-to-one"
        for block, block_hash in self._hash_of.items():
            assert self._block_of[block_hash] == block, f"hash index broken at block {block}"
        if holders is not None:
            for block in range(self.num_blocks):
                expected = holders.get(block, 0)
                assert self._ref_counts[block] == expected, (
                    f"block {block}: reference count {self._ref_counts[block]}, "
                    f"but {expected} holders"
                )

    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or isinstance(block, bool):
            raise UnknownBlockError(f"block id must be an int, got {block!r}")
        if not 0 <= block < self.num_blocks:
            raise UnknownBlockError(f"block {block} is outside 0..{self.num_blocks - 1}")
