"""The Triton kernel API against the spec: KV write and block copy bit for bit, attention token
by token against float64 reference attention, with poisoned memory around every output.

Under the interpreter every program costs milliseconds, so shapes come from
small fixed sets; Hypothesis example counts are a quarter of the profile's.
Every tensor is built on :data:`devices.DEVICE` (the CPU interpreted, the GPU
compiled), so each check and each refusal is the device's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from backend_helpers import (
    TORCH_DTYPES,
    Scenario,
    assert_attention_close,
    bits,
    fewer_examples,
    make_scenario,
)
from devices import DEVICE, ON_GPU
from hypothesis import given
from hypothesis import strategies as st

from backend_gpu.kernels import (
    choose_num_splits,
    compute_slot_mapping,
    copy_blocks,
    paged_attention,
    reshape_and_cache,
)
from backend_gpu.kernels.target import TARGET_ENV
from spec.attention import paged_attention as reference_attention
from spec.errors import InvalidRequestError, UnknownBlockError

FEW = fewer_examples(4, minimum=4)
DTYPES = ["float32", "float16", "bfloat16"]


def _cache_tensors(s: Scenario, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference memory in the cache dtype; never-written slots stay NaN (poison)."""
    dt = TORCH_DTYPES[s.dtype]
    k = torch.from_numpy(s.memory.k[layer]).to(DEVICE, dt).contiguous()
    v = torch.from_numpy(s.memory.v[layer]).to(DEVICE, dt).contiguous()
    return k, v


def _metadata(s: Scenario) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = s.batch
    qsl = torch.tensor(b.query_start_loc, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(b.seq_lens, dtype=torch.int32, device=DEVICE)
    tables = torch.tensor(b.block_tables, dtype=torch.int32, device=DEVICE)
    return qsl, lens, tables.reshape(b.num_seqs, -1)


def _check_attention(
    s: Scenario, num_splits: int, scale: float = 0.37, pad_rows: int = 2, block_n: int = 16
) -> None:
    """Kernel output == reference for every real row; padding rows of ``out`` stay NaN.

    Key tiles of 16 by default, so that most contexts take several loop steps
    (the online-softmax rescaling is only exercised across steps).
    """
    dt = TORCH_DTYPES[s.dtype]
    k, v = _cache_tensors(s)
    qsl, lens, tables = _metadata(s)
    t = s.batch.num_tokens
    q = torch.zeros(t + pad_rows, s.num_heads, s.memory.shape[3], dtype=dt, device=DEVICE)
    q[:t] = torch.from_numpy(s.queries[0]).to(DEVICE, dt)
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, k, v, qsl, lens, tables, scale, out=out, num_splits=num_splits, block_n=block_n
    )
    want = reference_attention(s.queries[0], s.batch, s.memory, 0, scale)
    got = out[:t].float().cpu().numpy()
    assert_attention_close(got, want, s.dtype, s.batch, 0, f"attention, {num_splits} splits")
    assert bool(out[t:].isnan().all()), "the kernel wrote padding rows past the batch's tokens"


# -- KV write -----------------------------------------------------------------------------


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(DTYPES),
    block_size=st.sampled_from([1, 3, 16]),
    num_tokens=st.integers(0, 12),
    num_pad_rows=st.integers(0, 3),
)
def test_kv_write_matches_a_loop_bit_for_bit(
    seed: int, dtype: str, block_size: int, num_tokens: int, num_pad_rows: int
) -> None:
    """Slot -1 writes nothing; rows past len(slot_mapping) are never read; nothing else moves."""
    gen = torch.Generator().manual_seed(seed)
    dt, heads, dim, num_blocks = TORCH_DTYPES[dtype], 2, 24, 7
    num_slots = num_blocks * block_size
    chosen = torch.randperm(num_slots, generator=gen)[: min(num_tokens, num_slots)]
    slots = torch.where(torch.rand(len(chosen), generator=gen) < 0.25, -1, chosen)
    rows = len(slots) + num_pad_rows
    key = torch.randn(rows, heads, dim, generator=gen).to(dt)
    value = torch.randn(rows, heads, dim, generator=gen).to(dt)
    k_cache = torch.full((num_blocks, block_size, heads, dim), float("nan"), dtype=dt)
    v_cache = k_cache.clone()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot != -1:
            want_k[slot // block_size, slot % block_size] = key[i]
            want_v[slot // block_size, slot % block_size] = value[i]
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    reshape_and_cache(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(bits(k_cache.cpu()), bits(want_k)), "K cache differs from the loop"
    assert torch.equal(bits(v_cache.cpu()), bits(want_v)), "V cache differs from the loop"


def test_kv_write_accepts_rows_strided_out_of_a_fused_buffer() -> None:
    """K and V as column slices of one [T, 2, H_kv, D] buffer (rows strided, D dense)."""
    kv = torch.randn(3, 2, 2, 8, device=DEVICE)
    k_cache = torch.full((2, 2, 2, 8), float("nan"), device=DEVICE)
    v_cache = k_cache.clone()
    slots = torch.tensor([3, 0, 2], device=DEVICE)
    reshape_and_cache(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 1], kv[0, 0]) and torch.equal(v_cache[1, 0], kv[2, 1])
    assert bool(k_cache[0, 1].isnan().all())


# -- block copy ---------------------------------------------------------------------------


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(DTYPES),
    block_size=st.sampled_from([1, 3, 16]),
    num_copies=st.integers(0, 4),
)
def test_copy_blocks_matches_indexing_bit_for_bit(
    seed: int, dtype: str, block_size: int, num_copies: int
) -> None:
    """Every layer's K and V get every copy; blocks not named as a destination are untouched."""
    gen = torch.Generator().manual_seed(seed)
    dt, layers, num_blocks = TORCH_DTYPES[dtype], 2, 9
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    copies = list(zip(ids[:num_copies], ids[num_copies : 2 * num_copies], strict=True))
    shape = (num_blocks, block_size, 2, 24)
    ks = [torch.randn(*shape, generator=gen).to(dt) for _ in range(layers)]
    vs = [torch.randn(*shape, generator=gen).to(dt) for _ in range(layers)]
    want = [x.clone() for x in (*ks, *vs)]
    for x in want:
        for src, dst in copies:
            x[dst] = x[src]
    ks, vs = [x.to(DEVICE) for x in ks], [x.to(DEVICE) for x in vs]
    copy_blocks(ks, vs, copies)
    for i, (got, exp) in enumerate(zip((*ks, *vs), want, strict=True)):
        kind, layer = "KV"[i // layers], i % layers
        assert torch.equal(bits(got.cpu()), bits(exp)), f"{kind} of layer {layer}, {copies}"


@pytest.mark.parametrize(
    ("copies", "error", "match"),
    [
        ([(0, 9)], UnknownBlockError, "outside"),
        ([(-1, 2)], UnknownBlockError, "outside"),
        ([(0, 1), (1, 2)], InvalidRequestError, "both a source and a destination"),
        ([(0, 2), (1, 2)], InvalidRequestError, "appears twice"),
    ],
)
def test_copy_blocks_rejects_bad_copies_and_changes_nothing(
    copies: list[tuple[int, int]], error: type[Exception], match: str
) -> None:
    k = torch.randn(9, 2, 1, 8, device=DEVICE)
    v = torch.randn(9, 2, 1, 8, device=DEVICE)
    before = (k.clone(), v.clone())
    with pytest.raises(error, match=match):
        copy_blocks([k], [v], copies)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


# -- slot mapping -------------------------------------------------------------------------


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    block_size=st.sampled_from([1, 3, 16]),
    work=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=5),
)
def test_slot_mapping_kernel_matches_the_spec(
    seed: int, block_size: int, work: list[tuple[int, int]]
) -> None:
    """Positions seq_len - query_len + j, through shuffled tables, as int64."""
    s = make_scenario(seed, work, block_size=block_size, num_kv_heads=1, group=1, head_dim=1)
    qsl, lens, tables = _metadata(s)
    got = compute_slot_mapping(tables, qsl, lens, block_size)
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == list(s.batch.slot_mapping)


# -- attention ----------------------------------------------------------------------------


def _lengths(b: int) -> list[int]:
    """Sequence lengths at and around block boundaries: 1, B-1, B, B+1, 2B, 3B+1."""
    return sorted({n for n in (1, b - 1, b, b + 1, 2 * b, 3 * b + 1) if n >= 1})


def _work(mode: str, b: int) -> list[tuple[int, int]]:
    lens = _lengths(b)
    if mode == "decode":
        return [(n - 1, 1) for n in lens]
    if mode == "prefill":
        return [(0, n) for n in lens]
    # mixed: decodes, whole prefills, and chunks that start mid-block
    return [(lens[-1] - 1, 1), (0, b + 1), (b + 1, b + 2), (2 * b + 1, 1), (1, 2 * b)]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("mode", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_attention_at_block_boundaries(block_size: int, mode: str, num_splits: int) -> None:
    s = make_scenario(
        11, _work(mode, block_size), block_size=block_size, num_kv_heads=2, group=2, head_dim=24
    )
    _check_attention(s, num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_every_dtype_and_gqa_ratio(dtype: str, group: int, num_splits: int) -> None:
    work = [(37, 1), (0, 9), (20, 5), (3, 1)]
    s = make_scenario(
        group, work, block_size=16, num_kv_heads=2, group=group, head_dim=32, dtype=dtype
    )
    _check_attention(s, num_splits)


@pytest.mark.parametrize("head_dim", [8, 24, 96, 128])
def test_attention_head_dims_including_non_powers_of_two(head_dim: int) -> None:
    s = make_scenario(
        head_dim, [(9, 1), (0, 6)], block_size=3, num_kv_heads=1, group=4, head_dim=head_dim
    )
    _check_attention(s, num_splits=1)
    _check_attention(s, num_splits=2)


def test_attention_more_splits_than_keys_leaves_empty_splits_harmless() -> None:
    """A split with no visible key has weight zero (no NaN from an empty online softmax)."""
    s = make_scenario(
        5, [(0, 1), (2, 1), (0, 3)], block_size=3, num_kv_heads=1, group=2, head_dim=8
    )
    _check_attention(s, num_splits=16)


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(DTYPES),
    block_size=st.sampled_from([1, 3, 16]),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4, 8]),
    num_splits=st.sampled_from([1, 2, 5]),
    block_n=st.sampled_from([16, 64]),
    work=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=4),
)
def test_attention_matches_reference_on_random_batches(
    seed: int,
    dtype: str,
    block_size: int,
    num_kv_heads: int,
    group: int,
    num_splits: int,
    block_n: int,
    work: list[tuple[int, int]],
) -> None:
    s = make_scenario(
        seed,
        work,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=24,
        dtype=dtype,
    )
    _check_attention(s, num_splits, scale=1 / math.sqrt(24), block_n=block_n)


# -- invalid input ------------------------------------------------------------------------


def _small() -> tuple[Scenario, dict[str, Any]]:
    s = make_scenario(1, [(4, 2)], block_size=4, num_kv_heads=2, group=2, head_dim=8)
    k, v = _cache_tensors(s)
    qsl, lens, tables = _metadata(s)
    q = torch.from_numpy(s.queries[0]).to(DEVICE, torch.float32)
    return s, {"query": q, "k_cache": k, "v_cache": v, "query_start_loc": qsl,
               "seq_lens": lens, "block_tables": tables}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: a.update(query=a["query"].half()), "query dtype"),
        (lambda a: a.update(query=a["query"][:, :, :4]), "head dim"),
        (lambda a: a.update(query=a["query"][:, :3]), "multiple of 2 heads"),
        (lambda a: a.update(query=a["query"][:1]), "2 tokens but query has 1 rows"),
        (lambda a: a.update(k_cache=a["k_cache"].transpose(0, 1)), "differ"),
        (lambda a: a.update(v_cache=a["v_cache"][:, :, :, :8:2]), "differ"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables has dtype"),
        (lambda a: a.update(seq_lens=a["seq_lens"] + 3), "table has 2"),
        (lambda a: a.update(seq_lens=a["seq_lens"] - 5), "seq_len 1 < its 2 new tokens"),
        (lambda a: a.update(block_tables=a["block_tables"] + 100), "outside"),
        (lambda a: a.update(block_tables=a["block_tables"] * 0 - 1), "outside"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"].flip(0)), "start at 0"),
        (lambda a: a.update(query=a["query"].to("meta")), "is on meta"),
        (lambda a: a.update(query="not a tensor"), "must be a torch.Tensor"),
    ],
)
def test_attention_rejects_bad_input_clearly(
    change: Callable[[dict[str, Any]], None], match: str
) -> None:
    _, args = _small()
    change(args)
    with pytest.raises(InvalidRequestError, match=match):
        paged_attention(**args, scale=0.5)


def test_attention_rejects_bad_split_counts_and_out_buffers() -> None:
    _, args = _small()
    with pytest.raises(InvalidRequestError, match="num_splits"):
        paged_attention(**args, num_splits=0)
    with pytest.raises(InvalidRequestError, match="block_n"):
        paged_attention(**args, block_n=24)
    with pytest.raises(InvalidRequestError, match="max_query_len, max_seq_len"):
        paged_attention(**args, max_query_len=1)
    big = torch.zeros(1, 1, 1, 512, device=DEVICE)
    with pytest.raises(InvalidRequestError, match="head dim 512"):
        paged_attention(torch.zeros(1, 1, 512, device=DEVICE), big, big, *list(args.values())[3:])
    with pytest.raises(InvalidRequestError, match="out must match"):
        paged_attention(**args, out=torch.empty(1, 4, 8, device=DEVICE))


@pytest.mark.parametrize(
    ("slots", "key_rows", "dtype", "match"),
    [
        ([0, 40], 2, torch.float32, "slot 40 is outside"),
        ([0, -2], 2, torch.float32, "slot -2 is outside"),
        ([0, 1, 2], 2, torch.float32, r"expected \[>= 3"),
        ([0, 1], 2, torch.float16, "key has dtype"),
    ],
)
def test_kv_write_rejects_bad_input_and_changes_nothing(
    slots: list[int], key_rows: int, dtype: torch.dtype, match: str
) -> None:
    k_cache = torch.full((10, 4, 2, 8), float("nan"), device=DEVICE)
    v_cache = k_cache.clone()
    key = torch.ones(key_rows, 2, 8, dtype=dtype, device=DEVICE)
    with pytest.raises(InvalidRequestError, match=match):
        reshape_and_cache(key, key, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    assert bool(k_cache.isnan().all() and v_cache.isnan().all())


def test_a_tensor_on_another_device_than_the_caches_is_refused_naming_both() -> None:
    """The CPU beside a GPU cache (compiled), or ``meta`` beside a CPU cache (interpreted)."""
    other = torch.device("cpu" if ON_GPU else "meta")
    k_cache = torch.full((2, 2, 1, 8), float("nan"), device=DEVICE)
    v_cache = k_cache.clone()
    key, slots = torch.ones(1, 1, 8, device=DEVICE), torch.tensor([1], device=DEVICE)
    expected = f"expected {k_cache.device}"
    with pytest.raises(InvalidRequestError, match=f"slot_mapping is on {other}, {expected}"):
        reshape_and_cache(key, key, k_cache, v_cache, slots.to(other))
    with pytest.raises(InvalidRequestError, match=f"value is on {other}, {expected}"):
        reshape_and_cache(key, key.to(other), k_cache, v_cache, slots)
    assert bool(k_cache.isnan().all() and v_cache.isnan().all())
    _, args = _small()
    with pytest.raises(InvalidRequestError, match=f"seq_lens is on {other}, expected"):
        paged_attention(**{**args, "seq_lens": args["seq_lens"].to(other)}, scale=0.5)


def test_a_process_that_compiles_the_kernels_refuses_cpu_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without ``TRITON_INTERPRET`` (as on a CUDA machine) CPU tensors are refused before any
    launch, saying what to set: the check reads the variable at each call."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    k_cache = torch.full((2, 2, 1, 8), float("nan"))
    key = torch.ones(1, 1, 8)
    with pytest.raises(InvalidRequestError, match="CPU tensors need Triton's interpreter"):
        reshape_and_cache(key, key, k_cache, k_cache.clone(), torch.tensor([0]))
    assert bool(k_cache.isnan().all())


@pytest.mark.gpu_only
def test_cuda_tensors_are_refused_while_the_interpreter_is_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The converse, on a GPU: with ``TRITON_INTERPRET=1`` a kernel cannot take CUDA tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k_cache = torch.full((2, 2, 1, 8), float("nan"), device=DEVICE)
    key = torch.ones(1, 1, 8, device=DEVICE)
    slots = torch.tensor([0], device=DEVICE)
    with pytest.raises(InvalidRequestError, match="kernels cannot run on CUDA tensors"):
        reshape_and_cache(key, key, k_cache, k_cache.clone(), slots)
    assert bool(k_cache.isnan().all())


def test_kv_write_rejects_int32_slots_and_mismatched_caches() -> None:
    k_cache = torch.zeros(2, 2, 1, 8, device=DEVICE)
    key = torch.ones(1, 1, 8, device=DEVICE)
    int32_slots = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    with pytest.raises(InvalidRequestError, match="slot_mapping has dtype"):
        reshape_and_cache(key, key, k_cache, k_cache.clone(), int32_slots)
    with pytest.raises(InvalidRequestError, match="differ"):
        reshape_and_cache(key, key, k_cache, k_cache.half(), torch.tensor([0], device=DEVICE))


def test_slot_mapping_rejects_mismatched_metadata() -> None:
    tables = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(InvalidRequestError, match="need query_start_loc of 3"):
        compute_slot_mapping(tables, torch.zeros(2, dtype=torch.int32, device=DEVICE), lens, 4)
    with pytest.raises(InvalidRequestError, match="block_size must be >= 1"):
        compute_slot_mapping(tables, torch.zeros(3, dtype=torch.int32, device=DEVICE), lens, 0)


def test_slot_mapping_pads_with_minus_one_and_refuses_short_sizes() -> None:
    tables = torch.tensor([[3, 1]], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    padded = compute_slot_mapping(tables, qsl, lens, 4, num_tokens=6, max_query_len=3)
    assert padded.tolist() == [14, 15, 4, -1, -1, -1]  # positions 2, 3, 4; then padding
    with pytest.raises(InvalidRequestError, match="num_tokens 2 is below the batch's 3"):
        compute_slot_mapping(tables, qsl, lens, 4, num_tokens=2)
    with pytest.raises(InvalidRequestError, match="max_query_len 1 is below"):
        compute_slot_mapping(tables, qsl, lens, 4, max_query_len=1)


def test_scenarios_poison_every_unwritten_slot() -> None:
    """Sanity: the scenario's never-written slots are NaN, so reading one would poison output."""
    s = make_scenario(0, [(2, 1)], block_size=4, num_kv_heads=1, group=1, head_dim=8)
    k, _ = _cache_tensors(s)
    flat = k.reshape(-1, 8)
    written = set(s.batch.slot_mapping) | {s.memory.shape[1] * s.batch.block_tables[0][0] + p
                                          for p in range(2)}  # fmt: skip
    unwritten = [i for i in range(flat.shape[0]) if i not in written]
    assert unwritten and bool(flat[unwritten].isnan().all())
    assert np.isfinite(reference_attention(s.queries[0], s.batch, s.memory, 0)).all()


def test_attention_reads_query_rows_strided_out_of_a_fused_qkv_buffer() -> None:
    """Query as a column slice of a [T, 3H, D] buffer: rows strided, head dim dense."""
    s = make_scenario(8, [(5, 3), (0, 2)], block_size=3, num_kv_heads=1, group=2, head_dim=8)
    k, v = _cache_tensors(s)
    qsl, lens, tables = _metadata(s)
    fused = torch.randn(s.batch.num_tokens, 3 * s.num_heads, 8, device=DEVICE)
    fused[:, : s.num_heads] = torch.from_numpy(s.queries[0]).to(DEVICE, torch.float32)
    got = paged_attention(fused[:, : s.num_heads], k, v, qsl, lens, tables, 0.3)
    want = reference_attention(s.queries[0], s.batch, s.memory, 0, 0.3)
    assert_attention_close(got.cpu().numpy(), want, "float32", s.batch, 0, "strided query")


def test_attention_of_an_empty_batch_is_empty() -> None:
    k = torch.full((2, 4, 1, 8), float("nan"), device=DEVICE)
    qsl = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    tables = torch.zeros(0, 1, dtype=torch.int32, device=DEVICE)
    query = torch.zeros(0, 2, 8, device=DEVICE)
    out = paged_attention(query, k, k.clone(), qsl, lens, tables, 0.5)
    assert out.shape == (0, 2, 8)


def test_split_heuristic_fills_a_gpu_only_when_it_would_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Long-context decode of a small batch splits; big batches, prefill, short contexts don't.
    The interpreter plays an H200 by default; its own plan splits every long decode."""
    cpu = torch.device("cpu")
    monkeypatch.setenv(TARGET_ENV, "h200")

    def splits(seqs: int, query_len: int, context: int) -> int:
        return choose_num_splits(seqs, 8, 32, 128, query_len, context, cpu)

    assert splits(1, 1, 32768) == 33  # 8 programs; ceil(264 / 8) splits of >= 512 keys
    assert splits(4, 1, 4096) == 8  # capped at ceil(4096 / 512)
    assert splits(64, 1, 4096) == 1  # 512 programs already fill 132 SMs twice
    assert splits(1, 1, 512) == 1  # too short to pay for the merge
    assert splits(1, 512, 32768) == 1  # prefill tiles bring their own parallelism
    monkeypatch.setenv(TARGET_ENV, "interpreter")
    assert splits(1, 1, 32768) == 4
    assert splits(1, 1, 255) == 1
    assert splits(1, 8, 32768) == 1  # prefill tiles: no split
    monkeypatch.setenv(TARGET_ENV, "h100")
    with pytest.raises(InvalidRequestError, match="PAGED_SPEC_LAUNCH_TARGET='h100'"):
        splits(1, 1, 32768)
