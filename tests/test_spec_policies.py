"""The block manager's policies, pinned: not only what it holds, but which block, when, in order.

* blocks are released tail first (the free list and the eviction order see a
  sequence's last block before its first);
* cached blocks are evicted least recently used first;
* no copy-on-write copy is made that is not needed, and a needed one is made once;
* a failed allocation changes nothing and counts one failure;
* a sequence freed before its step is laid out withdraws that step's promises:
  its pending copy, and the cache entries of blocks whose KV was never written.
"""

from __future__ import annotations

import pytest

from spec.block_manager import BlockManager
from spec.block_pool import BlockPool
from spec.errors import OutOfBlocksError
from spec.prefix_cache import prompt_block_hashes


def _laid_out(m: BlockManager, seq: int, tokens: list[int]) -> None:
    """Start ``seq`` with ``tokens`` and lay out its step (as ``build_batch`` would)."""
    cached = m.add_sequence(seq, tokens)
    m.append_slots(seq, tokens[cached:])
    m.take_copies()


# -- release order -------------------------------------------------------------------


def test_blocks_are_released_tail_first() -> None:
    m = BlockManager(3, 2)
    _laid_out(m, 0, [1, 2, 3, 4, 5])
    assert m.block_table(0) == (0, 1, 2)
    m.free(0)
    assert [m.pool.allocate() for _ in range(3)] == [2, 1, 0], "the last block is freed first"


def test_cached_chain_is_evicted_from_its_tail() -> None:
    """The tail is evicted first, so what stays cached is still a usable prefix."""
    m = BlockManager(3, 2, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6]
    _laid_out(m, 0, prompt)
    m.free(0)
    assert m.pool.num_cached == 3
    assert m.pool.allocate() == 2, "the chain's last block goes first"
    assert m.cached_prefix([*prompt, 7]) == 4, "blocks 0 and 1 still hit"


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    m = BlockManager(6, 2, enable_prefix_caching=True)
    for seq, prompt in enumerate([[1, 1, 0], [2, 2, 0], [3, 3, 0]]):
        _laid_out(m, seq, prompt)
    for seq in (0, 1, 2):
        m.free(seq)  # cached in the order 0, 1, 2 (their partial blocks are free)
    hashes = [prompt_block_hashes(p, 2)[0] for p in ([1, 1], [2, 2], [3, 3])]
    _laid_out(m, 3, [1, 1, 9])  # a hit on the first: it becomes the most recently used
    m.free(3)
    while m.pool.num_free:
        m.pool.allocate()
    m.pool.allocate()  # evicts the least recently used: the [2, 2] block
    cached = [m.pool.cached_block(h) is not None for h in hashes]
    assert cached == [True, False, True]
    assert m.pool.num_evictions == 1


# -- copy-on-write only when needed ---------------------------------------------------


def _shared(num_forks: int, tokens: list[int], block_size: int = 4) -> BlockManager:
    m = BlockManager(16, block_size)
    _laid_out(m, 0, tokens)
    for child in range(1, num_forks + 1):
        m.fork(0, child)
    return m


def test_every_writer_but_the_last_copies() -> None:
    m = _shared(2, [1, 2])  # three tables hold block 0
    m.append_slots(1, [3])
    m.append_slots(2, [3])
    assert m.blocks_needed(0, 1) == 0, "the last writer needs no block"
    m.append_slots(0, [3])
    assert m.pending_copies() == ((0, 1), (0, 2))
    assert [m.block_table(s) for s in (0, 1, 2)] == [(0,), (1,), (2,)]
    m.check_integrity()


def test_a_full_last_block_needs_no_copy() -> None:
    m = _shared(1, [1, 2, 3, 4])
    assert m.blocks_needed(1, 1) == 1, "one new block, no copy"
    m.append_slots(1, [5])
    assert m.pending_copies() == ()
    assert m.block_table(1) == (0, 1) and m.block_table(0) == (0,)
    assert m.pool.ref_count(0) == 2, "the full block stays shared"


def test_no_copy_for_no_tokens_or_an_unshared_block() -> None:
    m = _shared(1, [1, 2])
    assert m.blocks_needed(1, 0) == 0
    assert m.append_slots(1, []) == [] and m.pending_copies() == ()
    m.free(1)
    assert m.blocks_needed(0, 1) == 0
    assert m.append_slots(0, [3]) == [2] and m.pending_copies() == ()


def test_a_copy_is_made_once_per_writer() -> None:
    """After its copy the writer owns its block: its next append, now or later, is in place."""
    m = _shared(1, [1, 2])
    m.append_slots(1, [3])
    m.append_slots(1, [4])
    assert m.pending_copies() == ((0, 1),)
    assert m.take_copies() == [(0, 1)]
    assert m.pool.ref_count(0) == 1, "the copy's pin on its source is released"
    m.append_slots(1, [5])
    assert m.pending_copies() == ()


def test_copy_and_growth_are_one_allocation_check() -> None:
    """A shared partial block that fills and overflows needs a copy and a new block, or neither."""
    m = BlockManager(2, 2)
    _laid_out(m, 0, [1])
    m.fork(0, 1)
    assert m.blocks_needed(1, 2) == 2 and m.pool.num_available == 1
    before = (m.block_table(1), m.tokens(1), m.pool.num_free, m.pending_copies())
    with pytest.raises(
        OutOfBlocksError, match=r"sequence 1 needs 2 blocks for 2 tokens, 1 available"
    ):
        m.append_slots(1, [2, 3])
    assert (m.block_table(1), m.tokens(1), m.pool.num_free, m.pending_copies()) == before
    assert m.pool.num_allocation_failures == 1, "one failure, counted once"


def test_take_copies_keeps_the_order_the_copies_were_made() -> None:
    m = BlockManager(16, 2)
    for parent in (0, 1, 2):
        _laid_out(m, parent, [parent])
    for parent in (0, 1, 2):
        m.fork(parent, 10 + parent)
    for writer in (12, 10, 11):
        m.append_slots(writer, [7])
    m.free(10)  # its copy is dropped; the others keep their order
    m.append_slots(0, [7])  # block 0 is no longer shared: in place
    assert m.take_copies() == [(2, 3), (1, 5)]


# -- failed allocations ----------------------------------------------------------------


def test_a_failed_pool_allocation_counts_once_and_changes_nothing() -> None:
    pool = BlockPool(1, 2)
    pool.allocate()
    with pytest.raises(OutOfBlocksError):
        pool.allocate()
    assert (pool.num_allocation_failures, pool.num_free, pool.num_held, pool.ref_count(0)) == (
        1,
        0,
        1,
        1,
    )


# -- a pending copy pins its source; a free withdraws the step's promises ---------------


def test_a_pending_copy_keeps_its_source_until_taken() -> None:
    m = _shared(1, [1, 2])
    m.append_slots(1, [3])  # copy 0 -> 1 pending
    m.free(0)
    assert m.pool.ref_count(0) == 1 and m.pool.num_free == 14, "block 0 is not reusable yet"
    m.check_integrity()  # the pin is block 0's only holder
    assert m.take_copies() == [(0, 1)]
    assert m.pool.ref_count(0) == 0 and m.pool.num_free == 15


def test_freeing_the_writer_drops_its_copy_and_releases_the_pin() -> None:
    m = _shared(1, [1, 2])
    m.append_slots(1, [3])
    m.free(1)
    assert m.pending_copies() == () and m.pool.ref_count(0) == 1
    assert m.pool.num_free == 15
    m.check_integrity()


def test_a_sequence_freed_before_its_step_leaves_no_cache_entry() -> None:
    """Its full blocks were hashed when they filled, but their KV will never be written."""
    m = BlockManager(4, 2, enable_prefix_caching=True)
    m.add_sequence(0, [1, 2, 3])
    m.append_slots(0, [1, 2, 3])
    assert m.cached_prefix([1, 2, 9]) == 2, "a same-step hit is allowed: the step writes it"
    m.free(0)  # ... but the step is never laid out
    assert (m.pool.num_cached, m.pool.num_free) == (0, 4)
    assert m.cached_prefix([1, 2, 9]) == 0
    m.check_integrity()


def test_a_copy_that_a_same_step_hit_reads_is_kept() -> None:
    """The copy's destination is shared by a same-step prefix hit: the copy must still run."""
    m = BlockManager(8, 4, enable_prefix_caching=True)
    _laid_out(m, 0, [1, 2, 3])
    m.fork(0, 1)
    m.append_slots(1, [4])  # copy 0 -> 1; block 1 is now full and cached
    assert m.add_sequence(2, [1, 2, 3, 4, 5]) == 4 and m.block_table(2) == (1,)
    m.free(1)
    assert m.pending_copies() == ((0, 1),)
    assert m.cached_prefix([1, 2, 3, 4, 5]) == 4
    m.check_integrity()


def test_a_block_the_last_writer_filled_in_place_is_not_cached_if_freed_mid_step() -> None:
    """The last writer's block is still pinned by another writer's copy; freed, it must not be
    cached with a token whose KV was never written."""
    m = BlockManager(8, 2, enable_prefix_caching=True)
    _laid_out(m, 0, [1])
    m.fork(0, 1)
    m.append_slots(1, [2])  # copy 0 -> 1
    m.append_slots(0, [3])  # in place: block 0 is full, its hash names [1, 3]
    assert m.cached_prefix([1, 3, 5]) == 2
    m.free(0)
    assert m.cached_prefix([1, 3, 5]) == 0
    m.take_copies()
    assert m.pool.block_hash(0) is None and m.pool.ref_count(0) == 0 and m.pool.num_cached == 0
    assert m.cached_prefix([1, 2, 5]) == 2, "block 1, which the step writes, stays findable"
    m.check_integrity()


# -- the paging formula, the capacity check, prefix statistics ----------------------------


def test_slot_is_the_slot_append_slots_gave() -> None:
    """Over a shuffled pool and through a copy-on-write, position by position."""
    m = BlockManager(12, 4)
    taken = [m.pool.allocate() for _ in range(12)]
    for b in (7, 2, 9, 4, 11, 0, 5, 1, 3, 6, 8, 10):
        m.pool.decref(taken[b])  # the free list now starts 7, 2, 9, ...
    m.add_sequence(0, [])
    slots = m.append_slots(0, list(range(10)))
    m.take_copies()
    m.fork(0, 1)
    new = m.append_slots(1, [10, 11, 12])  # positions 10, 11 in a copy of the last block; 12 beyond
    copy = new[0] - 2  # the copy's first slot: positions 8 and 9 moved there with it
    child = [*slots[:8], copy, copy + 1, *new]
    for seq, expected in ((0, slots), (1, child)):
        got = [m.slot(seq, p) for p in range(m.num_tokens(seq))]
        assert got == expected and all(type(s) is int for s in got)
    assert m.slot(1, 9) != m.slot(0, 9), "the copied block moved position 9 of the fork"
    assert m.slot(1, 0) == m.slot(0, 0) == 7 * 4, "the shared first block did not move"


def test_can_append_up_to_exactly_the_available_blocks() -> None:
    m = BlockManager(3, 2)
    m.add_sequence(0, [])
    assert m.blocks_needed(0, 6) == 3 == m.pool.num_available
    assert m.can_append(0, 6) and not m.can_append(0, 7)


def test_failed_appends_are_each_counted() -> None:
    m = BlockManager(1, 2)
    m.add_sequence(0, [])
    for expected in (1, 2):
        with pytest.raises(OutOfBlocksError):
            m.append_slots(0, [1, 2, 3])
        assert m.pool.num_allocation_failures == expected


def test_a_hit_continues_the_chain_of_hashes() -> None:
    """Blocks a sequence fills after its cached prefix are named after that prefix, so they hit."""
    m = BlockManager(8, 2, enable_prefix_caching=True)
    _laid_out(m, 0, [1, 2, 3])
    assert m.add_sequence(1, [1, 2, 5]) == 2
    m.append_slots(1, [5, 6, 7])
    m.take_copies()
    assert m.cached_prefix([1, 2, 5, 6, 9]) == 4


def test_prefix_statistics_add_up_and_count_only_with_caching_on() -> None:
    m = BlockManager(8, 2, enable_prefix_caching=True)
    _laid_out(m, 0, [1, 2, 3])
    _laid_out(m, 1, [1, 2, 4])
    _laid_out(m, 2, [1, 2, 5])
    assert (m.prefix_stats.queried_tokens, m.prefix_stats.hit_tokens) == (9, 4)
    off = BlockManager(8, 2)
    _laid_out(off, 0, [1, 2, 3])
    _laid_out(off, 1, [1, 2, 4])
    assert (off.prefix_stats.queried_tokens, off.prefix_stats.hit_tokens) == (0, 0)
    assert off.prefix_stats.hit_rate == 0.0
