"""Bad input to the block pool, the block manager and prefix hashing: the known bugs, pinned.

Each test below reproduced a bug before it was fixed: copy-on-write skipped by
a truthiness test on a numpy array, a table grown by a call that then raised,
float token ids hashed as their ``int()``, bools, floats and strings taken for
ids. Each now expects a specific error that names the argument, the value and
what was expected, and a state that did not change.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from spec.block_manager import BlockManager
from spec.block_pool import BlockPool
from spec.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    BlockStateError,
    DuplicateSequenceError,
    InvalidRequestError,
    StepBoundaryError,
    UnknownBlockError,
    UnknownSequenceError,
)
from spec.prefix_cache import block_hash, prompt_block_hashes


def _state(m: BlockManager) -> tuple[object, ...]:
    seqs = tuple((s, m.block_table(s), m.tokens(s)) for s in sorted(m.sequence_ids()))
    refs = tuple(m.pool.ref_count(b) for b in range(m.pool.num_blocks))
    hashes = tuple(m.pool.block_hash(b) for b in range(m.pool.num_blocks))
    stats = (m.prefix_stats.queried_tokens, m.prefix_stats.hit_tokens)
    return (seqs, refs, hashes, m.pool.num_free, m.pool.num_cached, stats, m.pending_copies())


def _forked(block_size: int = 4) -> BlockManager:
    """Sequence 0 with 2 tokens in a partly filled block, laid out, and fork 1 sharing it."""
    m = BlockManager(8, block_size)
    m.add_sequence(0, [])
    m.append_slots(0, [1, 2])
    m.take_copies()
    m.fork(0, 1)
    return m


# -- the known bugs -------------------------------------------------------------------


def test_numpy_token_zero_still_copies_on_write() -> None:
    """``np.array([0])`` is falsy: the old truthiness test skipped the copy, and two forks
    wrote into the same shared slot while ``check_integrity`` passed."""
    m = _forked()
    zero: Any = np.array([0])  # both beams sample token 0
    child_slot = m.append_slots(1, zero)
    parent_slot = m.append_slots(0, zero)
    assert child_slot != parent_slot, "two forks were given the same slot"
    assert m.pending_copies() == ((0, 1),)
    assert m.block_table(0) == (0,) and m.block_table(1) == (1,)
    m.check_integrity()


def test_non_int_token_ids_do_not_grow_the_table() -> None:
    """The old ``append_slots`` allocated the blocks, then failed hashing ``'a'``."""
    m = BlockManager(8, 2, enable_prefix_caching=True)
    m.add_sequence(0, [])
    before = _state(m)
    with pytest.raises(ArgumentTypeError, match=r"token_ids\[1\] must be a token id .* str 'a'"):
        m.append_slots(0, [1, "a", 3])  # type: ignore[list-item]
    assert _state(m) == before
    m.check_integrity()


def test_float_token_ids_cannot_hit_another_prompts_blocks() -> None:
    """Hashing ``int(t)`` made a prompt of ``1.5, 2.5, ...`` hit the prompt ``1, 2, ...``."""
    m = BlockManager(8, 2, enable_prefix_caching=True)
    m.add_sequence(0, [1, 2, 3])
    m.append_slots(0, [1, 2, 3])
    m.take_copies()
    with pytest.raises(ArgumentTypeError, match=r"prompt\[0\] must be a token id .* float 1.5"):
        m.cached_prefix([1.5, 2.5, 3.5])  # type: ignore[list-item]
    with pytest.raises(ArgumentTypeError, match=r"prompt\[0\]"):
        m.add_sequence(1, [1.0, 2.0, 3.0])  # type: ignore[list-item]
    with pytest.raises(ArgumentTypeError, match=r"token_ids\[1\]"):
        block_hash(None, [1, 2.0])  # type: ignore[list-item]
    with pytest.raises(ArgumentTypeError, match=r"token_ids\[0\]"):
        prompt_block_hashes(np.array([1.0, 2.0]), 2)  # type: ignore[arg-type]
    assert m.sequence_ids() == [0]


def test_numpy_integers_are_token_ids() -> None:
    """A numpy integer names the same token: same hashes, same hits."""
    tokens: Any = np.array([1, 2, 3], dtype=np.int32)
    zero: Any = np.int64(0)
    assert block_hash(None, tokens[:2]) == block_hash(None, [1, 2])
    m = BlockManager(8, 2, enable_prefix_caching=True)
    m.add_sequence(zero, [1, 2, 3])
    m.append_slots(np.int32(0), tokens)  # type: ignore[arg-type]
    assert m.cached_prefix(np.array([1, 2, 9])) == 2  # type: ignore[arg-type]
    assert m.tokens(0) == (1, 2, 3) and all(type(t) is int for t in m.tokens(0))
    assert np.int64(0) in m and m.sequence_ids() == [0]


@pytest.mark.parametrize(
    "bad, error, text",
    [
        (True, ArgumentTypeError, "bool True"),
        (np.True_, ArgumentTypeError, "bool np.True_"),
        (2.0, ArgumentTypeError, "float 2.0"),
        ("3", ArgumentTypeError, "str '3'"),
        (None, ArgumentTypeError, "NoneType None"),
        (-1, ArgumentValueError, "must be a token id >= 0, got -1"),
        ([1], ArgumentTypeError, "list [1]"),
    ],
)
def test_bad_token_ids_are_refused_everywhere(bad: Any, error: type, text: str) -> None:
    m = BlockManager(8, 2, enable_prefix_caching=True)
    m.add_sequence(0, [1])
    before = _state(m)
    calls: dict[str, list[Callable[[], object]]] = {
        "prompt": [lambda: m.add_sequence(1, [1, bad]), lambda: m.cached_prefix([1, bad])],
        "token_ids": [
            lambda: m.append_slots(0, [1, bad]),
            lambda: block_hash(None, [1, bad]),
            lambda: prompt_block_hashes([1, bad], 2),
        ],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(error, match=rf"{name}\[1\] .*{re.escape(text)}"):
                fn()
    assert _state(m) == before


@pytest.mark.parametrize(
    "bad, error",
    [
        (True, ArgumentTypeError),
        (np.False_, ArgumentTypeError),
        (1.0, ArgumentTypeError),
        ("0", ArgumentTypeError),
        (None, ArgumentTypeError),
        ((0,), ArgumentTypeError),
        (-1, ArgumentValueError),
    ],
)
def test_bad_sequence_ids_are_refused_everywhere(bad: Any, error: type) -> None:
    """A sequence id is an int >= 0: ``True`` is not sequence 1, ``'0'`` is not sequence 0."""
    m = _forked()
    before = _state(m)
    calls: dict[str, list[Callable[[], object]]] = {
        "seq_id": [
            lambda: m.add_sequence(bad, [1]),
            lambda: m.append_slots(bad, [1]),
            lambda: m.free(bad),
            lambda: m.block_table(bad),
            lambda: m.num_tokens(bad),
            lambda: m.tokens(bad),
            lambda: m.slot(bad, 0),
            lambda: m.tail_waste(bad),
            lambda: m.blocks_needed(bad, 1),
            lambda: m.can_append(bad, 1),
        ],
        "parent_id": [lambda: m.fork(bad, 5)],
        "child_id": [lambda: m.fork(0, bad)],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(error, match=rf"^{name} must be"):
                fn()
    assert bad not in m
    assert _state(m) == before


def test_unknown_and_duplicate_sequences_name_the_argument() -> None:
    m = _forked()
    before = _state(m)
    with pytest.raises(UnknownSequenceError, match=r"seq_id must name a sequence .* got 7"):
        m.free(7)
    with pytest.raises(UnknownSequenceError, match=r"parent_id must name a sequence .* got 7"):
        m.fork(7, 8)
    with pytest.raises(DuplicateSequenceError, match=r"child_id must be a new sequence id, got 0"):
        m.fork(1, 0)
    with pytest.raises(DuplicateSequenceError, match=r"seq_id must be a new sequence id, got 1"):
        m.add_sequence(1, [])
    assert _state(m) == before


def test_forking_mid_step_names_the_parent() -> None:
    m = _forked()
    m.append_slots(0, [3])
    before = _state(m)
    with pytest.raises(StepBoundaryError, match=r"parent_id .* sequence 0, which has 1 tokens"):
        m.fork(0, 2)
    assert _state(m) == before


@pytest.mark.parametrize(
    "bad, error",
    [(True, ArgumentTypeError), (1.0, ArgumentTypeError), ("1", ArgumentTypeError), (-1, None)],
)
def test_counts_and_positions(bad: object, error: type | None) -> None:
    m = _forked()
    before = _state(m)
    with pytest.raises(error or ArgumentValueError, match=r"^num_new_tokens must be"):
        m.blocks_needed(0, bad)  # type: ignore[arg-type]
    with pytest.raises(error or ArgumentValueError, match=r"^position must be"):
        m.slot(0, bad)  # type: ignore[arg-type]
    with pytest.raises(ArgumentValueError, match=r"^position must be in 0\.\.1 .* got 2"):
        m.slot(0, 2)
    assert _state(m) == before


@pytest.mark.parametrize(
    "bad, error",
    [
        ("lora", ArgumentTypeError),  # a string is one key, not a list of characters
        (5, ArgumentTypeError),
        (None, ArgumentTypeError),
        ([["unhashable"]], ArgumentTypeError),
    ],
)
def test_bad_extra_keys(bad: object, error: type) -> None:
    m = BlockManager(8, 2, enable_prefix_caching=True)
    before = _state(m)
    for fn in (
        lambda: m.add_sequence(0, [1], extra_keys=bad),  # type: ignore[arg-type]
        lambda: m.cached_prefix([1], bad),  # type: ignore[arg-type]
        lambda: block_hash(None, [1], bad),  # type: ignore[arg-type]
        lambda: prompt_block_hashes([1], 1, bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(error, match=r"^extra_keys"):
            fn()
    assert _state(m) == before


def test_bad_parent_hash_and_block_size() -> None:
    with pytest.raises(ArgumentValueError, match=r"parent must be a non-empty block hash"):
        block_hash(b"", [1])  # b"" would read as "no parent"
    with pytest.raises(ArgumentTypeError, match=r"parent must be bytes"):
        block_hash("abc", [1])  # type: ignore[arg-type]
    for bad, error in [
        (0, ArgumentValueError),
        (2.0, ArgumentTypeError),
        (True, ArgumentTypeError),
    ]:
        with pytest.raises(error, match=r"^block_size must be"):
            prompt_block_hashes([1, 2], bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "sequence",
    ["123", b"\x01", {1, 2}, 5, np.array([[1, 2]]), np.array(3), (t for t in [1])],
    ids=["str", "bytes", "set", "int", "2-D array", "0-D array", "generator"],
)
def test_token_ids_must_be_a_one_dimensional_sequence(sequence: object) -> None:
    m = BlockManager(8, 2)
    m.add_sequence(0, [])
    before = _state(m)
    with pytest.raises(ArgumentTypeError, match=r"^token_ids must be"):
        m.append_slots(0, sequence)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match=r"^prompt must be"):
        m.add_sequence(1, sequence)  # type: ignore[arg-type]
    assert _state(m) == before


def test_manager_and_pool_geometry() -> None:
    with pytest.raises(ArgumentTypeError, match=r"^enable_prefix_caching must be a bool, got str"):
        BlockManager(4, 4, enable_prefix_caching="no")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match=r"^num_blocks must be an int, got float 4.0"):
        BlockManager(4.0, 4)  # type: ignore[arg-type]
    with pytest.raises(ArgumentValueError, match=r"^block_size must be >= 1, got 0"):
        BlockPool(4, 0)
    with pytest.raises(ArgumentTypeError, match=r"^block_size must be an int, got bool True"):
        BlockPool(4, True)


# -- the block pool --------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, error, text",
    [
        (True, ArgumentTypeError, "block must be an int, got bool True"),
        (1.0, ArgumentTypeError, "block must be an int, got float 1.0"),
        ("1", ArgumentTypeError, "block must be an int, got str '1'"),
        (-1, UnknownBlockError, r"block must be a block id in 0\.\.2, got -1"),
        (3, UnknownBlockError, r"block must be a block id in 0\.\.2, got 3"),
    ],
)
def test_pool_block_ids(bad: Any, error: type, text: str) -> None:
    pool = BlockPool(3, 4)
    pool.allocate()
    for op in (pool.incref, pool.decref, pool.ref_count, pool.block_hash, pool.unregister):
        with pytest.raises(error, match=f"^{text}$"):
            op(bad)
    with pytest.raises(error, match=f"^{text}$"):
        pool.register(bad, b"h")
    assert (pool.ref_count(0), pool.num_free, pool.num_cached) == (1, 2, 0)
    pool.check_integrity({0: 1})


def test_pool_hash_arguments_and_block_states() -> None:
    pool = BlockPool(3, 4)
    b = pool.allocate()
    with pytest.raises(ArgumentTypeError, match=r"^block_hash must be bytes"):
        pool.register(b, "h")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match=r"^block_hash must be bytes"):
        pool.cached_block(bytearray(b"h"))  # type: ignore[arg-type]
    with pytest.raises(ArgumentValueError, match=r"^block_hash must be a non-empty"):
        pool.cached_block(b"")
    with pytest.raises(BlockStateError, match=r"block 1 is free: allocate it"):
        pool.incref(1)
    with pytest.raises(BlockStateError, match=r"block 1 is not held"):
        pool.register(1, b"h")
    with pytest.raises(BlockStateError, match=r"block 1 is not held"):
        pool.unregister(1)
    assert isinstance(BlockStateError("x"), InvalidRequestError), "old callers still catch it"
    pool.check_integrity({b: 1})
