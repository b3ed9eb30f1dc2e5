"""The torch and Triton backends refuse what the spec refuses, by the spec's own rules.

Every case here is a call the spec's :class:`~spec.backend.ReferenceBackend`
refuses too: a batch that :meth:`~spec.batch.BatchMetadata.validate` rejects (a
``seq_len`` shorter than its query, a bad ``query_start_loc``, a table entry
that is not an int), a scale that is NaN, infinite or zero, a slot or block
id that is a float, a string or a bool, a slot written twice, a value beyond
the cache dtype's largest. Each raises a :class:`~spec.errors.SpecError`
subclass that names the argument, and leaves the cache exactly as it was
(NaN for never-written slots included). A quantized cache does not refuse an
overflow: it saturates, as :func:`spec.quant.quantize` does, on every backend.
The shapes are tiny (the Triton kernels run interpreted on a CPU); the backends
and every tensor are on :data:`devices.DEVICE`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from backend_helpers import fewer_examples
from devices import DEVICE
from hypothesis import given
from hypothesis import strategies as st

from backend_gpu.kernels.slot_mapping import compute_slot_mapping
from backend_gpu.torch_backend import TorchBackend
from backend_gpu.triton_backend import TritonBackend
from spec.backend import Backend, KVGeometry, ReferenceBackend
from spec.batch import BatchMetadata, build_batch
from spec.block_manager import BlockManager
from spec.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    InvalidBatchError,
    InvalidRequestError,
    SpecError,
    UnknownBlockError,
)

BACKENDS: dict[str, Callable[..., Any]] = {
    "torch": functools.partial(TorchBackend, DEVICE),
    "triton": functools.partial(TritonBackend, DEVICE),
}
ALL = {**BACKENDS, "reference": ReferenceBackend}
T, V, B = ArgumentTypeError, ArgumentValueError, InvalidBatchError

NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM = 4, 2, 1, 4
"""Geometry: 4 blocks of 2 tokens (8 slots), one KV head of 4 elements, one layer."""


def _backend(name: str, dtype: str = "float32", **geometry: Any) -> Any:
    """A fresh backend (``Any``: the protocol has no ``read_blocks``, which each of these has)."""
    backend = ALL[name]()
    backend.create_cache(KVGeometry(1, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype=dtype, **geometry))
    return backend


def _rows(n: int, value: float = 1.0) -> np.ndarray:
    return np.full((n, HEADS, DIM), value, dtype=np.float32)


def _snapshot(backend: Backend) -> tuple[np.ndarray, np.ndarray]:
    k, v = backend.read_cache(0)
    return np.asarray(k, dtype=np.float64).copy(), np.asarray(v, dtype=np.float64).copy()


def _assert_refused(
    backend: Backend, call: Callable[[], object], error: type[SpecError], name: str
) -> str:
    """``call`` raises ``error`` whose message names ``name``, and the cache did not change."""
    before = _snapshot(backend)
    with pytest.raises(error) as raised:
        call()
    message = str(raised.value)
    assert name in message, message
    for was, now in zip(before, _snapshot(backend), strict=True):
        assert np.array_equal(was, now, equal_nan=True), "the refused call changed the cache"
    return message


def _step() -> BatchMetadata:
    """A valid batch: sequence 0 with 3 tokens, all new (a prefill of two blocks)."""
    m = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    m.add_sequence(0, [1, 2, 3])
    m.append_slots(0, [1, 2, 3])
    return build_batch(m, [(0, 3)])


def _written(name: str, dtype: str = "float32") -> tuple[Any, BatchMetadata]:
    backend, batch = _backend(name, dtype), _step()
    backend.write_kv(0, _rows(3), _rows(3, 2.0), batch.slot_mapping)
    return backend, batch


# -- attention: the batch check every backend relies on, and the scale ------------------------

BAD_BATCHES: dict[str, Callable[[BatchMetadata], BatchMetadata]] = {
    "seq_len shorter than the query": lambda b: dataclasses.replace(b, seq_lens=(2,)),
    "query_start_loc not from 0": lambda b: dataclasses.replace(b, query_start_loc=(1, 3)),
    "query_start_loc past the tokens": lambda b: dataclasses.replace(b, query_start_loc=(0, 5)),
    "query_start_loc short of the tokens": lambda b: dataclasses.replace(b, query_start_loc=(0, 2)),
    "a float block id": lambda b: dataclasses.replace(b, block_tables=((1.7, 1),)),  # type: ignore[arg-type]
    "a str block id": lambda b: dataclasses.replace(b, block_tables=(("3", 1),)),  # type: ignore[arg-type]
    "a bool block id": lambda b: dataclasses.replace(b, block_tables=((True, 0),)),
    "a float slot": lambda b: dataclasses.replace(b, slot_mapping=(0, 1, 2.0)),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
@pytest.mark.parametrize("name", list(ALL))
def test_attention_runs_the_spec_batch_check(name: str, case: str) -> None:
    backend, batch = _written(name)
    bad = BAD_BATCHES[case](batch)
    call = lambda: backend.attention(0, _rows(6), bad, 0.5)  # query rows past the batch: padding  # noqa: E731
    _assert_refused(backend, call, InvalidBatchError, "")


BAD_SCALES: list[tuple[object, type[SpecError]]] = [
    (float("nan"), V),
    (float("inf"), V),
    (-float("inf"), V),
    (0.0, V),
    (-0.5, V),
    ("0.5", T),
    (True, T),
    (None, T),
]


@pytest.mark.parametrize(("scale", "error"), BAD_SCALES, ids=repr)
@pytest.mark.parametrize("name", list(ALL))
def test_attention_refuses_a_bad_scale(name: str, scale: object, error: type[SpecError]) -> None:
    backend, batch = _written(name)
    call = lambda: backend.attention(0, _rows(3), batch, scale)  # noqa: E731
    _assert_refused(backend, call, error, "scale")


@pytest.mark.parametrize(
    ("variant", "batch_arg", "error", "named"),
    [("window", None, T, "variant"), (None, None, T, "batch"), (None, "batch", T, "batch")],
)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_attention_refuses_arguments_of_the_wrong_type(
    name: str, variant: object, batch_arg: object, error: type[SpecError], named: str
) -> None:
    backend, batch = _written(name)
    given_batch = batch if variant is not None else batch_arg
    call = lambda: backend.attention(0, _rows(3), given_batch, 0.5, variant=variant)  # noqa: E731
    _assert_refused(backend, call, error, named)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_attention_of_a_valid_batch_still_runs(name: str) -> None:
    backend, batch = _written(name)
    out = np.asarray(backend.attention(0, _rows(3), batch, 0.5))
    assert np.allclose(out, 2.0)  # every value is 2: any weights average to 2


# -- KV writes: slots by the spec's rule, values that fit the cache ---------------------------

BAD_SLOTS: list[tuple[list[object], type[SpecError], str]] = [
    ([1.7], T, "slot_mapping[0] must be an int, got float 1.7"),
    ([np.float64(2.0)], T, "slot_mapping[0] must be an int"),
    (["3"], T, "slot_mapping[0] must be an int, got str '3'"),
    ([True], T, "slot_mapping[0] must be an int, got bool True"),
    ([np.True_], T, "slot_mapping[0] must be an int"),
    ([None], T, "slot_mapping[0] must be an int"),
    ([2, 2], V, "slot_mapping writes slot 2 twice (entries 0 and 1)"),
    ([5, -1, 0, 5], V, "slot_mapping writes slot 5 twice (entries 0 and 3)"),
    ([8], V, "slot_mapping[0] is 8: slot 8 is outside 0..7"),
    ([-2], V, "slot_mapping[0] is -2"),
    ([2**70], V, f"slot_mapping[0] is {2**70}"),
]


@pytest.mark.parametrize(("slots", "error", "message"), BAD_SLOTS, ids=repr)
@pytest.mark.parametrize("name", list(ALL))
def test_write_refuses_bad_slots(
    name: str, slots: list[object], error: type[SpecError], message: str
) -> None:
    backend = _backend(name)
    backend.write_kv(0, _rows(2), _rows(2), [6, 7])  # something to keep
    call = lambda: backend.write_kv(0, _rows(len(slots)), _rows(len(slots)), slots)  # noqa: E731
    assert message in _assert_refused(backend, call, error, "slot_mapping")


@pytest.mark.parametrize("slots", ["3", 3, None, {1, 2}], ids=repr)
@pytest.mark.parametrize("name", list(ALL))
def test_write_refuses_a_slot_mapping_that_is_not_a_sequence(name: str, slots: object) -> None:
    backend = _backend(name)
    call = lambda: backend.write_kv(0, _rows(1), _rows(1), slots)  # noqa: E731
    _assert_refused(backend, call, T, "slot_mapping")


OVERFLOWS = [("float16", 1e6), ("float16", -7e4), ("bfloat16", 1e39), ("float32", 1e39)]


@pytest.mark.parametrize(("dtype", "big"), OVERFLOWS)
@pytest.mark.parametrize("name", list(ALL))
def test_write_refuses_values_beyond_the_cache_dtype(name: str, dtype: str, big: float) -> None:
    backend = _backend(name, dtype)
    backend.write_kv(0, _rows(1).astype(np.float64), _rows(1).astype(np.float64), [3])
    for which in ("key", "value"):
        k, v = np.ones((2, HEADS, DIM)), np.ones((2, HEADS, DIM))
        (v if which == "value" else k)[1, 0, 2] = big
        call = lambda k=k, v=v: backend.write_kv(0, k, v, [0, 1])  # noqa: E731
        message = _assert_refused(backend, call, V, f"{which}[1]")
        assert f"beyond {dtype}'s largest finite value" in message


@pytest.mark.parametrize("name", list(ALL))
def test_values_beyond_the_dtype_in_rows_not_written_are_not_checked(name: str) -> None:
    """Padding slots and rows past the slot mapping are never stored: 1e6 there is fine."""
    backend = _backend(name, "float16")
    rows = np.full((3, HEADS, DIM), 1e6)
    rows[0] = 0.5
    backend.write_kv(0, rows, rows, [4, -1])  # row 1: a padding slot; row 2: past the mapping
    k, _ = backend.read_cache(0)
    assert float(np.asarray(k)[2, 0, 0, 0]) == 0.5


@pytest.mark.parametrize(("fmt", "top"), [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_an_fp8_cache_saturates_on_every_backend(fmt: str, top: float) -> None:
    """The spec's rule for its own quantized memory: an overflow saturates, never inf or NaN."""
    stored = {}
    for name in ALL:
        backend = _backend(name, kv_dtype=fmt, kv_scales=((1.0, 0.5),))
        rows = np.full((1, HEADS, DIM), 1e6, dtype=np.float32)
        rows[0, 0, 1] = -1e6
        backend.write_kv(0, rows, rows, [5])
        k, v = (np.asarray(x, dtype=np.float64) for x in backend.read_cache(0))
        stored[name] = (k[2, 1, 0], v[2, 1, 0])
    for k, v in stored.values():
        assert k.tolist() == v.tolist() == [top, -top, top, top]


@pytest.mark.parametrize("bad", [True, 1.7, "0", np.True_])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_layer_must_be_an_int(name: str, bad: object) -> None:
    backend = _backend(name)
    call = lambda: backend.write_kv(bad, _rows(1), _rows(1), [0])  # noqa: E731
    _assert_refused(backend, call, T, "layer")


# -- copies and reads: block ids by the spec's rule ---------------------------------------------

BAD_COPIES: list[tuple[list[Any], type[SpecError], str]] = [
    ([(1.7, 2)], T, "copies[0][0] must be an int, got float 1.7"),
    ([("3", 2)], T, "copies[0][0] must be an int, got str '3'"),
    ([(0, True)], T, "copies[0][1] must be an int, got bool True"),
    ([(0, 2**70)], UnknownBlockError, f"block {2**70} is outside"),
    ([(0, 1, 2)], B, "copies[0] must be a (src, dst) pair"),
    ([(0, 2), (1, 2)], B, "destination block 2 appears twice"),
    ([(0, 1), (1, 2)], B, "block 1 is both a source and a destination"),
]


@pytest.mark.parametrize(("copies", "error", "message"), BAD_COPIES, ids=repr)
@pytest.mark.parametrize("name", list(ALL))
def test_copy_blocks_refuses_bad_block_ids(
    name: str, copies: list[Any], error: type[SpecError], message: str
) -> None:
    backend, _ = _written(name)
    call = lambda: backend.copy_blocks(copies)  # noqa: E731
    assert message in _assert_refused(backend, call, error, "")


@pytest.mark.parametrize("blocks", [[1.7], [True], ["1"], [4], [2**70]], ids=repr)
@pytest.mark.parametrize("name", list(ALL))
def test_read_blocks_refuses_bad_block_ids(name: str, blocks: list[object]) -> None:
    backend, _ = _written(name)
    with pytest.raises((ArgumentTypeError, ArgumentValueError), match=r"blocks\[0\]"):
        backend.read_blocks(0, blocks)


# -- the device contract: tensors, checked on the device ----------------------------------------


@pytest.mark.parametrize("name", list(BACKENDS))
def test_device_contract_refuses_duplicate_and_out_of_range_slots(name: str) -> None:
    backend = BACKENDS[name](tensors="torch")
    backend.create_cache(KVGeometry(1, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM))
    rows = torch.ones(2, HEADS, DIM, device=DEVICE)
    backend.write_kv(0, rows, rows, torch.tensor([6, 7], device=DEVICE))
    for slots, message in (([3, 3], "slot 3 twice"), ([1, 9], "slot_mapping[1] is 9")):
        call = lambda s=slots: backend.write_kv(0, rows, rows, torch.tensor(s, device=DEVICE))  # noqa: E731
        assert message in _assert_refused(backend, call, V, "slot_mapping")


# -- compute_slot_mapping: never reads past a table row -----------------------------------------


def _slot_inputs(
    seq_len: int, query_len: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tables = torch.arange(width, dtype=torch.int32, device=DEVICE).reshape(1, width)
    qsl = torch.tensor([0, query_len], dtype=torch.int32, device=DEVICE)
    return tables, qsl, torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)


def test_compute_slot_mapping_checks_the_table_width() -> None:
    assert compute_slot_mapping(*_slot_inputs(4, 2, 2), 2).tolist() == [2, 3]
    with pytest.raises(InvalidRequestError, match=r"needs 3 table entries .* rows are 2 wide"):
        compute_slot_mapping(*_slot_inputs(5, 2, 2), 2)
    with pytest.raises(InvalidRequestError, match="seq_len 1 < its 2 new tokens"):
        compute_slot_mapping(*_slot_inputs(1, 2, 2), 2)
    tables, _, lens = _slot_inputs(4, 2, 2)
    with pytest.raises(InvalidRequestError, match="query_start_loc must start at 0"):
        compute_slot_mapping(
            tables, torch.tensor([1, 2], dtype=torch.int32, device=DEVICE), lens, 2
        )


# -- the invariant: a refused call changes nothing, whatever came before -------------------------

BAD_WRITES = st.sampled_from([s for s, _, _ in BAD_SLOTS])


@pytest.mark.parametrize("name", list(BACKENDS))
@fewer_examples(10, minimum=4)
@given(
    earlier=st.lists(st.integers(0, 7), max_size=4, unique=True),
    bad_slots=BAD_WRITES,
    bad_value=st.sampled_from([None, 1e6, -1e9]),
)
def test_any_refused_write_leaves_the_cache_unchanged(
    name: str, earlier: list[int], bad_slots: list[object], bad_value: float | None
) -> None:
    backend = _backend(name, "float16")
    if earlier:
        x = np.arange(len(earlier) * HEADS * DIM, dtype=np.float32).reshape(-1, HEADS, DIM)
        backend.write_kv(0, x, -x, earlier)
    slots: list[object] = bad_slots if bad_value is None else [0, 1]
    rows = np.ones((len(slots), HEADS, DIM))
    if bad_value is not None:
        rows[-1, 0, -1] = bad_value
    call = lambda: backend.write_kv(0, rows, rows, slots)  # noqa: E731
    _assert_refused(backend, call, InvalidRequestError, "")


# -- create_cache: a geometry, and one whose pool the device can hold -------------------------


@pytest.mark.parametrize("name", sorted(ALL))
def test_create_cache_refuses_what_is_not_a_geometry(name: str) -> None:
    backend, _ = _written(name)
    fields = dataclasses.asdict(KVGeometry(1, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM))
    for bad in (fields, None, "float16"):
        call: Callable[[], object] = functools.partial(backend.create_cache, bad)
        message = _assert_refused(backend, call, T, "geometry")
        assert "must be a KVGeometry" in message


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_pool_the_device_cannot_hold_is_refused_before_allocating(name: str) -> None:
    backend, _ = _written(name)
    huge = KVGeometry(64, 1 << 38, 16, 8, 128, dtype="float16")  # 2^60 bytes
    message = _assert_refused(backend, lambda: backend.create_cache(huge), InvalidRequestError, "")
    assert f"{2 * 64 * (1 << 38) * 16 * 8 * 128 * 2:,} bytes" in message
    assert "refused before allocating" in message and "num_blocks=274877906944" in message
    assert "can't allocate" not in message  # torch's own words are not the message


def test_the_fast_reference_names_a_precision_that_is_not_one() -> None:
    from conformance.judges.fast_reference import PagedKV
    from conformance.judges.fast_reference import paged_attention as fast
    from spec.attention_batched import paged_attention_batched
    from spec.kv_memory import KVMemory

    batch = _step()
    memory = KVMemory(1, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, lazy=False)
    memory.write(0, _rows(3).astype(np.float64), _rows(3, 2.0).astype(np.float64), [0, 1, 2])
    before = memory.k[0].copy()
    query = np.ones((3, HEADS, DIM))
    fast_kv = PagedKV.from_memory(memory, 0, "cpu")
    calls: list[Callable[[], object]] = [
        lambda: fast(query, batch, fast_kv, precision="fast"),  # type: ignore[arg-type]
        lambda: paged_attention_batched(query, batch, memory, 0, precision="fast"),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(ArgumentTypeError, match=r"precision must be a \w*Precision, got str"):
            call()
    assert np.array_equal(memory.k[0], before, equal_nan=True)
