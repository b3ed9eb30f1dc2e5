"""``check_integrity`` is itself tested: each of its checks fires when exactly its invariant breaks.

The stateful tests trust ``check_integrity`` to catch corruption, so a check
that can never fire would hide a bug. Each test builds a healthy state,
passes the check, then pokes private state to break one invariant and
expects that assertion, with its message.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from spec.block_manager import BlockManager
from spec.block_pool import BlockPool


def _first_line(error: AssertionError) -> str:
    """The assertion's own message (pytest may append its explanation on later lines)."""
    return str(error).split("\n")[0]


def _pool() -> BlockPool:
    """Block 0 held, block 1 cached (hash b"h1"), blocks 2 and 3 free."""
    pool = BlockPool(4, 2)
    held, cached = pool.allocate(), pool.allocate()
    pool.register(cached, b"h1")
    pool.decref(cached)
    assert (held, cached) == (0, 1)
    pool.check_integrity({0: 1})
    return pool


def _break_pool(poke: Callable[[BlockPool], None], message: str) -> None:
    pool = _pool()
    poke(pool)
    with pytest.raises(AssertionError) as failed:
        pool.check_integrity({0: 1})
    assert _first_line(failed.value) == message


def test_pool_free_list_duplicate() -> None:
    _break_pool(lambda p: p._free.append(2), "a block appears twice in the free list")


def test_pool_free_and_cached() -> None:
    _break_pool(lambda p: p._free.append(1), "blocks both free and cached: [1]")


def test_pool_negative_reference_count() -> None:
    def poke(p: BlockPool) -> None:
        p._ref_counts[2] = -1

    _break_pool(poke, "block 2 has reference count -1")


def test_pool_lost_block() -> None:
    _break_pool(lambda p: p._free.remove(3), "block 3 is lost")


def test_pool_held_block_in_the_free_list() -> None:
    _break_pool(lambda p: p._free.append(0), "held block 0 is also free or cached")


def test_pool_held_block_in_the_cache() -> None:
    def poke(p: BlockPool) -> None:
        p._evictable[0] = None
        p.register(0, b"h0")

    _break_pool(poke, "held block 0 is also free or cached")


def test_pool_cached_block_without_a_hash() -> None:
    def poke(p: BlockPool) -> None:
        del p._block_of[p._hash_of.pop(1)]

    _break_pool(poke, "cached block 1 has no hash")


def test_pool_free_block_with_a_hash() -> None:
    def poke(p: BlockPool) -> None:
        p._hash_of[2] = b"h2"
        p._block_of[b"h2"] = 2

    _break_pool(poke, "free block 2 has a hash")


def test_pool_counts_do_not_add_up() -> None:
    _break_pool(lambda p: p._free.append(9), "3 free + 1 cached + 1 held != 4 blocks")


def test_pool_hash_index_not_one_to_one() -> None:
    def poke(p: BlockPool) -> None:
        p._block_of[b"stale"] = 1

    _break_pool(poke, "hash index is not one-to-one")


def test_pool_hash_index_broken() -> None:
    def poke(p: BlockPool) -> None:
        p._block_of = {b"other": 1}

    _break_pool(poke, "hash index broken at block 1")


def test_pool_reference_counts_against_holders() -> None:
    pool = _pool()
    for holders, message in [({0: 2}, "2 holders"), ({}, "0 holders")]:
        with pytest.raises(AssertionError) as failed:
            pool.check_integrity(holders)
        assert _first_line(failed.value) == f"block 0: reference count 1, but {message}"
    pool.check_integrity()  # without holders, only the pool's own invariants


# -- the manager ------------------------------------------------------------------------


def _manager() -> BlockManager:
    """Sequence 0: 3 tokens in blocks (0, 1); fork 1 has written a token: copy 1 -> 2 pending."""
    m = BlockManager(6, 2)
    m.add_sequence(0, [])
    m.append_slots(0, [1, 2, 3])
    m.take_copies()
    m.fork(0, 1)
    m.append_slots(1, [4])
    assert m.pending_copies() == ((1, 2),)
    m.check_integrity()
    return m


def _break_manager(poke: Callable[[BlockManager], None], message: str) -> None:
    m = _manager()
    poke(m)
    with pytest.raises(AssertionError) as failed:
        m.check_integrity()
    assert _first_line(failed.value) == message


def test_manager_tokens_against_blocks() -> None:
    _break_manager(lambda m: m._seqs[0].tokens.extend([9, 9]), "sequence 0: 5 tokens in 2 blocks")


def test_manager_aliased_table() -> None:
    def poke(m: BlockManager) -> None:
        m._seqs[0].table[1] = 0

    _break_manager(poke, "sequence 0: aliased table")


def test_manager_hashes_against_full_blocks() -> None:
    _break_manager(lambda m: m._seqs[0].hashes.append(b"x"), "sequence 0: 2 hashes, 1 full blocks")


def test_manager_committed_tokens() -> None:
    def poke(m: BlockManager) -> None:
        m._seqs[0].num_committed = 4

    _break_manager(poke, "sequence 0: 4 of 3 tokens committed")


def test_manager_block_both_source_and_destination() -> None:
    def poke(m: BlockManager) -> None:
        m._copies[1] = 2  # a second copy, 2 -> 1: block 1 is read and written

    _break_manager(poke, "block 2 is src and dst")


def test_manager_copy_into_a_block_nobody_holds() -> None:
    def poke(m: BlockManager) -> None:
        m._copies[5] = 0
        m._pins[0] = 1

    _break_manager(poke, "pending copy into block 5, which nobody holds")


def test_manager_pins_against_pending_copies() -> None:
    def poke(m: BlockManager) -> None:
        m._pins[1] += 1

    _break_manager(poke, "pins {1: 2} do not count the pending copies {1: 1}")


def test_manager_reference_counts_against_tables_and_copies() -> None:
    def poke(m: BlockManager) -> None:
        m.pool.incref(0)

    _break_manager(poke, "block 0: reference count 3, but 2 holders")


def test_manager_pin_is_a_holder() -> None:
    """A pending copy holds its source: forgetting the copy leaves a reference unexplained."""

    def poke(m: BlockManager) -> None:
        m._copies.clear()
        m._pins.clear()

    _break_manager(poke, "block 1: reference count 2, but 1 holders")
