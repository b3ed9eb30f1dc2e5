"""Hand checks of the kernel adapters: small cases, and a plain float64 paged reference.

Each adapter test (tests/test_adapters_*.py) builds a handful of :class:`Case` s,
runs them through the adapter exactly as the suite would (create the cache,
write every token's K and V, then attention on the step's new tokens, under
the contract the adapter declares) and compares the output with
:func:`reference`: float64 attention written out here, one query at a time,
from the definitions (causal visibility, the window, soft-capping, ALiBi
``slope * (k - p)``, a sink as one more softmax term) over the K and V the
cache holds (for an fp8 cache, the stored values times the scale). So a wrong
adapter (a table off by one, a window off by one, a scale dropped) is caught
here, apart from the suite, and never mistaken for the kernel's own rounding.

Tolerances are the dtype's: a correct kernel in float16 is within a few
thousandths of a value of order one, and a wiring error is off by far more.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from spec.attention import AttentionVariant
from spec.batch import BatchMetadata
from spec.kv_geometry import KVGeometry
from spec.quant import quantize, round_fp8

F64 = np.ndarray[Any, np.dtype[np.float64]]
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-2, "float16": 6e-3, "bfloat16": 4e-2}
"""Largest allowed ``|out - ref|`` for values of order one (float32: TF32 products)."""


@dataclass
class Case:
    """One step: a pool, sequences with their tables, every token's K and V, the new queries."""

    geometry: KVGeometry
    batch: BatchMetadata
    keys: list[F64]  # per sequence [seq_len, H_kv, D_k] (latent: c_kv)
    values: list[F64]  # per sequence [seq_len, H_kv, D_v] (latent: k_rope)
    query: F64  # [T, H, D]
    scale: float
    variant: AttentionVariant | None = None
    label: str = ""
    unowned: dict[int, tuple[F64, F64]] = field(default_factory=dict)  # slot -> finite K, V


def rounded(x: F64, dtype: str) -> F64:
    """``x`` rounded to ``dtype`` (through torch, which has bfloat16)."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(TORCH[dtype]).double().numpy()


def kernels_or_skip(load: Any) -> Any:
    """``load()``: an adapter's kernel modules. Where they cannot be had (the package is
    not installed and its wheel cannot be fetched) the test is skipped naming why, and
    fails instead under ``CI``, which reaches PyPI: there a missing download is a failure."""
    pytest.importorskip("triton", reason="the Triton adapters need: pip install 'paged-spec[gpu]'")
    from conformance.errors import SetupError

    try:
        return load()
    except SetupError as err:
        if os.environ.get("CI"):
            pytest.fail(f"the kernel files could not be had under CI: {err}")
        pytest.skip(f"the kernel files could not be had (an offline machine?): {err}")


def make_case(
    seed: int,
    seqs: list[tuple[int, int]],
    *,
    dtype: str = "float16",
    block_size: int = 16,
    kv_heads: int = 2,
    heads: int = 4,
    head_dim: int = 64,
    variant: AttentionVariant | None = None,
    kv_dtype: str | None = None,
    kv_scale: float = 1.0,
    latent_dim: int | None = None,
    spare_blocks: int = 3,
    fill_unowned: bool = False,
    label: str = "",
) -> Case:
    """Sequences of ``(context, new tokens)``, each on shuffled blocks of a shared pool with
    ``spare_blocks`` left over; K and V drawn from a seeded generator, queries scaled so that
    scores reach about 8 (softmax far from uniform). ``fill_unowned`` gives every slot no
    token owns a finite value (else it keeps the cache's initial NaN)."""
    rng = np.random.default_rng(seed)
    lens = [c + n for c, n in seqs]
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + spare_blocks
    order = rng.permutation(num_blocks).tolist()
    tables, start = [], 0
    for u in used:
        tables.append(tuple(order[start : start + u]))
        start += u
    width = max(used)
    padded = tuple(t + (-1,) * (width - len(t)) for t in tables)
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    slots, positions = [], []
    for (c, n), t in zip(seqs, tables, strict=True):
        for p in range(c, c + n):
            slots.append(t[p // block_size] * block_size + p % block_size)
            positions.append(p)
    batch = BatchMetadata(
        block_size,
        tuple(range(len(seqs))),
        tuple(qsl),
        tuple(lens),
        padded,
        tuple(slots),
        tuple(positions),
    )
    scales = ((kv_scale, kv_scale),) if kv_dtype else ()
    geometry = KVGeometry(
        1, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, kv_dtype=kv_dtype,
        kv_scales=scales, latent_dim=latent_dim,
    )  # fmt: skip
    k_width, v_width = geometry.kv_widths
    spread = 2.0 * kv_scale if kv_dtype else 1.0
    keys = [rounded(rng.normal(0, spread, (n, kv_heads, k_width)), dtype) for n in lens]
    values = [rounded(rng.normal(0, spread, (n, kv_heads, v_width)), dtype) for n in lens]
    q_width = head_dim
    query = rounded(rng.normal(0, 1, (qsl[-1], heads, q_width)), dtype)
    scale = 8.0 / math.sqrt(q_width) / (spread if kv_dtype else 1.0)
    unowned: dict[int, tuple[F64, F64]] = {}
    if fill_unowned:
        owned = {t[p // block_size] * block_size + p % block_size
                 for t, n in zip(tables, lens, strict=True) for p in range(n)}  # fmt: skip
        for slot in sorted(set(range(num_blocks * block_size)) - owned):
            unowned[slot] = (
                rounded(rng.normal(0, 100, (kv_heads, k_width)), dtype),
                rounded(rng.normal(0, 100, (kv_heads, v_width)), dtype),
            )
    return Case(geometry, batch, keys, values, query, scale, variant, label, unowned)


def stored(case: Case, x: F64, which: int) -> F64:
    """What the cache holds for ``x`` (``which`` 0: K, 1: V), as values: fp8 dequantized."""
    g = case.geometry
    if g.kv_dtype is None:
        return x
    s = g.kv_scales[0][which]
    return quantize(x, s, g.kv_dtype) * float(np.float32(s))


def reference(
    case: Case,
    *,
    prefix_query: str | None = None,
    window: int | None = None,
    alibi_origin: str = "position",
    round_products: str | None = None,
) -> F64:
    """Float64 paged attention of the case's new tokens, written from the definitions.

    Knobs say where a kernel is known to differ from the definition, so that the rest is
    still checked tightly: ``prefix_query`` (an fp8 format) rounds the query to it for the
    keys of the cached prefix (SGLang's ``q.to(k.dtype)``); ``window`` replaces the
    variant's window (an engine that reads one key fewer); ``alibi_origin="context"``
    biases by ``slope * (k - context_len)`` (vLLM's) instead of ``slope * (k - p)``;
    ``round_products`` (a dtype) rounds each ``q_d * k_d`` to it before the sum.
    """
    g, b, v = case.geometry, case.batch, case.variant or AttentionVariant()
    heads = case.query.shape[1]
    width = g.value_dim
    out = np.zeros((b.num_tokens, heads, width))
    for i in range(b.num_seqs):
        seq_len, n = b.seq_lens[i], b.query_len(i)
        k, vv = stored(case, case.keys[i], 0), stored(case, case.values[i], 1)
        if g.latent_dim is not None:  # the key is the whole row, the value its c_kv
            k, vv = np.concatenate([k, vv], axis=-1), k
        group = heads // k.shape[1]
        span = v.window if window is None else window
        for j in range(n):
            p, row = seq_len - n + j, b.query_start_loc[i] + j
            for h in range(heads):
                keys = np.arange(p + 1)
                if span is not None:
                    keys = keys[keys > p - span]
                q = np.broadcast_to(case.query[row, h], (len(keys), case.query.shape[2]))
                if prefix_query is not None:
                    old = keys < seq_len - n
                    q = np.where(old[:, None], round_fp8(q, prefix_query), q)
                products = k[keys, h // group] * q
                if round_products is not None:
                    products = rounded(products, round_products)
                s = products.sum(axis=1) * case.scale
                if v.softcap is not None:
                    s = v.softcap * np.tanh(s / v.softcap)
                if v.alibi_slopes is not None:
                    origin = p if alibi_origin == "position" else seq_len - n
                    s = s + v.alibi_slopes[h] * (keys - origin)
                top = s.max() if v.sinks is None else max(s.max(), v.sinks[h])
                w = np.exp(s - top)
                total = w.sum() + (0.0 if v.sinks is None else math.exp(v.sinks[h] - top))
                out[row, h] = (w / total) @ vv[keys, h // group]
    return out


def run(backend: Any, case: Case, *, declared: bool = True) -> F64:
    """The case through ``backend`` as the suite drives it, under the contract it declares
    (``declared``: assert first that its capabilities say it can run the case)."""
    g, b = case.geometry, case.batch
    caps = backend.capabilities
    why = caps.unsupported(g, case.query.shape[1], case.variant)
    if declared:
        assert not why, f"{case.label}: the adapter declares it cannot run this case: {why}"
        assert caps.batch_unsupported(b) is None, caps.batch_unsupported(b)
    backend.create_cache(g)
    slots, keys, values = [], [], []
    for i in range(b.num_seqs):
        table = b.block_tables[i]
        for p in range(b.seq_lens[i]):
            slots.append(table[p // g.block_size] * g.block_size + p % g.block_size)
        keys.append(case.keys[i])
        values.append(case.values[i])
    for slot, (k, v) in case.unowned.items():
        slots.append(slot)
        keys.append(k[None])
        values.append(v[None])
    all_k, all_v = np.concatenate(keys), np.concatenate(values)
    device = torch.device(caps.device)
    torch_contract = caps.tensors == "torch"

    def arg(x: F64) -> Any:
        if not torch_contract:
            return x.astype(np.float32)
        return torch.from_numpy(x).to(device=device, dtype=TORCH[g.dtype])

    slot_arg: Any = slots
    if torch_contract:
        slot_arg = torch.tensor(slots, dtype=torch.int64, device=device)
    backend.write_kv(0, arg(all_k), arg(all_v), slot_arg)
    kwargs: dict[str, Any] = {}
    if case.variant is not None:
        kwargs["variant"] = case.variant
    if torch_contract:
        kwargs["arrays"] = b.arrays().map(lambda a: torch.from_numpy(np.asarray(a)).to(device))
        new = [slice(b.seq_lens[i] - b.query_len(i), b.seq_lens[i]) for i in range(b.num_seqs)]
        kwargs["key"] = arg(np.concatenate([k[s] for k, s in zip(case.keys, new, strict=True)]))
        kwargs["value"] = arg(np.concatenate([v[s] for v, s in zip(case.values, new, strict=True)]))
    out = backend.attention(0, arg(case.query), b, case.scale, **kwargs)
    if isinstance(out, torch.Tensor):
        return out.detach().to(device="cpu", dtype=torch.float64).numpy()
    return np.asarray(out, dtype=np.float64)


def worst(case: Case, out: F64, **knobs: Any) -> float:
    """The largest ``|out - reference|`` of the case (``knobs``: :func:`reference`'s)."""
    ref = reference(case, **knobs)
    assert out.shape == ref.shape, f"{case.label}: shape {out.shape}, expected {ref.shape}"
    return float(np.abs(out - ref).max())


def check(backend: Any, case: Case, tolerance: float | None = None, **knobs: Any) -> float:
    """Run and compare; the worst difference (asserted within the dtype's tolerance)."""
    out = run(backend, case)
    assert np.isfinite(out).all(), f"{case.label}: non-finite outputs"
    err = worst(case, out, **knobs)
    limit = TOLERANCE[case.geometry.dtype] if tolerance is None else tolerance
    assert err <= limit, f"{case.label}: off by {err:.3g}, more than {limit:g}"
    return err
