"""The contract's data: batch metadata's one check and arrays, the geometry, the capabilities."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from spec.attention import AttentionVariant
from spec.backend import ReferenceBackend
from spec.batch import PAD_BLOCK, BatchMetadata, GroupLayout, build_batch
from spec.block_manager import BlockManager
from spec.capabilities import Capabilities
from spec.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    InvalidBatchError,
    InvalidRequestError,
    UnknownBlockError,
)
from spec.kv_geometry import KVGeometry


def _batch() -> BatchMetadata:
    """Sequence 3 prefills 5 tokens, sequence 4 decodes its 7th (block size 4)."""
    m = BlockManager(num_blocks=8, block_size=4)
    m.add_sequence(4, [1] * 6)
    m.append_slots(4, [1] * 6)
    m.mark_written(4)
    m.add_sequence(3, [2] * 5)
    m.append_slots(3, [2] * 5)
    m.append_slots(4, [9])
    return build_batch(m, [(3, 5), (4, 1)])


def test_a_built_batch_is_valid_and_its_arrays_have_the_contract_dtypes() -> None:
    batch = _batch()
    batch.validate(num_blocks=8)
    a = batch.arrays()
    assert a.query_start_loc.dtype == np.int32 and a.query_start_loc.tolist() == [0, 5, 6]
    assert a.seq_lens.dtype == np.int32 and a.block_tables.dtype == np.int32
    assert a.block_tables.tolist() == [[2, 3], [0, 1]]
    assert a.slot_mapping.dtype == np.int64 and a.positions.dtype == np.int64
    assert a.copies.shape == (0, 2) and (a.num_tokens, a.max_query_len, a.max_seq_len) == (6, 5, 7)
    assert batch.arrays() is a  # built once per batch
    doubled = a.map(lambda x: x * 2)
    assert doubled.seq_lens.tolist() == [10, 14] and doubled.num_tokens == 6


Edit = Callable[[BatchMetadata], BatchMetadata]
_BAD: list[tuple[str, Edit, str]] = [
    ("starts not at 0", lambda b: dataclasses.replace(b, query_start_loc=(1, 5, 6)), "start at 0"),
    (
        "an empty row",
        lambda b: dataclasses.replace(b, query_start_loc=(0, 6, 6)),
        "start at 0 and increase",
    ),
    ("seq_len below query_len", lambda b: dataclasses.replace(b, seq_lens=(4, 7)), "seq_len 4 <"),
    ("a lost row", lambda b: dataclasses.replace(b, seq_lens=(5,)), "2 seq_ids, but"),
    ("a repeated sequence", lambda b: dataclasses.replace(b, seq_ids=(3, 3)), "appears twice"),
    (
        "positions not the last tokens",
        lambda b: dataclasses.replace(b, positions=(0, 1, 2, 3, 4, 5)),
        "positions",
    ),
    (
        "a slot the table does not give",
        lambda b: dataclasses.replace(b, slot_mapping=(8, 9, 10, 11, 12, 7)),
        "lives in slot 6",
    ),
    (
        "a table entry outside the pool",
        lambda b: dataclasses.replace(b, block_tables=((2, 3), (0, 8))),
        "entry 1 is 8",
    ),
    (
        "padding inside the used entries",
        lambda b: dataclasses.replace(b, block_tables=((2, PAD_BLOCK), (0, 1))),
        "entry 1 is -1",
    ),
    (
        "rows of different widths",
        lambda b: dataclasses.replace(b, block_tables=((2, 3, PAD_BLOCK), (0, 1))),
        "rows are 3 wide",
    ),
    (
        "a copy whose source is a destination",
        lambda b: dataclasses.replace(b, copies=((5, 6), (6, 7))),
        "both a source and a destination",
    ),
    (
        "a group whose slots disagree with its table",
        lambda b: dataclasses.replace(
            b, extra_groups=(GroupLayout(((4, 5), (6, 7)), (16, 17, 18, 19, 20, 26)),)
        ),
        "group 1, sequence 4",
    ),
]


@pytest.mark.parametrize(("why", "edit", "message"), _BAD, ids=[b[0] for b in _BAD])
def test_validate_names_each_malformed_field(why: str, edit: Edit, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        edit(_batch()).validate(num_blocks=8)


def test_a_released_prefix_is_valid_only_before_the_new_tokens() -> None:
    """A sliding-window group may release blocks wholly before the window: a PAD prefix."""
    b = _batch()
    windowed = GroupLayout(((4, 5), (PAD_BLOCK, 6)), (16, 17, 18, 19, 20, 26))
    dataclasses.replace(b, extra_groups=(windowed,)).validate(num_blocks=8)
    released_too_far = GroupLayout(((4, 5), (PAD_BLOCK, PAD_BLOCK)), (16, 17, 18, 19, 20, 26))
    with pytest.raises(InvalidBatchError, match="position 6 is in a released block"):
        dataclasses.replace(b, extra_groups=(released_too_far,)).validate(num_blocks=8)
    assert dataclasses.replace(b, extra_groups=(windowed,)).tables(1) == windowed.block_tables


def test_the_reference_never_dereferences_a_released_block() -> None:
    """Full attention over a table with a released prefix must refuse, not read padding."""
    backend = ReferenceBackend()
    backend.create_cache(KVGeometry(2, 8, 4, 1, 2, layer_groups=(0, 1)))
    b = _batch()
    windowed = GroupLayout(((4, 5), (PAD_BLOCK, 6)), (16, 17, 18, 19, 20, 26))
    batch = dataclasses.replace(b, extra_groups=(windowed,))
    q = np.zeros((6, 1, 2), dtype=np.float32)
    out = backend.attention(1, q, batch, 1.0, variant=AttentionVariant(window=2))
    assert out.shape == (6, 1, 2)
    with pytest.raises(UnknownBlockError, match="released blocks must never be dereferenced"):
        backend.attention(1, q, batch, 1.0)  # a full-attention layer of the windowed group


def test_geometry_checks_every_field() -> None:
    ok = KVGeometry(2, 4, 16, 2, 8, "bfloat16", "fp8_e4m3", ((1.0, 1.0), (0.5, 0.5)), (0, 1))
    assert ok.cache_dtype == "fp8_e4m3" and ok.num_groups == 2 and ok.group_of(1) == 1
    assert ok.bytes_per_token == 2 * 2 * 2 * 8 * 1
    bad: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"num_blocks": 0}, ArgumentValueError, "num_blocks must be >= 1"),
        ({"head_dim": 8.0}, ArgumentTypeError, "head_dim must be an int"),
        ({"dtype": "fp16"}, ArgumentValueError, "dtype must be one of"),
        ({"kv_dtype": "int8"}, ArgumentValueError, "kv_dtype must be one of"),
        ({"kv_scales": ((1.0, 1.0),)}, ArgumentValueError, "one .k_scale, v_scale. per layer"),
        ({"kv_scales": ((1.0, 0.0), (1.0, 1.0))}, ArgumentValueError, r"kv_scales\[0\]\[1\]"),
        ({"layer_groups": (0, 2)}, ArgumentValueError, "number groups 0..G-1"),
        ({"layer_groups": (0,)}, ArgumentValueError, "for each of 2 layers"),
    ]
    for change, error, message in bad:
        with pytest.raises(error, match=message):
            dataclasses.replace(ok, **change)  # type: ignore[arg-type]


def test_capabilities_normalise_and_check_their_fields() -> None:
    caps = Capabilities("x", head_dims={64, 128}, variants={"window"}, max_query_len=1)
    assert caps.head_dims == frozenset({64, 128}) and caps.variants == frozenset({"window"})
    for change, message in [
        ({"variants": {"windowing"}}, "unknown"),
        ({"kv_dtypes": {"int4"}}, "unknown"),
        ({"max_query_len": 0}, "max_query_len must be >= 1"),
        ({"decode": "no"}, "decode must be a bool"),
        ({"tensors": "jax"}, "tensors must be one of"),
        ({"block_sizes": {16, 0}}, "block_sizes must be >= 1"),
        ({"name": ""}, "name must be a non-empty str"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            dataclasses.replace(caps, **change)  # type: ignore[arg-type]


def test_capabilities_say_why_a_shape_a_query_or_a_batch_cannot_run() -> None:
    g = KVGeometry(1, 4, 16, 2, 128, "float16", "fp8_e5m2", ((1.0, 1.0),))
    caps = Capabilities(
        "x",
        dtypes={"bfloat16"},
        head_dims={64},
        gqa_ratios={1, 2},
        max_query_len=1,
        excludes=lambda geometry, heads, variant: "never on Tuesdays",
    )
    reasons = caps.unsupported(g, num_heads=8, variant=AttentionVariant(softcap=5.0))
    assert reasons == [
        "dtype float16",
        "KV dtype fp8_e5m2",
        "head dim 128",
        "GQA ratio 4",
        "attention variant softcap",
    ]
    fine = KVGeometry(1, 4, 16, 2, 64, "bfloat16")
    assert caps.unsupported(fine, num_heads=2) == ["never on Tuesdays"]
    assert caps.query_unsupported(5, 0) == "a query of 5 tokens (max_query_len 1)"
    assert caps.query_unsupported(1, 9) is None
    prefill_only = Capabilities("p", decode=False, chunked_prefill=False)
    assert prefill_only.query_unsupported(1, 0) is None  # a 1-token prompt is a prefill
    assert prefill_only.query_unsupported(1, 3) == "a decode (decode is False)"
    assert "chunked_prefill" in str(prefill_only.query_unsupported(4, 3))
    no_mix = Capabilities("m", mixed_batches=False, max_num_seqs=1)
    assert no_mix.batch_unsupported(_batch()) == "2 sequences in one call (max_num_seqs 1)"
    assert "mixed_batches" in str(
        dataclasses.replace(no_mix, max_num_seqs=None).batch_unsupported(_batch())
    )
