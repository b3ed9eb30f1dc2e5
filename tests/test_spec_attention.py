"""The KV memory model, batch layout and reference attention, against independent loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.attention import paged_attention
from spec.backend import Backend, ReferenceBackend
from spec.batch import PAD_BLOCK, build_batch
from spec.block_manager import PAD_SLOT, BlockManager
from spec.capabilities import Capabilities
from spec.errors import InvalidRequestError, UnknownBlockError, UnknownSequenceError
from spec.kv_budget import cdiv
from spec.kv_geometry import KVGeometry
from spec.kv_memory import KVMemory


def _naive_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: int, kv_head: int, scale: float
) -> np.ndarray:
    """One query vector against keys 0..pos of one KV head, with explicit loops."""
    scores = [float(q @ k[t, kv_head]) * scale for t in range(pos + 1)]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return sum(w / total * v[t, kv_head] for t, w in enumerate(weights))  # type: ignore[no-any-return]


@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 3, 4, 8]),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    work=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 20)), min_size=1, max_size=4),
)
def test_paged_attention_matches_loops_through_shuffled_tables(
    seed: int, block_size: int, num_kv_heads: int, group: int, work: list[tuple[int, int]]
) -> None:
    """Sequences of (context, new tokens) in shuffled blocks; every output token checked."""
    rng = np.random.default_rng(seed)
    head_dim, num_heads = 4, num_kv_heads * group
    num_blocks = sum(cdiv(c + n, block_size) for c, n in work) + 3
    m = BlockManager(num_blocks, block_size)
    held = [m.pool.allocate() for _ in range(num_blocks)]
    for i in rng.permutation(num_blocks):  # free in random order: tables get scattered ids
        m.pool.decref(held[i])
    mem = KVMemory(1, num_blocks, block_size, num_kv_heads, head_dim)
    k_all, v_all, scheduled = {}, {}, []
    for seq, (context, new) in enumerate(work):
        m.add_sequence(seq, [0] * (context + new))
        slots = m.append_slots(seq, [0] * context)
        m.mark_written(seq)  # the context's KV is written directly below, not by this step
        slots += m.append_slots(seq, [0] * new)
        k_all[seq] = rng.standard_normal((context + new, num_kv_heads, head_dim))
        v_all[seq] = rng.standard_normal((context + new, num_kv_heads, head_dim))
        mem.write(0, k_all[seq], v_all[seq], slots)
        scheduled.append((seq, new))
    batch = build_batch(m, scheduled)
    q = rng.standard_normal((batch.num_tokens, num_heads, head_dim))
    scale = 0.3
    out = paged_attention(q, batch, mem, layer=0, scale=scale)
    for i, seq in enumerate(batch.seq_ids):
        for row in range(batch.query_start_loc[i], batch.query_start_loc[i + 1]):
            pos = batch.positions[row]
            for h in range(num_heads):
                want = _naive_attention(q[row, h], k_all[seq], v_all[seq], pos, h // group, scale)
                np.testing.assert_allclose(
                    out[row, h],
                    want,
                    rtol=1e-12,
                    atol=1e-12,
                    err_msg=f"sequence {seq}, token {pos}, head {h}",
                )


def test_write_skips_padding_and_counts_tokens_from_slot_mapping() -> None:
    mem = KVMemory(1, 2, 2, 1, 1)
    kv = np.arange(4.0).reshape(4, 1, 1)  # 4 rows, but only 3 slot-mapping entries
    mem.write(0, kv, kv, [0, PAD_SLOT, 3])
    flat = mem.k[0].reshape(-1)
    assert flat[0] == 0.0 and flat[3] == 2.0
    assert np.isnan(flat[1]) and np.isnan(flat[2]), "padding wrote, or extra rows were used"


@pytest.mark.parametrize("slots", [[4], [-2], [100]])
def test_write_rejects_slots_outside_the_pool(slots: list[int]) -> None:
    mem = KVMemory(1, 2, 2, 1, 1)
    before = mem.k[0].copy()
    with pytest.raises(InvalidRequestError, match="outside"):
        mem.write(0, np.zeros((1, 1, 1)), np.zeros((1, 1, 1)), slots)
    assert np.array_equal(mem.k[0], before, equal_nan=True)


def test_write_rejects_wrong_shapes_and_layers() -> None:
    mem = KVMemory(2, 2, 2, 2, 4)
    with pytest.raises(InvalidRequestError, match="key has shape"):
        mem.write(0, np.zeros((1, 1, 4)), np.zeros((1, 2, 4)), [0])
    with pytest.raises(InvalidRequestError, match="value has shape"):
        mem.write(0, np.zeros((2, 2, 4)), np.zeros((1, 2, 4)), [0, 1])
    with pytest.raises(InvalidRequestError, match=r"layer must be in 0\.\.1, got 2"):
        mem.write(2, np.zeros((1, 2, 4)), np.zeros((1, 2, 4)), [0])
    with pytest.raises(UnknownBlockError):
        mem.copy_blocks([(0, 5)])


def test_build_batch_rejects_bad_schedules() -> None:
    m = BlockManager(4, 4)
    m.add_sequence(0, [1, 2])
    m.append_slots(0, [1, 2])
    with pytest.raises(InvalidRequestError, match="scheduled twice"):
        build_batch(m, [(0, 2), (0, 2)])
    with pytest.raises(InvalidRequestError, match=r"sequence 0 must be in 1\.\.2, got 3"):
        build_batch(m, [(0, 3)])
    with pytest.raises(InvalidRequestError, match="1 new tokens scheduled, but 2 were appended"):
        build_batch(m, [(0, 1)])  # token 0 would never get its KV written
    with pytest.raises(UnknownSequenceError):
        build_batch(m, [(9, 1)])
    batch = build_batch(m, [(0, 2)])
    assert batch.block_tables == ((0,),) and batch.is_decode_only is False
    assert PAD_BLOCK == -1


def test_reference_backend_satisfies_the_protocol() -> None:
    backend = ReferenceBackend()
    assert isinstance(backend, Backend)
    with pytest.raises(InvalidRequestError, match="create_cache"):
        backend.read_cache(0)
    geometry = KVGeometry(num_layers=1, num_blocks=2, block_size=2, num_kv_heads=2, head_dim=4)
    assert geometry.bytes_per_token == 2 * 2 * 4 * 4
    assert Capabilities("x", max_gqa_ratio=2).unsupported(geometry, num_heads=8) == ["GQA ratio 4"]
    with pytest.raises(InvalidRequestError, match="dtype"):
        KVGeometry(1, 1, 1, 1, 1, dtype="int8")


def test_reference_refuses_a_batch_laid_out_for_another_block_size() -> None:
    """The manager's block size passed where the memory's was meant: a known bug class."""
    m = BlockManager(4, 4)
    m.add_sequence(0, [1, 2, 3])
    m.append_slots(0, [1, 2, 3])
    mem = KVMemory(1, 8, 2, 1, 1)
    with pytest.raises(InvalidRequestError, match="block size 4"):
        paged_attention(np.zeros((3, 1, 1)), build_batch(m, [(0, 3)]), mem, layer=0)


@pytest.mark.parametrize("table", [[0, PAD_BLOCK], [0, 2]])
def test_gather_never_dereferences_padding_or_unknown_blocks(table: list[int]) -> None:
    mem = KVMemory(1, 2, 2, 1, 1)
    with pytest.raises(UnknownBlockError, match=r"outside 0\.\.1"):
        mem.gather(0, table, num_tokens=3)
    mem.gather(0, [1, PAD_BLOCK], num_tokens=2)  # padding past the used blocks is fine
