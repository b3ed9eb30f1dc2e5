"""The latent layout (multi-head latent attention) in the spec: memory, geometry, attention.

A latent memory holds one row ``[c_kv, k_rope]`` a token and layer; every rule
of the ordinary memory (slots, padding, copies, laziness, NaN, fp8) applies to
it unchanged, which a Hypothesis property checks against a plain dictionary
of slots. Latent attention is the absorbed form, equal to the expanded
multi-head attention it stands for, and the suite's batched and
same-precision paths compute it too. Block tables and copy-on-write need no
change: a forked sequence reads its own rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.attention import (
    AttentionVariant,
    alibi_slopes,
    attend,
    attend_latent,
    latent_kv,
    paged_attention,
)
from spec.attention_batched import attend_at_precision, paged_attention_batched
from spec.backend import ReferenceBackend
from spec.batch import BatchMetadata, build_batch
from spec.block_manager import BlockManager
from spec.capabilities import Capabilities
from spec.errors import ArgumentTypeError, ArgumentValueError, InvalidRequestError
from spec.kv_budget import cdiv
from spec.kv_geometry import KVGeometry
from spec.kv_memory import KVMemory
from spec.precision import EXACT
from spec.quant import quantize

F8 = "fp8_e4m3"


Operation = tuple[str, list[int], list[tuple[int, int]]]
"""``("write", slots, [])`` or ``("copy", [], pairs)``."""


@st.composite
def _operations(draw: st.DrawFn, num_blocks: int, block_size: int) -> list[Operation]:
    """Writes (distinct slots, some padding ``-1``) and copy lists (independent pairs)."""
    ops: list[Operation] = []
    num_slots = num_blocks * block_size
    for _ in range(draw(st.integers(1, 8))):
        if draw(st.booleans()):
            slots = draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=6))
            pads = draw(st.lists(st.integers(0, len(slots)), max_size=2))
            for i in sorted(pads, reverse=True):
                slots.insert(i, -1)
            ops.append(("write", slots, []))
        else:
            blocks = draw(st.permutations(range(num_blocks)))
            n = draw(st.integers(0, num_blocks // 2))
            ops.append(("copy", [], list(zip(blocks[:n], blocks[n : 2 * n], strict=True))))
    return ops


@given(
    data=st.data(),
    latent=st.integers(1, 6),
    rope=st.integers(1, 3),
    block_size=st.sampled_from([1, 2, 3]),
    lazy=st.booleans(),
    fp8=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_latent_memory_write_copy_read_back_match_a_simple_model(
    data: st.DataObject,
    latent: int,
    rope: int,
    block_size: int,
    lazy: bool,
    fp8: bool,
    seed: int,
) -> None:
    """Each slot holds the last row written there, or copied with its block; the rest NaN.

    The model is a dictionary ``slot -> (c_kv, k_rope)``; the memory must agree
    through ``read_blocks`` (as stored), ``gather`` (dequantized, in table
    order) and, when dense, its one row array per layer.
    """
    num_blocks, rng = 5, np.random.default_rng(seed)
    scale = 0.5
    mem = KVMemory(
        2,
        num_blocks,
        block_size,
        1,
        latent + rope,
        latent_dim=latent,
        lazy=lazy,
        kv_dtype=F8 if fp8 else None,
        kv_scales=((scale, scale),) * 2 if fp8 else (),
    )
    model: list[dict[int, tuple[np.ndarray, np.ndarray]]] = [{}, {}]
    for op, slots, pairs in data.draw(_operations(num_blocks, block_size)):
        if op == "write":
            layer = int(rng.integers(2))
            c = rng.standard_normal((len(slots) + 1, 1, latent))  # one padding row past T
            r = rng.standard_normal((len(slots) + 1, 1, rope))
            mem.write(layer, c, r, slots)
            for i, s in enumerate(slots):
                if s != -1:
                    stored = [quantize(x[i], scale, F8) if fp8 else x[i] for x in (c, r)]
                    model[layer][s] = (stored[0], stored[1])
        else:
            mem.copy_blocks(pairs)
            for layer in range(2):
                before = dict(model[layer])
                for src, dst in pairs:
                    for o in range(block_size):
                        model[layer].pop(dst * block_size + o, None)
                        if src * block_size + o in before:
                            model[layer][dst * block_size + o] = before[src * block_size + o]
    for layer in range(2):
        c_kv, k_rope = mem.read_blocks(layer, list(range(num_blocks)))
        assert c_kv.shape == (num_blocks, block_size, 1, latent)
        assert k_rope.shape == (num_blocks, block_size, 1, rope)
        for s in range(num_blocks * block_size):
            got = (c_kv[s // block_size, s % block_size], k_rope[s // block_size, s % block_size])
            if s in model[layer]:
                for g, w in zip(got, model[layer][s], strict=True):
                    np.testing.assert_array_equal(g, w)
            else:
                assert np.isnan(got[0]).all() and np.isnan(got[1]).all(), f"slot {s} was written"
        table = list(rng.permutation(num_blocks))
        g_c, g_r = mem.gather(layer, table, num_blocks * block_size)
        order = [b * block_size + o for b in table for o in range(block_size)]
        factor = scale if fp8 else 1.0
        np.testing.assert_array_equal(g_c, c_kv.reshape(-1, 1, latent)[order] * factor)
        np.testing.assert_array_equal(g_r, k_rope.reshape(-1, 1, rope)[order] * factor)
        if not lazy:  # one row array per layer: c_kv first, then k_rope
            rows = mem.rows[layer]
            np.testing.assert_array_equal(rows, np.concatenate([c_kv, k_rope], axis=-1))


def test_latent_geometry_checks_its_fields_and_counts_one_row_a_layer() -> None:
    g = KVGeometry(61, 8, 64, 1, 576, "bfloat16", latent_dim=512)
    assert (g.is_latent, g.rope_dim, g.value_dim, g.kv_widths) == (True, 64, 512, (512, 64))
    assert g.bytes_per_token == 61 * 576 * 2  # one row, not K and V
    plain = KVGeometry(61, 8, 64, 1, 576, "bfloat16")
    assert (plain.is_latent, plain.rope_dim, plain.bytes_per_token) == (
        False,
        None,
        2 * 61 * 576 * 2,
    )
    bad: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"num_kv_heads": 8}, ArgumentValueError, "num_kv_heads must be 1 for a latent layout"),
        ({"latent_dim": 576}, ArgumentValueError, r"latent_dim must be in 1\.\.575"),
        ({"latent_dim": 0}, ArgumentValueError, "latent_dim must be in"),
        ({"latent_dim": 512.0}, ArgumentTypeError, "latent_dim must be an int"),
        ({"latent_dim": True}, ArgumentTypeError, "latent_dim must be an int"),
        (
            {"kv_dtype": F8, "kv_scales": ((1.0, 2.0),) * 61},
            ArgumentValueError,
            r"kv_scales\[0\] is \(1\.0, 2\.0\): a latent cache has one scale",
        ),
    ]
    for change, error, message in bad:
        with pytest.raises(error, match=message):
            dataclasses.replace(g, **change)  # type: ignore[arg-type]
    fp8 = dataclasses.replace(g, kv_dtype=F8, kv_scales=((0.5, 0.5),) * 61)
    assert fp8.bytes_per_token == 61 * 576


def test_a_latent_memory_refuses_wrong_widths_and_changes_nothing() -> None:
    mem = KVMemory(1, 2, 2, 1, 6, latent_dim=4)
    c, r = np.ones((1, 1, 4)), np.ones((1, 1, 2))
    mem.write(0, c, r, [0])
    before = [x.copy() for x in mem.read_blocks(0, [0, 1])]
    for key, value, message in [
        (np.ones((1, 1, 6)), r, r"key has shape \(1, 1, 6\), expected \[>= 1, 1, 4\] \(c_kv"),
        (c, np.ones((1, 1, 4)), r"value has shape .*expected \[>= 1, 1, 2\] \(k_rope"),
        (np.ones((1, 2, 4)), r, "key has shape"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            mem.write(0, key, value, [1])
    for got, want in zip(mem.read_blocks(0, [0, 1]), before, strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ArgumentValueError, match="num_kv_heads must be 1"):
        KVMemory(1, 2, 2, 2, 6, latent_dim=4)
    with pytest.raises(ArgumentValueError, match="one scale for its whole row"):
        KVMemory(1, 2, 2, 1, 6, latent_dim=4, kv_dtype=F8, kv_scales=((1.0, 0.5),))


@st.composite
def _variants(draw: st.DrawFn, num_heads: int) -> AttentionVariant:
    return AttentionVariant(
        window=draw(st.one_of(st.none(), st.integers(1, 6))),
        softcap=draw(st.one_of(st.none(), st.sampled_from([0.5, 3.0]))),
        sinks=tuple(float(i) - 1 for i in range(num_heads)) if draw(st.booleans()) else None,
        alibi_slopes=alibi_slopes(num_heads) if draw(st.booleans()) else None,
    )


@given(
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
    heads=st.integers(1, 4),
    latent=st.integers(1, 6),
    rope=st.integers(1, 4),
    nope=st.integers(1, 5),
    v_dim=st.integers(1, 5),
    n=st.integers(1, 4),
    context=st.integers(0, 8),
)
def test_absorbed_latent_attention_is_the_expanded_multi_head_form(
    data: st.DataObject,
    seed: int,
    heads: int,
    latent: int,
    rope: int,
    nope: int,
    v_dim: int,
    n: int,
    context: int,
) -> None:
    """Per-head keys ``[W_UK c, k_rope]`` and values ``W_UV c``, every variant: the same output."""
    rng = np.random.default_rng(seed)
    variant = data.draw(_variants(heads))
    t = context + n
    c_kv, k_rope = rng.standard_normal((t, 1, latent)), rng.standard_normal((t, 1, rope))
    w_uk, w_uv = (
        rng.standard_normal((heads, nope, latent)),
        rng.standard_normal((heads, v_dim, latent)),
    )
    q_nope, q_rope = rng.standard_normal((n, heads, nope)), rng.standard_normal((n, heads, rope))
    positions, scale = np.arange(context, t), 1 / np.sqrt(nope + rope)
    k = np.concatenate(
        [np.einsum("hdl,tl->thd", w_uk, c_kv[:, 0]), np.repeat(k_rope, heads, axis=1)], axis=-1
    )
    v = np.einsum("hdl,tl->thd", w_uv, c_kv[:, 0])
    expanded = attend(np.concatenate([q_nope, q_rope], -1), k, v, positions, scale, variant)
    q = np.concatenate([np.einsum("hdl,nhd->nhl", w_uk, q_nope), q_rope], axis=-1)
    absorbed = attend_latent(q, c_kv, k_rope, positions, scale, variant)
    assert absorbed.shape == (n, heads, latent)
    np.testing.assert_allclose(np.einsum("hdl,nhl->nhd", w_uv, absorbed), expanded, atol=1e-9)


def _latent_setup(
    seed: int, block_size: int, work: list[tuple[int, int]], fp8: bool, heads: int = 3
) -> tuple[np.ndarray, BatchMetadata, KVMemory]:
    """Sequences of (context, new tokens) in shuffled blocks, rows 4 + 2 wide, written."""
    rng = np.random.default_rng(seed)
    num_blocks = sum(cdiv(c + n, block_size) for c, n in work) + 2
    m = BlockManager(num_blocks, block_size)
    held = [m.pool.allocate() for _ in range(num_blocks)]
    for i in rng.permutation(num_blocks):
        m.pool.decref(held[i])
    scales = ((0.25, 0.25),) if fp8 else ()
    mem = KVMemory(
        1,
        num_blocks,
        block_size,
        1,
        6,
        latent_dim=4,
        kv_dtype=F8 if fp8 else None,
        kv_scales=scales,
    )
    for seq, (context, new) in enumerate(work):
        m.add_sequence(seq, [0] * (context + new))
        slots = m.append_slots(seq, [0] * context)
        m.mark_written(seq)
        slots += m.append_slots(seq, [0] * new)
        mem.write(
            0,
            rng.standard_normal((context + new, 1, 4)),
            rng.standard_normal((context + new, 1, 2)),
            slots,
        )
    batch = build_batch(m, [(seq, new) for seq, (_, new) in enumerate(work)])
    return rng.standard_normal((batch.num_tokens, heads, 6)), batch, mem


@given(
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 3, 4]),
    work=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 5)), min_size=1, max_size=4),
    fp8=st.booleans(),
)
def test_paged_latent_attention_is_attend_latent_per_sequence_and_the_suite_paths_agree(
    data: st.DataObject, seed: int, block_size: int, work: list[tuple[int, int]], fp8: bool
) -> None:
    """The definition through the tables, the batched reference and the exact emulation."""
    q, batch, mem = _latent_setup(seed, block_size, work, fp8)
    variant = data.draw(_variants(3))
    want = paged_attention(q, batch, mem, 0, 0.3, variant=variant)
    assert want.shape == (batch.num_tokens, 3, 4)
    got = paged_attention_batched(q, batch, mem, 0, 0.3, variant=variant)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for i in range(batch.num_seqs):
        a, b = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        c_kv, k_rope = mem.gather(0, batch.block_tables[i], batch.seq_lens[i])
        positions = np.asarray(batch.positions[a:b])
        one = attend_latent(q[a:b], c_kv, k_rope, positions, 0.3, variant)
        np.testing.assert_allclose(want[a:b], one, rtol=1e-12, atol=1e-12)
        key, value = latent_kv(c_kv, k_rope)
        exact = attend_at_precision(q[a:b], key, value, positions, 0.3, variant, precision=EXACT)
        np.testing.assert_allclose(exact, one, rtol=1e-12, atol=1e-12)


def test_latent_attention_needs_the_models_scale_and_a_row_wide_query() -> None:
    q, batch, mem = _latent_setup(0, 2, [(3, 1)], fp8=False)
    with pytest.raises(ArgumentValueError, match="needs the model's softmax scale"):
        paged_attention(q, batch, mem, 0)
    with pytest.raises(InvalidRequestError, match=r"\(q_latent 4 \+ q_rope 2\)"):
        paged_attention(q[..., :4], batch, mem, 0, 0.3)


def test_block_tables_and_copy_on_write_serve_latent_rows_unchanged() -> None:
    """A fork shares the prompt's blocks; each branch's divergent write copies the shared last
    block, and each branch's attention reads its own rows: the latent layout changes no rule."""
    rng = np.random.default_rng(1)
    m, mem = BlockManager(8, 4), KVMemory(1, 8, 4, 1, 6, latent_dim=4)
    rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def step(scheduled: list[tuple[int, list[int]]]) -> None:
        for seq, tokens in scheduled:
            m.append_slots(seq, tokens)
        batch = build_batch(m, [(seq, len(tokens)) for seq, tokens in scheduled])
        mem.copy_blocks(batch.copies)
        c = rng.standard_normal((batch.num_tokens, 1, 4))
        r = rng.standard_normal((batch.num_tokens, 1, 2))
        mem.write(0, c, r, batch.slot_mapping)
        for i, (seq, _) in enumerate(scheduled):
            a, b = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            old = rows.get(seq, (np.zeros((0, 1, 4)), np.zeros((0, 1, 2))))
            rows[seq] = (np.concatenate([old[0], c[a:b]]), np.concatenate([old[1], r[a:b]]))
        q = rng.standard_normal((batch.num_tokens, 2, 6))
        out = paged_attention(q, batch, mem, 0, 0.5)
        for i, (seq, _) in enumerate(scheduled):
            a, b = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            positions = np.asarray(batch.positions[a:b])
            want = attend_latent(q[a:b], *rows[seq], positions, 0.5)
            np.testing.assert_allclose(out[a:b], want, rtol=1e-12)

    m.add_sequence(0, [])
    step([(0, [1, 2, 3, 4, 5, 6])])
    m.fork(0, 1)
    rows[1] = rows[0]
    step([(0, [7]), (1, [8])])  # both write into the shared block 1: one copy
    assert m.block_table(0)[0] == m.block_table(1)[0]  # the full first block is still shared
    assert m.block_table(0)[1] != m.block_table(1)[1]


def test_capabilities_declare_latent_pairs() -> None:
    g = KVGeometry(1, 4, 16, 1, 48, latent_dim=32)
    assert Capabilities("none").unsupported(g, 8) == ["latent layout 32+16"]
    assert Capabilities("any", latent=None).unsupported(g, 8) == []
    some = Capabilities("some", latent={(32, 16)}, head_dims={64}, max_gqa_ratio=2)
    assert some.latent == frozenset({(32, 16)})
    assert some.unsupported(g, 8) == []  # head dims and GQA limits are the ordinary layout's
    assert some.unsupported(dataclasses.replace(g, latent_dim=16), 8) == ["latent layout 16+32"]
    for latent, message in [([(512,)], r"latent\[0\] must be a \(latent_dim, rope_dim\)"),
                            ([(512, 0)], r"latent\[0\]\[1\] must be >= 1")]:  # fmt: skip
        with pytest.raises(InvalidRequestError, match=message):
            Capabilities("bad", latent=latent)  # type: ignore[arg-type]


def test_the_reference_backend_writes_and_reads_latent_rows() -> None:
    backend = ReferenceBackend()
    assert backend.capabilities.latent is None  # any latent layout
    backend.create_cache(KVGeometry(1, 2, 2, 1, 3, latent_dim=2))
    backend.write_kv(0, np.array([[[1.0, 2.0]]]), np.array([[[9.0]]]), [3])
    c_kv, k_rope = backend.read_cache(0)
    assert c_kv.shape == (2, 2, 1, 2) and k_rope.shape == (2, 2, 1, 1)
    assert c_kv[1, 1, 0].tolist() == [1.0, 2.0] and k_rope[1, 1, 0].tolist() == [9.0]
    with pytest.raises(InvalidRequestError, match="value has shape"):
        backend.write_kv(0, np.ones((1, 1, 2)), np.ones((1, 1, 2)), [0])
