"""The suite's attention tools equal the plain definition they compute faster or emulate.

:func:`spec.attention_batched.paged_attention_batched` (decodes of many
sequences padded together, groups under a memory bound) and
:func:`spec.attention_batched.attend_at_precision` at
:data:`spec.precision.EXACT` must give what :func:`spec.attention.paged_attention`
and :func:`spec.attention.attend` give, for every variant, GQA ratio and KV
dtype (fp8 included); at a lower :class:`spec.precision.Precision` they must
stay within that precision's error of the definition of what they round.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import spec.attention_batched as batched
from spec.attention import AttentionVariant, alibi_slopes, attend, paged_attention
from spec.attention_batched import attend_at_precision, paged_attention_batched
from spec.batch import BatchMetadata, build_batch
from spec.block_manager import BlockManager
from spec.errors import ArgumentValueError, InvalidRequestError
from spec.kv_budget import cdiv
from spec.kv_memory import KVMemory
from spec.precision import EXACT, Precision
from spec.quant import FP8_FORMATS

HEAD_DIM = 4


@st.composite
def variants(draw: st.DrawFn, num_heads: int) -> AttentionVariant:
    """Any combination of the four variants, with distinct per-head sinks and slopes."""
    sinks = draw(st.one_of(st.none(), st.sampled_from([-3.0, 0.0, 4.0])))
    return AttentionVariant(
        window=draw(st.one_of(st.none(), st.integers(1, 9))),
        softcap=draw(st.one_of(st.none(), st.sampled_from([0.5, 2.0, 30.0]))),
        sinks=None if sinks is None else tuple(sinks + i / 2 for i in range(num_heads)),
        alibi_slopes=alibi_slopes(num_heads) if draw(st.booleans()) else None,
    )


def _setup(
    seed: int,
    block_size: int,
    num_kv_heads: int,
    group: int,
    work: list[tuple[int, int]],
    kv_dtype: str | None,
) -> tuple[np.ndarray, BatchMetadata, KVMemory]:
    """Sequences of (context, new tokens) in shuffled blocks, their K and V written."""
    rng = np.random.default_rng(seed)
    num_blocks = sum(cdiv(c + n, block_size) for c, n in work) + 3
    m = BlockManager(num_blocks, block_size)
    held = [m.pool.allocate() for _ in range(num_blocks)]
    for i in rng.permutation(num_blocks):  # free in random order: tables get scattered ids
        m.pool.decref(held[i])
    scales = ((0.5, 2.0),) if kv_dtype else ()
    mem = KVMemory(
        1, num_blocks, block_size, num_kv_heads, HEAD_DIM, kv_dtype=kv_dtype, kv_scales=scales
    )
    for seq, (context, new) in enumerate(work):
        m.add_sequence(seq, [0] * (context + new))
        slots = m.append_slots(seq, [0] * context)
        m.mark_written(seq)
        slots += m.append_slots(seq, [0] * new)
        k, v = (rng.standard_normal((context + new, num_kv_heads, HEAD_DIM)) for _ in "kv")
        mem.write(0, k, v, slots)
    batch = build_batch(m, [(seq, new) for seq, (_, new) in enumerate(work)])
    q = rng.standard_normal((batch.num_tokens, num_kv_heads * group, HEAD_DIM))
    return q, batch, mem


@st.composite
def batches(draw: st.DrawFn) -> tuple[np.ndarray, BatchMetadata, KVMemory]:
    """A query, a batch of mixed decodes and prefill chunks, and its KV memory (maybe fp8)."""
    return _setup(
        draw(st.integers(0, 2**32 - 1)),
        draw(st.sampled_from([1, 3, 4, 8])),
        draw(st.sampled_from([1, 2])),  # KV heads
        draw(st.sampled_from([1, 2, 4])),  # query heads per KV head
        draw(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 6)), min_size=1, max_size=6)),
        draw(st.sampled_from([None, *FP8_FORMATS])),
    )


@given(data=st.data(), case=batches(), tiny_groups=st.booleans())
def test_batched_paged_attention_equals_the_definition(
    data: st.DataObject, case: tuple[np.ndarray, BatchMetadata, KVMemory], tiny_groups: bool
) -> None:
    """Every variant, GQA ratio and KV dtype; decodes padded together or one group each, a
    prefill chunk's queries in one tile or in tiles of one to three queries."""
    q, batch, mem = case
    variant = data.draw(variants(q.shape[1]))
    with pytest.MonkeyPatch.context() as patch:
        if tiny_groups:  # the memory bound splits every decode into a group of its own
            patch.setattr(batched, "_DECODE_CHUNK_ELEMENTS", 1)
            scores_per_query = max(batch.seq_lens) * q.shape[1]  # at most: the tile bound
            tile = data.draw(st.integers(1, 3), label="queries per tile")
            patch.setattr(batched, "_PREFILL_TILE_SCORES", tile * scores_per_query)
        got = paged_attention_batched(q, batch, mem, 0, 0.3, variant=variant)
    want = paged_attention(q, batch, mem, 0, 0.3, variant=variant)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@given(data=st.data(), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), ctx=st.integers(0, 12))
def test_attend_at_exact_precision_is_attend(
    data: st.DataObject, seed: int, n: int, ctx: int
) -> None:
    rng = np.random.default_rng(seed)
    variant = data.draw(variants(4))
    first = data.draw(st.integers(0, ctx))  # keys before it are not passed (a window's gather)
    q = rng.standard_normal((n, 4, HEAD_DIM))
    k, v = (rng.standard_normal((ctx + n - first, 2, HEAD_DIM)) for _ in "kv")
    positions = np.arange(ctx, ctx + n)
    want = attend(q, k, v, positions, 0.4, variant, first_key=first)
    got = attend_at_precision(q, k, v, positions, 0.4, variant, first_key=first, precision=EXACT)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _round_f32(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = x.astype(np.float32).astype(np.float64)
    return out


@given(data=st.data(), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), ctx=st.integers(0, 12))
def test_a_lower_precision_stays_within_its_error_of_the_definition(
    data: st.DataObject, seed: int, n: int, ctx: int
) -> None:
    """float32 arithmetic, K and V rounded as read, P rounded before P @ V: each within float32
    error of the definition applied to what it rounds."""
    rng = np.random.default_rng(seed)
    variant = data.draw(variants(4))
    q = rng.standard_normal((n, 4, HEAD_DIM))
    k, v = (rng.standard_normal((ctx + n, 2, HEAD_DIM)) for _ in "kv")
    positions = np.arange(ctx, ctx + n)
    want = attend(q, _round_f32(k), _round_f32(v), positions, 0.4, variant)
    for precision in (
        Precision("float32"),
        Precision("float32", round_kv=_round_f32),
        Precision("float32", round_kv=_round_f32, round_p=_round_f32),
    ):
        got = attend_at_precision(q, k, v, positions, 0.4, variant, precision=precision)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=str(precision))


def test_a_precision_names_a_known_arithmetic() -> None:
    with pytest.raises(ArgumentValueError, match="compute"):
        Precision("float16")


def test_the_batched_path_refuses_what_the_definition_refuses() -> None:
    q, batch, mem = _setup(0, 4, 2, 2, [(3, 1), (0, 4)], None)
    for bad in (q[:, :3], q[:, :, :3]):
        for fn in (paged_attention, paged_attention_batched):
            with pytest.raises(InvalidRequestError):
                fn(bad, batch, mem, 0)
