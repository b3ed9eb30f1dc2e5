"""Invalid calls, at random, against every public operation of the pool, the manager, prefix hashing
and the KV budget: the specific error, a message that starts with the offending argument's name,
and a state that did not change.

Each example builds a random *valid* state first (sequences added, grown, forked, freed, steps
laid out or left with copies pending), then makes one invalid call drawn from a catalogue: a
wrong type (bool, float, str, None, numpy bool, nested lists, 2-D arrays), an out-of-range id,
an unknown, freed or duplicate sequence, a double free, a fork in mid-step, an allocation that
cannot be met. The state is compared before and after: every table, token and reference count,
every block's hash, the free and cached counts (and the order of the free list and of the LRU
queue), the prefix statistics and the pending copies. A failed allocation may change one thing,
the failure count, by one. Afterwards the manager must still work: freeing everything leaks
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from spec import kv_budget
from spec.block_manager import BlockManager
from spec.block_pool import BlockPool
from spec.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    BlockStateError,
    DoubleFreeError,
    DuplicateSequenceError,
    OutOfBlocksError,
    SpecError,
    StepBoundaryError,
    UnknownBlockError,
    UnknownSequenceError,
)
from spec.prefix_cache import block_hash, prompt_block_hashes

EXAMPLES = settings(max_examples=5 * settings().max_examples)
"""Each example is a millisecond: five times the profile's count (150 under ``ci``)."""

VOCAB = st.integers(0, 2)
T, V = ArgumentTypeError, ArgumentValueError

_NOT_NUMBERS = [b"1", [1], (0,), [[1]], np.array([1]), np.array(1), np.array([[1]]), 1j, {1}]
_NOT_INTEGERS = [True, False, np.True_, np.False_, 1.0, 0.0, np.float64(2.0), float("nan"), "1"]
NOT_INTS = st.sampled_from([*_NOT_INTEGERS, "", None, *_NOT_NUMBERS])
"""Values that are not ids: each must raise :class:`ArgumentTypeError`."""


def bad_ids(low: int = 0) -> st.SearchStrategy[tuple[object, type[SpecError]]]:
    """A value that is not an int, or an int below ``low``: with the error it must raise."""
    return st.one_of(
        NOT_INTS.map(lambda v: (v, T)),
        st.integers(max_value=low - 1).map(lambda v: (v, V)),
    )


def bad_token_lists() -> st.SearchStrategy[tuple[object, type[SpecError]]]:
    """A sequence of token ids with one bad element, or something that is not such a sequence."""
    element = bad_ids()
    in_list = st.tuples(st.lists(VOCAB, max_size=4), element, st.integers(0, 4), st.booleans())
    spliced = in_list.map(
        lambda t: (
            (tuple if t[3] else list)([*t[0][: t[2]], t[1][0], *t[0][t[2] :]]),
            t[1][1],
        )
    )
    containers = st.sampled_from(["12", b"12", {1, 2}, 5, None, {1: 2}, 1.5, frozenset([1])])
    arrays = st.sampled_from(
        [
            (np.array([1.0]), T),
            (np.array([True, False]), T),
            (np.array([2, -1]), V),
            (np.array(["1"]), T),
            (np.array([[1, 2]]), T),
            (np.array(3), T),
        ]
    )
    return st.one_of(spliced, containers.map(lambda v: (v, T)), arrays)


BAD_KEYS: st.SearchStrategy[Any] = st.sampled_from(
    ["lora", b"x", 5, None, [[1]], ({1},), {"a": 1}, np.array([1])]
)
BAD_HASHES = st.sampled_from(
    [("h", T), (bytearray(b"h"), T), (memoryview(b"h"), T), (None, T), (5, T), (b"", V)]
)


# -- a random valid state -----------------------------------------------------------------


@dataclass
class World:
    m: BlockManager
    next_id: int
    freed: list[int]


@st.composite
def worlds(draw: st.DrawFn) -> World:
    """A manager after a random run of valid operations (the last step maybe not laid out)."""
    m = BlockManager(
        draw(st.integers(1, 10)),
        draw(st.sampled_from([1, 2, 4])),
        enable_prefix_caching=draw(st.booleans()),
    )
    w = World(m, 0, [])
    ops = ["add", "append", "fork", "fork-write", "free", "step", "reset"]
    for op in draw(st.lists(st.sampled_from(ops), max_size=14)):
        live = m.sequence_ids()
        if op == "add":
            prompt = draw(st.lists(VOCAB, max_size=9))
            cached = m.add_sequence(w.next_id, prompt)
            if m.can_append(w.next_id, len(prompt) - cached):
                m.append_slots(w.next_id, prompt[cached:])
            w.next_id += 1
        elif op == "step":
            m.take_copies()
        elif op == "reset":
            m.reset_prefix_cache()
        elif live:
            seq = draw(st.sampled_from(live))
            if op == "append":
                new = draw(st.lists(VOCAB, min_size=1, max_size=4))
                if m.can_append(seq, len(new)):
                    m.append_slots(seq, new)
            elif op == "free":
                m.free(seq)
                w.freed.append(seq)
            elif _committed(m, seq):
                m.fork(seq, w.next_id)
                if op == "fork-write" and m.can_append(w.next_id, 1):
                    m.append_slots(w.next_id, [draw(VOCAB)])
                w.next_id += 1
    m.check_integrity()
    return w


def _committed(m: BlockManager, seq: int) -> bool:
    """No token of ``seq`` waits for the step's layout (private: only tests need to know)."""
    s = m._seqs[seq]
    return s.num_committed == len(s.tokens)


def snapshot(m: BlockManager) -> tuple[object, ...]:
    """Everything a failed call must leave as it was."""
    pool = m.pool
    seqs = tuple(
        (s, m.block_table(s), m.tokens(s), m._seqs[s].num_committed) for s in m.sequence_ids()
    )
    blocks = tuple((pool.ref_count(b), pool.block_hash(b)) for b in range(pool.num_blocks))
    counts = (pool.num_free, pool.num_cached, pool.num_held, pool.num_evictions)
    order = (tuple(pool._free), tuple(pool._evictable))  # a failed call must not reorder them
    stats = (m.prefix_stats.queried_tokens, m.prefix_stats.hit_tokens)
    return (seqs, blocks, counts, order, stats, m.pending_copies(), pool.num_allocation_failures)


# -- the catalogue of invalid calls ----------------------------------------------------------


@dataclass(frozen=True)
class Case:
    call: Callable[[], object]
    error: type[SpecError]
    name: str  # the message starts with it: the offending argument


Template = Callable[[World, st.DataObject], "Case | None"]


def _seq_query(m: BlockManager, seq: object) -> list[Callable[[], object]]:
    """Every operation that takes an existing sequence as ``seq_id``."""
    return [
        lambda: m.block_table(seq),  # type: ignore[arg-type]
        lambda: m.num_tokens(seq),  # type: ignore[arg-type]
        lambda: m.tokens(seq),  # type: ignore[arg-type]
        lambda: m.tail_waste(seq),  # type: ignore[arg-type]
        lambda: m.slot(seq, 0),  # type: ignore[arg-type]
        lambda: m.blocks_needed(seq, 1),  # type: ignore[arg-type]
        lambda: m.can_append(seq, 1),  # type: ignore[arg-type]
        lambda: m.append_slots(seq, [0]),  # type: ignore[arg-type]
        lambda: m.free(seq),  # type: ignore[arg-type]
    ]


def bad_seq_id(w: World, data: st.DataObject) -> Case:
    bad, error = data.draw(bad_ids())
    calls = [*_seq_query(w.m, bad), lambda: w.m.add_sequence(bad, [0])]  # type: ignore[arg-type]
    return Case(data.draw(st.sampled_from(calls)), error, "seq_id")


def unknown_seq_id(w: World, data: st.DataObject) -> Case:
    """A freed sequence (a double free, for ``free``), or one never added."""
    never = st.integers(w.next_id, w.next_id + 2**70)
    seq = data.draw(st.sampled_from(w.freed) if w.freed else never)
    return Case(data.draw(st.sampled_from(_seq_query(w.m, seq))), UnknownSequenceError, "seq_id")


def duplicate_seq_id(w: World, data: st.DataObject) -> Case | None:
    live = w.m.sequence_ids()
    if not live:
        return None
    seq = data.draw(st.sampled_from(live))
    if data.draw(st.booleans()):
        return Case(lambda: w.m.add_sequence(seq, [0]), DuplicateSequenceError, "seq_id")
    parent = data.draw(st.sampled_from(live))
    return Case(lambda: w.m.fork(parent, seq), DuplicateSequenceError, "child_id")


def bad_fork(w: World, data: st.DataObject) -> Case | None:
    live = w.m.sequence_ids()
    bad, error = data.draw(bad_ids())
    if data.draw(st.booleans()) or not live:
        return Case(lambda: w.m.fork(bad, w.next_id), error, "parent_id")  # type: ignore[arg-type]
    parent = data.draw(st.sampled_from(live))
    return Case(lambda: w.m.fork(parent, bad), error, "child_id")  # type: ignore[arg-type]


def unknown_parent(w: World, data: st.DataObject) -> Case:
    seq = data.draw(st.sampled_from(w.freed) if w.freed else st.just(w.next_id))
    return Case(lambda: w.m.fork(seq, w.next_id + 1), UnknownSequenceError, "parent_id")


def fork_mid_step(w: World, data: st.DataObject) -> Case | None:
    """A parent with tokens of this step not laid out (made so, validly, before the snapshot)."""
    live = [s for s in w.m.sequence_ids() if w.m.can_append(s, 1)]
    if not live:
        return None
    seq = data.draw(st.sampled_from(live))
    w.m.append_slots(seq, [data.draw(VOCAB)])
    return Case(lambda: w.m.fork(seq, w.next_id), StepBoundaryError, "parent_id")


def bad_tokens(w: World, data: st.DataObject) -> Case:
    bad, error = data.draw(bad_token_lists())
    m, live = w.m, w.m.sequence_ids()
    calls = [
        Case(lambda: m.add_sequence(w.next_id, bad), error, "prompt"),  # type: ignore[arg-type]
        Case(lambda: m.cached_prefix(bad), error, "prompt"),  # type: ignore[arg-type]
    ]
    if live:
        seq = data.draw(st.sampled_from(live))
        calls.append(Case(lambda: m.append_slots(seq, bad), error, "token_ids"))  # type: ignore[arg-type]
    return data.draw(st.sampled_from(calls))


def bad_extra_keys(w: World, data: st.DataObject) -> Case:
    bad = data.draw(BAD_KEYS)
    calls = [
        lambda: w.m.add_sequence(w.next_id, [0], extra_keys=bad),
        lambda: w.m.cached_prefix([0], extra_keys=bad),
    ]
    return Case(data.draw(st.sampled_from(calls)), T, "extra_keys")


def bad_counts(w: World, data: st.DataObject) -> Case | None:
    live = w.m.sequence_ids()
    if not live:
        return None
    seq = data.draw(st.sampled_from(live))
    n = w.m.num_tokens(seq)
    if data.draw(st.booleans()):
        bad, error = data.draw(bad_ids())
        name = data.draw(st.sampled_from(["num_new_tokens", "position"]))
    else:  # an int that is not a position of this sequence
        bad, error, name = (
            data.draw(st.one_of(st.integers(max_value=-1), st.integers(n))),
            V,
            "position",
        )
    calls = {
        "num_new_tokens": [
            lambda: w.m.blocks_needed(seq, bad),  # type: ignore[arg-type]
            lambda: w.m.can_append(seq, bad),  # type: ignore[arg-type]
        ],
        "position": [lambda: w.m.slot(seq, bad)],  # type: ignore[arg-type]
    }
    return Case(data.draw(st.sampled_from(calls[name])), error, name)


def out_of_blocks(w: World, data: st.DataObject) -> Case | None:
    live = w.m.sequence_ids()
    if not live:
        return None
    seq = data.draw(st.sampled_from(live))
    too_many = (w.m.pool.num_available + data.draw(st.integers(1, 3))) * w.m.block_size
    return Case(lambda: w.m.append_slots(seq, [0] * too_many), OutOfBlocksError, f"sequence {seq}")


def bad_block(w: World, data: st.DataObject) -> Case:
    pool = w.m.pool
    bad, error = data.draw(
        st.one_of(
            bad_ids(),
            st.integers(pool.num_blocks, pool.num_blocks + 2**70).map(
                lambda v: (v, UnknownBlockError)
            ),
            st.integers(max_value=-1).map(lambda v: (v, UnknownBlockError)),
        )
    )
    if error is V:
        error = UnknownBlockError  # an int out of range names no block
    calls = [
        lambda: pool.ref_count(bad),  # type: ignore[arg-type]
        lambda: pool.incref(bad),  # type: ignore[arg-type]
        lambda: pool.decref(bad),  # type: ignore[arg-type]
        lambda: pool.block_hash(bad),  # type: ignore[arg-type]
        lambda: pool.register(bad, b"h"),  # type: ignore[arg-type]
        lambda: pool.unregister(bad),  # type: ignore[arg-type]
    ]
    return Case(data.draw(st.sampled_from(calls)), error, "block")


def unheld_block(w: World, data: st.DataObject) -> Case | None:
    """A block with no holder: it cannot be released, cached, or (when free) shared."""
    pool = w.m.pool
    unheld = [b for b in range(pool.num_blocks) if pool.ref_count(b) == 0]
    if not unheld:
        return None
    b = data.draw(st.sampled_from(unheld))
    calls = [
        Case(lambda: pool.decref(b), DoubleFreeError, "block"),
        Case(lambda: pool.register(b, b"h"), BlockStateError, "block"),
        Case(lambda: pool.unregister(b), BlockStateError, "block"),
    ]
    if pool.block_hash(b) is None:  # a free block: a cached one may be shared
        calls.append(Case(lambda: pool.incref(b), BlockStateError, "block"))
    return data.draw(st.sampled_from(calls))


def bad_hash(w: World, data: st.DataObject) -> Case:
    pool = w.m.pool
    bad, error = data.draw(BAD_HASHES)
    held = [b for b in range(pool.num_blocks) if pool.ref_count(b)]
    calls = [lambda: pool.cached_block(bad)]  # type: ignore[arg-type]
    if held:
        block = data.draw(st.sampled_from(held))
        calls.append(lambda: pool.register(block, bad))  # type: ignore[arg-type]
    return Case(data.draw(st.sampled_from(calls)), error, "block_hash")


TEMPLATES: list[Template] = [
    bad_seq_id,
    unknown_seq_id,
    duplicate_seq_id,
    bad_fork,
    unknown_parent,
    fork_mid_step,
    bad_tokens,
    bad_extra_keys,
    bad_counts,
    out_of_blocks,
    bad_block,
    unheld_block,
    bad_hash,
]


@EXAMPLES
@given(w=worlds(), template=st.sampled_from(TEMPLATES), data=st.data())
def test_an_invalid_call_raises_names_its_argument_and_changes_nothing(
    w: World, template: Template, data: st.DataObject
) -> None:
    case = template(w, data)
    assume(case is not None)
    assert case is not None
    before = snapshot(w.m)
    with pytest.raises(case.error) as raised:
        case.call()
    message = str(raised.value)
    assert message.startswith(case.name), f"{message!r} does not start with {case.name!r}"
    after = snapshot(w.m)
    if case.error is OutOfBlocksError:  # a failed allocation counts itself, once
        assert after[-1] == before[-1] + 1  # type: ignore[operator]
        before, after = before[:-1], after[:-1]
    assert after == before, "a failed call changed state"
    w.m.check_integrity()
    _carry_on(w.m)


def _carry_on(m: BlockManager) -> None:
    """The manager still works after the error: lay out the step, free all, nothing leaked."""
    m.take_copies()
    for seq in m.sequence_ids():
        m.free(seq)
    m.check_integrity()
    assert m.pool.num_held == 0 and m.pool.num_available == m.pool.num_blocks


@EXAMPLES
@given(w=worlds(), bad=st.one_of(NOT_INTS, st.integers(max_value=-1)))
def test_anything_but_a_held_int_names_no_sequence(w: World, bad: object) -> None:
    """``in`` never raises and never confuses ``True`` with sequence 1 or ``1.0`` with 1."""
    before = snapshot(w.m)
    assert bad not in w.m
    assert snapshot(w.m) == before


# -- constructors and stateless functions --------------------------------------------------


def _positive() -> st.SearchStrategy[tuple[object, type[SpecError]]]:
    return bad_ids(low=1)


BadValues = Callable[[], st.SearchStrategy[tuple[object, type[SpecError]]]]
STATELESS: list[tuple[str, Callable[..., object], dict[str, object], str, BadValues]]
STATELESS = [
    ("BlockPool", BlockPool, {"num_blocks": 4, "block_size": 2}, "num_blocks", _positive),
    ("BlockPool", BlockPool, {"num_blocks": 4, "block_size": 2}, "block_size", _positive),
    ("BlockManager", BlockManager, {"num_blocks": 4, "block_size": 2}, "num_blocks", _positive),
    ("BlockManager", BlockManager, {"num_blocks": 4, "block_size": 2}, "block_size", _positive),
    (
        "prompt_block_hashes",
        prompt_block_hashes,
        {"token_ids": [1, 2], "block_size": 2},
        "block_size",
        _positive,
    ),
    (
        "blocks_for_tokens",
        kv_budget.blocks_for_tokens,
        {"num_tokens": 3, "block_size": 2},
        "num_tokens",
        bad_ids,
    ),
    (
        "blocks_for_tokens",
        kv_budget.blocks_for_tokens,
        {"num_tokens": 3, "block_size": 2},
        "block_size",
        _positive,
    ),
    (
        "paged_tail_waste",
        kv_budget.paged_tail_waste,
        {"num_tokens": 3, "block_size": 2},
        "num_tokens",
        bad_ids,
    ),
    (
        "paged_tail_waste",
        kv_budget.paged_tail_waste,
        {"num_tokens": 3, "block_size": 2},
        "block_size",
        _positive,
    ),
    (
        "contiguous_waste_fraction",
        kv_budget.contiguous_waste_fraction,
        {"num_tokens": 3, "reserved_tokens": 8},
        "num_tokens",
        bad_ids,
    ),
    (
        "contiguous_waste_fraction",
        kv_budget.contiguous_waste_fraction,
        {"num_tokens": 3, "reserved_tokens": 8},
        "reserved_tokens",
        _positive,
    ),
    (
        "paged_utilization",
        kv_budget.paged_utilization,
        {"token_counts": [3], "block_size": 2},
        "block_size",
        _positive,
    ),
    (
        "sequences_that_fit",
        kv_budget.sequences_that_fit,
        {"pool_bytes": 10, "per_sequence_bytes": 2},
        "pool_bytes",
        bad_ids,
    ),
    (
        "sequences_that_fit",
        kv_budget.sequences_that_fit,
        {"pool_bytes": 10, "per_sequence_bytes": 2},
        "per_sequence_bytes",
        _positive,
    ),
]
for _arg in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
    _good: dict[str, object] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "dtype_bytes": 2}
    STATELESS.append(("kv_bytes_per_token", kv_budget.kv_bytes_per_token, _good, _arg, _positive))
for _arg, _bad in [
    ("num_tokens", bad_ids),
    ("bytes_per_token", bad_ids),
    ("block_size", _positive),
    ("state_bytes", bad_ids),
]:
    _good = {"num_tokens": 3, "bytes_per_token": 2, "block_size": 2, "state_bytes": 0}
    STATELESS.append(("sequence_bytes", kv_budget.sequence_bytes, _good, _arg, _bad))


@EXAMPLES
@given(data=st.data(), index=st.integers(0, len(STATELESS) - 1))
def test_constructors_and_functions_refuse_a_bad_argument(data: st.DataObject, index: int) -> None:
    _, fn, good, name, bad = STATELESS[index]
    fn(**good)  # the good arguments are good
    value, error = data.draw(bad())
    with pytest.raises(error) as raised:
        fn(**(good | {name: value}))
    assert str(raised.value).startswith(name), str(raised.value)


@EXAMPLES
@given(data=st.data())
def test_hashing_and_lists_refuse_a_bad_argument(data: st.DataObject) -> None:
    bad_tokens, token_error = data.draw(bad_token_lists())
    bad_parent, parent_error = data.draw(BAD_HASHES.filter(lambda h: h[0] is not None))
    cases: list[tuple[Callable[[], object], type[SpecError], str]] = [
        (lambda: block_hash(None, bad_tokens), token_error, "token_ids"),  # type: ignore[arg-type]
        (lambda: block_hash(bad_parent, [1]), parent_error, "parent"),  # type: ignore[arg-type]
        (lambda: block_hash(None, [1], data.draw(BAD_KEYS)), T, "extra_keys"),
        (lambda: prompt_block_hashes(bad_tokens, 2), token_error, "token_ids"),  # type: ignore[arg-type]
        (lambda: prompt_block_hashes([1], 1, data.draw(BAD_KEYS)), T, "extra_keys"),
        (lambda: kv_budget.paged_utilization(bad_tokens, 2), token_error, "token_counts"),  # type: ignore[arg-type]
        (lambda: kv_budget.contiguous_waste_fraction(9, 8), V, "num_tokens"),
        (
            lambda: BlockManager(4, 2, enable_prefix_caching=data.draw(NOT_BOOLS)),
            T,
            "enable_prefix_caching",
        ),
    ]
    call, error, name = data.draw(st.sampled_from(cases))
    with pytest.raises(error) as raised:
        call()
    assert str(raised.value).startswith(name), str(raised.value)


NOT_BOOLS: st.SearchStrategy[Any] = st.sampled_from(
    ["no", "", 1, 0, None, 1.0, [True], np.array([True])]
)


# -- the bare pool ---------------------------------------------------------------------------


@EXAMPLES
@given(
    num_blocks=st.integers(1, 6),
    ops=st.lists(st.sampled_from(["allocate", "share", "release", "register"]), max_size=20),
    data=st.data(),
)
def test_an_exhausted_pool_refuses_and_counts_one_failure(
    num_blocks: int, ops: list[str], data: st.DataObject
) -> None:
    """A bare pool (holders tracked here): a random valid history, then an allocation too many."""
    pool = BlockPool(num_blocks, 2)
    holders: dict[int, int] = {}
    for op in ops:
        held = sorted(b for b, n in holders.items() if n)
        if op == "allocate" and pool.num_available:
            b = pool.allocate()
            holders[b] = 1
        elif held:
            b = data.draw(st.sampled_from(held))
            if op == "share":
                pool.incref(b)
                holders[b] += 1
            elif op == "release":
                pool.decref(b)
                holders[b] -= 1
            else:
                pool.register(b, bytes([b + 1]))
    while pool.num_available:
        b = pool.allocate()
        holders[b] = 1
    before = ([pool.ref_count(b) for b in range(num_blocks)], pool.num_evictions)
    failures = pool.num_allocation_failures
    with pytest.raises(OutOfBlocksError, match=f"all {num_blocks} blocks are held"):
        pool.allocate()
    assert ([pool.ref_count(b) for b in range(num_blocks)], pool.num_evictions) == before
    assert pool.num_allocation_failures == failures + 1
    pool.check_integrity(holders)


@pytest.mark.parametrize("bad", [["a"], "abc", None, [True, False], {"x": 1}])
def test_fp8_rounding_names_values_that_are_not_numbers(bad: object) -> None:
    from spec.quant import quantize, quantize_range, round_fp8

    for call in (
        lambda: round_fp8(bad, "fp8_e4m3"),  # type: ignore[arg-type]
        lambda: quantize(bad, 1.0, "fp8_e4m3"),  # type: ignore[arg-type]
        lambda: quantize_range(bad, 1.0, "fp8_e5m2"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ArgumentTypeError, match="x must be real numbers"):
            call()
    assert round_fp8(np.array([1.0, 500.0]), "fp8_e4m3").tolist() == [1.0, 448.0]  # still rounds
