"""The latent layout (multi-head latent attention) in the torch backends, against the spec.

Every call is made on the backend under test and on :class:`ReferenceBackend`:
the latent cache (c_kv and k_rope, as the contract returns them) must agree
bit for bit, NaN for unwritten slots included, and fp8 rows must hold
:func:`spec.quant.quantize` of both parts with the row's one scale; attention
must agree within the dtype's tolerance, named by sequence, token and head.
The Triton kernel runs both launch plans (a GPU's, which the interpreter
plays by default, and the interpreter's own few fat programs), single pass and
split-KV, every variant, and DeepSeek-V3's 512 + 64 rows with 128 query heads.
Backends and tensors are on :data:`devices.DEVICE` (the CPU interpreted, the GPU
compiled; a GPU runs its own plan).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from backend_helpers import (
    TORCH_DTYPES,
    assert_attention_close,
    assert_cache_equal,
    fewer_examples,
    rounded,
    shuffled_manager,
)
from devices import DEVICE
from hypothesis import given
from hypothesis import strategies as st

from backend_gpu.kernels.latent_attention import latent_plan, paged_latent_attention
from backend_gpu.kernels.latent_write import write_latent
from backend_gpu.kernels.target import TARGET_ENV, launch_target
from backend_gpu.torch_backend import TorchBackend
from backend_gpu.triton_backend import TritonBackend
from benchmarks._batches import context_step
from spec.attention import AttentionVariant, alibi_slopes
from spec.attention import paged_attention as reference_attention
from spec.backend import Backend, ReferenceBackend
from spec.batch import BatchMetadata
from spec.errors import InvalidRequestError
from spec.kv_budget import cdiv
from spec.kv_geometry import KVGeometry
from spec.kv_memory import KVMemory

FEW = fewer_examples(6, minimum=4)
LATENT, ROPE, HEADS = 32, 16, 4
SCALE = 0.25  # the model's; deliberately not 1 / sqrt(48)

BACKENDS: dict[str, Callable[[], Backend]] = {
    "triton": lambda: TritonBackend(DEVICE),
    "triton-split": lambda: TritonBackend(DEVICE, num_splits=3),
    "torch": lambda: TorchBackend(DEVICE),
}

VARIANTS = {
    "plain": None,
    "window 5": AttentionVariant(window=5),
    "softcap + sinks": AttentionVariant(softcap=2.0, sinks=(-1.0, 0.0, 2.0, 5.0)),
    "window + alibi": AttentionVariant(window=9, alibi_slopes=alibi_slopes(HEADS)),
}


@dataclass
class LatentStep:
    """One step of a latent model: geometry, batch, earlier rows, this step's rows, queries."""

    geometry: KVGeometry
    batch: BatchMetadata
    context: list[tuple[int, np.ndarray, np.ndarray, list[int]]]  # (layer, c_kv, k_rope, slots)
    c_kv: list[np.ndarray]  # per layer [T, 1, latent]
    k_rope: list[np.ndarray]  # per layer [T, 1, rope]
    queries: list[np.ndarray]  # per layer [T, H, latent + rope]


def _step(
    seed: int,
    work: list[tuple[int, int]],
    *,
    dtype: str = "float32",
    kv_dtype: str | None = None,
    block_size: int = 4,
    latent: int = LATENT,
    rope: int = ROPE,
    heads: int = HEADS,
    num_layers: int = 1,
) -> LatentStep:
    """Sequences of ``(context, new)`` tokens over a shuffled pool, values rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(c + n, block_size) for c, n in work) + 3
    scales = ((0.0625, 0.0625),) * num_layers if kv_dtype else ()
    geometry = KVGeometry(
        num_layers, num_blocks, block_size, 1, latent + rope, dtype, kv_dtype, scales,
        latent_dim=latent,
    )  # fmt: skip
    batch, context_slots = context_step(shuffled_manager(num_blocks, block_size, seed), work)
    context = []
    for (n, _), slots in zip(work, context_slots, strict=True):
        for layer in range(num_layers):
            if n:
                c = rounded(gen, (n, 1, latent), dtype)
                context.append((layer, c, rounded(gen, (n, 1, rope), dtype), slots))
    t = batch.num_tokens
    return LatentStep(
        geometry,
        batch,
        context,
        [rounded(gen, (t, 1, latent), dtype) for _ in range(num_layers)],
        [rounded(gen, (t, 1, rope), dtype) for _ in range(num_layers)],
        [rounded(gen, (t, heads, latent + rope), dtype) for _ in range(num_layers)],
    )


def _run(
    backend: Backend, s: LatentStep, variant: AttentionVariant | None = None
) -> list[np.ndarray]:
    """Earlier rows, then this step's (with padding rows and a ``-1`` slot), then attention."""
    backend.create_cache(s.geometry)
    for layer, c, r, slots in s.context:
        backend.write_kv(layer, c.astype(np.float32), r.astype(np.float32), slots)
    outs = []
    slots = [*s.batch.slot_mapping, -1]
    for layer in range(s.geometry.num_layers):
        c = np.concatenate([s.c_kv[layer], np.full((3, 1, s.geometry.value_dim), 1e6)])
        r = np.concatenate([s.k_rope[layer], np.full((3, *s.k_rope[layer].shape[1:]), 1e6)])
        backend.write_kv(layer, c.astype(np.float32), r.astype(np.float32), slots)
        kw = {} if variant is None else {"variant": variant}
        q = s.queries[layer].astype(np.float32)
        outs.append(np.asarray(backend.attention(layer, q, s.batch, SCALE, **kw)))
    return outs


def _check(backend: Backend, s: LatentStep, variant: AttentionVariant | None = None) -> None:
    outs, ref = _run(backend, s, variant), ReferenceBackend()
    want = _run(ref, s, variant)
    what = f"{backend.capabilities.name}, {variant}, {s.geometry.kv_dtype or 'unquantized'} rows"
    for layer, (got, w) in enumerate(zip(outs, want, strict=True)):
        assert got.shape == (s.batch.num_tokens, s.queries[layer].shape[1], s.geometry.value_dim)
        assert_attention_close(got, w, s.geometry.dtype, s.batch, layer, what)
        parts = zip(
            ("c_kv", "k_rope"), backend.read_cache(layer), ref.read_cache(layer), strict=True
        )
        for name, g, r in parts:
            assert_cache_equal(np.asarray(g), r, name, layer, what)


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@FEW
@given(
    seed=st.integers(0, 2**32 - 1),
    work=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), min_size=1, max_size=4),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    kv_dtype=st.sampled_from([None, "fp8_e4m3", "fp8_e5m2"]),
    variant=st.sampled_from(list(VARIANTS)),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_random_latent_steps_match_the_reference(
    backend_name: str,
    seed: int,
    work: list[tuple[int, int]],
    dtype: str,
    kv_dtype: str | None,
    variant: str,
    block_size: int,
) -> None:
    """Mixed prefills, chunks after context and decodes; every dtype, fp8 rows, the variants."""
    s = _step(seed, work, dtype=dtype, kv_dtype=kv_dtype, block_size=block_size, num_layers=2)
    _check(BACKENDS[backend_name](), s, VARIANTS[variant])


@pytest.mark.parametrize(
    ("plan", "splits"),
    [("h200", 3), pytest.param("interpreter", 4, marks=pytest.mark.needs_interpreter)],
)
def test_long_decodes_split_by_either_plan_match_the_reference(
    plan: str, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,100- and 300-key decodes: the GPU plan splits them to fill 132 SMs, the interpreter's
    own (one fat program of every head) splits a 256+-key decode so that the merge runs."""
    monkeypatch.setenv(TARGET_ENV, plan)
    s = _step(3, [(1100, 1), (300, 1)], dtype="float16", block_size=16)
    chosen = latent_plan(2, HEADS, LATENT, 1, 1101, launch_target(torch.device("cpu")))
    assert chosen.num_splits == splits
    _check(TritonBackend(DEVICE), s, AttentionVariant(sinks=(0.5, -1.0, 3.0, 0.0)))


def test_deepseek_v3_rows_with_128_query_heads_match_the_reference() -> None:
    """512 + 64 rows in bfloat16, 128 query heads sharing them: two decodes and a short chunk."""
    s = _step(5, [(70, 1), (0, 3)], dtype="bfloat16", latent=512, rope=64, heads=128, block_size=64)
    for backend in (
        TritonBackend(DEVICE),
        TritonBackend(DEVICE, num_splits=2),
        TorchBackend(DEVICE),
    ):
        _check(backend, s)


def test_the_kernel_walks_many_key_tiles_and_leaves_padding_rows_alone() -> None:
    """16-key tiles over contexts with windows, so tiles wholly before a window are skipped."""
    s = _step(7, [(60, 1), (5, 30), (33, 2)], block_size=3)
    mem = KVMemory(1, s.geometry.num_blocks, 3, 1, LATENT + ROPE, latent_dim=LATENT)
    for layer, c, r, slots in s.context:
        mem.write(layer, c, r, slots)
    mem.write(0, s.c_kv[0], s.k_rope[0], s.batch.slot_mapping)
    cache = torch.from_numpy(mem.rows[0][:, :, 0]).to(DEVICE, torch.float32)
    a = s.batch.arrays()
    qsl, lens, tables = (
        torch.from_numpy(x).to(DEVICE) for x in (a.query_start_loc, a.seq_lens, a.block_tables)
    )
    t = s.batch.num_tokens
    q = torch.zeros(t + 2, HEADS, LATENT + ROPE, device=DEVICE)
    q[:t] = torch.from_numpy(s.queries[0]).to(DEVICE)
    for window, splits in ((None, 1), (4, 1), (17, 2), (None, 3)):
        out = torch.full((t + 2, HEADS, LATENT), float("nan"), device=DEVICE)
        paged_latent_attention(
            q, cache, qsl, lens, tables, SCALE, latent_dim=LATENT, out=out, block_n=16,
            window=window, num_splits=splits,
        )  # fmt: skip
        variant = AttentionVariant(window=window)
        want = reference_attention(s.queries[0], s.batch, mem, 0, SCALE, variant=variant)
        what = f"window {window}, {splits} splits"
        assert_attention_close(out[:t].cpu().numpy(), want, "float32", s.batch, 0, what)
        assert bool(out[t:].isnan().all()), "the kernel wrote padding rows past the batch's tokens"


@pytest.mark.parametrize("make", [TritonBackend, TorchBackend], ids=["triton", "torch"])
def test_copies_move_whole_latent_rows(make: Callable[..., Backend]) -> None:
    s = _step(11, [(9, 1)], kv_dtype="fp8_e4m3", num_layers=2)
    backend, ref = make(DEVICE), ReferenceBackend()
    for b in (backend, ref):
        _run(b, s)
        b.copy_blocks([(s.batch.block_tables[0][0], s.geometry.num_blocks - 1)])
    for layer in range(2):
        for name, g, r in zip(
            ("c_kv", "k_rope"), backend.read_cache(layer), ref.read_cache(layer), strict=True
        ):
            assert_cache_equal(np.asarray(g), r, name, layer, "after a copy")


@pytest.mark.parametrize("make", [TritonBackend, TorchBackend], ids=["triton", "torch"])
def test_bad_latent_inputs_are_refused_by_name_and_change_nothing(
    make: Callable[..., Backend],
) -> None:
    s = _step(2, [(3, 2)])
    backend = make(DEVICE)
    _run(backend, s)
    before = [np.asarray(x).copy() for x in backend.read_cache(0)]
    c, r = s.c_kv[0].astype(np.float32), s.k_rope[0].astype(np.float32)
    slots = list(s.batch.slot_mapping)
    for key, value, message in [
        (np.ones((2, 1, LATENT + ROPE), np.float32), r, r"key \(c_kv\) has shape \(2, 1, 48\)"),
        (c, np.ones((2, 1, LATENT), np.float32), r"value \(k_rope\) has shape \(2, 1, 32\)"),
        (np.ones((2, 2, LATENT), np.float32), r, r"key \(c_kv\) has shape \(2, 2, 32\)"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            backend.write_kv(0, key, value, slots)
    q = s.queries[0].astype(np.float32)
    with pytest.raises(InvalidRequestError, match=r"query \(\[q_latent, q_rope\] a head\)"):
        backend.attention(0, q[..., :LATENT], s.batch, SCALE)
    for got, want in zip(backend.read_cache(0), before, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("make", [TritonBackend, TorchBackend], ids=["triton", "torch"])
def test_the_device_contract_carries_latent_rows(make: Callable[..., Any]) -> None:
    """Tensors in, tensors out: c_kv and k_rope to write_kv and attention, [T, H, latent] back."""
    s = _step(4, [(12, 1), (0, 4)], dtype="float16")
    dev, dt = DEVICE, TORCH_DTYPES["float16"]
    backend = make(dev, tensors="torch")
    ref = ReferenceBackend()
    for b in (backend, ref):
        b.create_cache(s.geometry)
    for layer, c, r, slots in s.context:
        ref.write_kv(layer, c, r, slots)
        c_t, r_t = (torch.from_numpy(x).to(dev, dt) for x in (c, r))
        backend.write_kv(layer, c_t, r_t, torch.tensor(slots, device=dev))
    c_t, r_t = (torch.from_numpy(x).to(dev, dt) for x in (s.c_kv[0], s.k_rope[0]))
    a = s.batch.arrays()
    backend.write_kv(0, c_t, r_t, torch.from_numpy(a.slot_mapping).to(dev))
    ref.write_kv(0, s.c_kv[0], s.k_rope[0], s.batch.slot_mapping)
    arrays = a.map(lambda x: torch.from_numpy(x).to(dev))
    q = torch.from_numpy(s.queries[0]).to(dev, dt)
    out = backend.attention(0, q, s.batch, SCALE, arrays=arrays, key=c_t, value=r_t)
    assert isinstance(out, torch.Tensor) and out.dtype == dt
    assert tuple(out.shape) == (s.batch.num_tokens, HEADS, LATENT)
    want = np.asarray(ref.attention(0, s.queries[0], s.batch, SCALE), dtype=np.float64)
    assert_attention_close(
        out.cpu().float().numpy(), want, "float16", s.batch, 0, "device contract"
    )
    blocks = list(range(s.geometry.num_blocks))
    got_c, got_r = backend.read_blocks(0, blocks)
    assert got_c.shape == (len(blocks), 4, 1, LATENT) and got_r.shape == (len(blocks), 4, 1, ROPE)
    for name, g, w in zip(
        ("c_kv", "k_rope"), (got_c, got_r), ref.read_blocks(0, blocks), strict=True
    ):
        assert_cache_equal(g.cpu().float().numpy(), w, name, 0, "device contract")
    with pytest.raises(InvalidRequestError, match=r"value \(k_rope\) has shape"):
        backend.attention(0, q, s.batch, SCALE, arrays=arrays, key=c_t, value=c_t)


def test_triton_declares_the_latent_widths_its_kernels_are_built_for() -> None:
    caps = TritonBackend().capabilities
    ok = KVGeometry(1, 4, 64, 1, 576, "bfloat16", latent_dim=512)
    assert caps.unsupported(ok, 128) == []
    wide = KVGeometry(1, 4, 64, 1, 1088, "bfloat16", latent_dim=1024)
    assert caps.unsupported(wide, 128) == [
        "latent layout 1024+64 (latent_dim <= 512 and rope_dim <= 128 only)"
    ]
    with pytest.raises(InvalidRequestError, match="latent layout 1024"):
        TritonBackend().create_cache(wide)


def test_the_kernels_refuse_widths_that_do_not_fit_the_rows_and_change_nothing() -> None:
    """Rows narrower than c_kv + k_rope, a query not as wide as the rows, a latent_dim that
    leaves no rope part, a scale that is not one: refused by name, before any launch."""
    cache = torch.full((4, 2, 48), float("nan"), device=DEVICE)
    slots = torch.tensor([1, -1], dtype=torch.int64, device=DEVICE)
    c, r = torch.ones(2, 1, 32, device=DEVICE), torch.ones(2, 1, 8, device=DEVICE)
    with pytest.raises(InvalidRequestError, match=r"c_kv \(32\) and k_rope \(8\) are 40 wide"):
        write_latent(c, r, cache, slots)
    with pytest.raises(InvalidRequestError, match=r"c_kv has shape \(2, 2, 32\)"):
        write_latent(torch.ones(2, 2, 32, device=DEVICE), r.new_ones(2, 1, 16), cache, slots)
    assert bool(cache.isnan().all()), "a refused write changed the cache"
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    q40, q48 = torch.ones(1, 4, 40, device=DEVICE), torch.ones(1, 4, 48, device=DEVICE)
    for q, latent, scale, message in [
        (q40, 32, SCALE, r"each head must be \[q_latent \(32\), q_rope \(16\)\]"),
        (q48, 48, SCALE, r"latent_dim must be in 1\.\.47"),
        (q48, 32, float("nan"), r"scale must be finite and > 0"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            paged_latent_attention(q, cache, qsl, lens, tables, scale, latent_dim=latent)
