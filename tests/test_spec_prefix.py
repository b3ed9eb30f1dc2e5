"""Prefix caching through the block manager: hits, the last-token rule, extra keys, eviction."""

from __future__ import annotations

import pytest

from spec.block_manager import BlockManager
from spec.errors import InvalidRequestError
from spec.prefix_cache import prompt_block_hashes


def _run(m: BlockManager, seq: int, prompt: list[int], extra: tuple[str, ...] = ()) -> int:
    cached = m.add_sequence(seq, prompt, extra_keys=extra)
    m.append_slots(seq, prompt[cached:])
    return cached


def test_second_prompt_reuses_full_blocks_and_counts_hits() -> None:
    m = BlockManager(8, 4, enable_prefix_caching=True)
    assert _run(m, 0, list(range(10))) == 0
    assert _run(m, 1, [*range(8), 42, 43]) == 8  # two full blocks shared
    assert m.block_table(1)[:2] == m.block_table(0)[:2]
    assert m.block_table(1)[2] != m.block_table(0)[2]
    assert m.prefix_stats.hit_tokens == 8 and m.prefix_stats.queried_tokens == 20
    assert m.prefix_stats.hit_rate == 0.4
    m.check_integrity()


def test_at_least_one_prompt_token_is_recomputed() -> None:
    m = BlockManager(8, 4, enable_prefix_caching=True)
    _run(m, 0, list(range(8)))
    assert _run(m, 1, list(range(8))) == 4, "an exact 2-block prompt may reuse only 1 block"
    assert m.num_tokens(1) == 8


def test_extra_keys_separate_equal_tokens() -> None:
    m = BlockManager(8, 4, enable_prefix_caching=True)
    _run(m, 0, list(range(9)), extra=("adapter-a",))
    assert _run(m, 1, list(range(9)), extra=("adapter-b",)) == 0
    assert _run(m, 2, list(range(9)), extra=("adapter-a",)) == 8


def test_freed_prefix_stays_cached_until_evicted() -> None:
    m = BlockManager(3, 4, enable_prefix_caching=True)
    _run(m, 0, list(range(9)))  # 3 blocks: 2 full (cached) + 1 partial
    m.take_copies()  # the step that writes them is laid out
    m.free(0)
    assert (m.pool.num_cached, m.pool.num_free) == (2, 1)
    assert _run(m, 1, list(range(9))) == 8, "a freed but cached prefix still hits"
    m.take_copies()
    m.free(1)
    _run(m, 2, [7] * 12)  # needs every block: evicts both cached blocks
    assert m.pool.num_cached == 0 and m.pool.num_evictions == 2
    m.free(2)
    assert m.cached_prefix(list(range(9))) == 0, "evicted content can never hit"
    m.check_integrity()


def test_partial_blocks_are_never_shared() -> None:
    m = BlockManager(8, 4, enable_prefix_caching=True)
    _run(m, 0, list(range(6)))
    assert _run(m, 1, list(range(6))) == 4
    assert m.block_table(0)[1] != m.block_table(1)[1]


def test_disabled_cache_never_hits() -> None:
    m = BlockManager(8, 4)
    _run(m, 0, list(range(9)))
    assert _run(m, 1, list(range(9))) == 0
    assert m.pool.num_cached == 0


def test_last_writer_of_a_shared_block_writes_in_place() -> None:
    """Two forks write in one step: the first copies, the second owns the original."""
    m = BlockManager(8, 4)
    _run(m, 0, [1, 2])
    m.take_copies()  # the prompt's step is laid out
    m.fork(0, 1)
    m.append_slots(1, [3])
    m.append_slots(0, [4])
    assert m.take_copies() == [(0, 1)]
    assert m.block_table(0) == (0,) and m.block_table(1) == (1,)
    m.check_integrity()


def test_fork_waits_for_the_step_that_writes_the_parent() -> None:
    """A copy runs before its step's writes, so a mid-step fork would copy unwritten slots."""
    m = BlockManager(8, 4)
    _run(m, 0, [1, 2])
    with pytest.raises(InvalidRequestError, match="2 tokens appended in the current step"):
        m.fork(0, 1)
    assert m.sequence_ids() == [0]
    m.take_copies()
    m.fork(0, 1)
    m.check_integrity()


def test_freeing_a_sequence_drops_its_pending_copy() -> None:
    """A freed writer's copy is never executed, and its destination cannot be doubly targeted."""
    m = BlockManager(4, 4)
    _run(m, 0, [1, 2])
    m.take_copies()
    m.fork(0, 1)
    m.append_slots(0, [3])  # copy (0 -> 1) pending for sequence 0
    m.free(0)
    m.check_integrity()
    m.fork(1, 2)
    m.append_slots(2, [4])  # may reuse block 1 as a destination: only one copy targets it
    copies = m.take_copies()
    assert len({dst for _, dst in copies}) == len(copies) == 1
    m.check_integrity()


def test_numpy_token_ids_name_the_same_blocks() -> None:
    import numpy as np

    m = BlockManager(8, 4, enable_prefix_caching=True)
    _run(m, 0, list(range(9)))
    assert m.cached_prefix([np.int64(t) for t in range(9)]) == 8  # type: ignore[misc]


def test_caching_off_never_consults_the_pools_index() -> None:
    """Off means off: even a hash registered straight into the pool is never looked up."""
    m = BlockManager(8, 4)
    _run(m, 0, list(range(9)))
    m.pool.register(m.block_table(0)[0], prompt_block_hashes(list(range(4)), 4)[0])
    assert m.cached_prefix(list(range(9))) == 0
    assert m.add_sequence(1, list(range(9))) == 0
