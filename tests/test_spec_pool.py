"""Unit tests of the block pool: states, reference counts, errors that change nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.block_pool import BlockPool
from spec.errors import DoubleFreeError, InvalidRequestError, OutOfBlocksError, UnknownBlockError


def _state(pool: BlockPool) -> tuple[object, ...]:
    refs = tuple(pool.ref_count(b) for b in range(pool.num_blocks))
    return (refs, pool.num_free, pool.num_cached, pool.num_held)


def test_allocate_until_empty_then_error_changes_nothing() -> None:
    pool = BlockPool(3, 4)
    got = [pool.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    before = _state(pool)
    with pytest.raises(OutOfBlocksError, match="all 3 blocks are held"):
        pool.allocate()
    assert _state(pool) == before
    assert pool.num_allocation_failures == 1
    pool.check_integrity({0: 1, 1: 1, 2: 1})


@pytest.mark.parametrize("bad", [-1, 3, 100])
def test_unknown_block_ids(bad: int) -> None:
    pool = BlockPool(3, 4)
    for op in (pool.incref, pool.decref, pool.ref_count):
        with pytest.raises(UnknownBlockError, match=str(bad)):
            op(bad)
    pool.check_integrity({})


def test_double_free_and_sharing_a_free_block() -> None:
    pool = BlockPool(2, 4)
    b = pool.allocate()
    pool.decref(b)
    before = _state(pool)
    with pytest.raises(DoubleFreeError):
        pool.decref(b)
    with pytest.raises(InvalidRequestError, match="is free"):
        pool.incref(b)
    assert _state(pool) == before


def test_cached_block_is_evicted_lru_and_forgotten() -> None:
    pool = BlockPool(2, 4)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, b"A") and pool.register(b, b"B")
    assert not pool.register(a, b"A2"), "one block, one hash"
    pool.decref(a)
    pool.decref(b)  # both cached; a is least recently used
    assert (pool.num_free, pool.num_cached) == (0, 2)
    assert pool.allocate() == a
    assert pool.cached_block(b"A") is None, "an evicted block's hash entry is gone"
    assert pool.cached_block(b"B") == b
    pool.incref(b)  # a hit on a cached block makes it held again
    assert pool.num_cached == 0
    pool.check_integrity({a: 1, b: 1})


def test_invalid_geometry() -> None:
    with pytest.raises(InvalidRequestError, match="num_blocks"):
        BlockPool(0, 16)
    with pytest.raises(InvalidRequestError, match="block_size"):
        BlockPool(4, 0)


@given(st.lists(st.booleans(), max_size=60))
def test_random_allocate_release_keeps_counts(ops: list[bool]) -> None:
    pool = BlockPool(5, 2)
    held: list[int] = []
    for allocate in ops:
        if allocate and pool.num_available:
            held.append(pool.allocate())
        elif held:
            pool.decref(held.pop(0))
        counts: dict[int, int] = {}
        for b in held:
            counts[b] = counts.get(b, 0) + 1
        pool.check_integrity(counts)
    assert pool.num_free + pool.num_held == 5


def test_every_failed_allocation_is_counted() -> None:
    pool = BlockPool(1, 4)
    pool.allocate()
    for expected in (1, 2, 3):
        with pytest.raises(OutOfBlocksError):
            pool.allocate()
        assert pool.num_allocation_failures == expected


def test_unregister_says_whether_there_was_a_hash() -> None:
    pool = BlockPool(2, 4)
    b = pool.allocate()
    assert pool.unregister(b) is False, "nothing to forget"
    assert pool.register(b, b"A")
    assert pool.unregister(b) is True
    assert pool.cached_block(b"A") is None and pool.block_hash(b) is None
    pool.decref(b)
    assert (pool.num_free, pool.num_cached) == (2, 0), "an unregistered block is freed, not cached"
    pool.check_integrity({})


def test_reset_cache_frees_cached_blocks_least_recently_used_first() -> None:
    pool = BlockPool(3, 4)
    blocks = [pool.allocate() for _ in range(3)]
    for b in blocks:
        pool.register(b, bytes([65 + b]))
    for b in (2, 0, 1):
        pool.decref(b)  # cached in the order 2, 0, 1
    pool.reset_cache()
    assert (pool.num_free, pool.num_cached) == (3, 0)
    assert [pool.cached_block(bytes([65 + b])) for b in blocks] == [None, None, None]
    assert [pool.allocate() for _ in range(3)] == [2, 0, 1]
    assert pool.num_evictions == 0, "a reset is not an eviction"
    pool.check_integrity({0: 1, 1: 1, 2: 1})
