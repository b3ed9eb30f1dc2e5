"""Unified paged attention: prefill chunks and decodes of a flattened batch in one launch.

Each program owns a tile of query rows of one sequence and one KV head: the
``GROUP = H / H_kv`` query heads that share that KV head are packed together
(row ``r`` is query token ``r // GROUP_PAD``, head ``r % GROUP_PAD`` of the
group), so every K and V tile loaded from the cache serves all of them. The
program walks the sequence's keys in tiles of ``BLOCK_N`` tokens, finding each
key through the block table (``block_tables[seq, t // B]``; any block size,
entries past ``ceil(seq_len / B)`` never read), and keeps a float32 online
softmax. Query token ``j`` at position ``p = seq_len - query_len + j`` sees
keys ``0 .. p``.

Split-KV (flash-decoding): with few programs and long contexts, a third grid
axis cuts each sequence's keys into ``num_splits`` ranges; each writes a partial
output normalised by its own softmax sum plus its log-sum-exp, and a second
kernel merges the partials. An empty split has ``lse = -inf`` and weight zero.

Variants (:class:`spec.attention.AttentionVariant`), each a constexpr switch so
that plain attention compiles to what it was: soft-capping of the scaled
scores, ALiBi ``slope_h * (k - p)``, a sliding window (``p - w < k <= p``)
whose tiles wholly before it are never visited, and sinks (one logit per
query head in the softmax denominator). Without split-KV a sink starts the
online softmax (``m = sink``, ``l = 1``); with it, the splits leave it out and
the merge adds it once, as one more term of weight ``2^(sink - top)`` and no value.

fp8 KV: the cache holds fp8 bytes, decoded exactly (:mod:`._fp8`). The
per-tensor scales are folded rather than multiplied into every element:
``k_scale`` into the score multiplier (``scale * k_scale * q . stored_k``) and
``v_scale`` into the output (``v_scale * sum_k w_k stored_v_k``), which is the
same dequantization, ``stored * scale``, by linearity. The decoded values are
exact in float16 and bfloat16, so the dot products lose nothing either.

The interpreter runs the same code a GPU compiles (float16 and bfloat16 dot
products on their own operands, probabilities rounded to the activation dtype
before ``P @ V``; float32 with IEEE products, never TF32), with one exception:
Triton's own interpreter computes bfloat16 on raw bits, so under it, and only
there, bfloat16 is upcast to float32 (:func:`._checks.bf16_as_compiled`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backend_gpu.kernels._checks import (
    FLOAT_DTYPES,
    bf16_as_compiled,
    check_cache_pair,
    check_device,
    check_last_dim_dense,
    check_tensor,
    next_pow2,
)
from backend_gpu.kernels._fp8 import FP8_NAMES, as_bytes, fp8_constexprs, fp8_decode
from backend_gpu.kernels.target import LaunchTarget, launch_target
from spec.errors import InvalidRequestError
from spec.kv_budget import cdiv
from spec.validate import check_int, check_scale

_LOG2E = 1.4426950408889634

MAX_HEAD_DIM = 256
"""Largest head dim the kernels are built for: a 256-wide K tile already fills shared memory."""


# Counts, the window and the table's width change from batch to batch: not specialisations to
# compile (each would add kernels for values that are 1 or divisible by 16; a conformance run
# launched 118 distinct ones before, 281 across the kernels).
@triton.jit(do_not_specialize=["window", "num_q_tiles", "keys_per_split", "stride_bt"])  # type: ignore[untyped-decorator]
def _attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    sinks_ptr,
    alibi_ptr,
    score_mul,
    cap_log2,
    v_scale,
    window,
    num_q_tiles,
    keys_per_split,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_os,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
):
    # Scores are kept in log2 units: score_mul is scale * k_scale * log2(e), or, with a
    # soft-cap c, scale * k_scale / c and the capped score is cap_log2 * tanh(.) (c * log2 e).
    # Sinks and ALiBi slopes come pre-multiplied by log2(e).
    # BLOCK_M = BLOCK_Q * GROUP_PAD rows: query tokens x the heads of one KV head's group.
    seq = tl.program_id(0) // num_q_tiles
    q_tile = tl.program_id(0) % num_q_tiles
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - query_len

        rows = tl.arange(0, BLOCK_M)
        tok = q_tile * BLOCK_Q + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (tok < query_len) & (rows % GROUP_PAD < GROUP)
        pos = context + tok
        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_DIM
        row_off = (q_start + tok).to(tl.int64)
        q = tl.load(
            q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)

        # Keys this tile may see: up to the position of its last real token and, with a window
        # of w, from w - 1 before its first token's position. The loop starts there, so key
        # tiles wholly before the window are never read (their blocks may even be released):
        # a decode at position p reads ceil(min(w, p + 1) / BLOCK_N) tiles instead of
        # ceil((p + 1) / BLOCK_N), and a prefill tile of BLOCK_Q tokens at most
        # ceil((w + BLOCK_Q - 1) / BLOCK_N). Split-KV divides that range, not the context.
        kv_hi = context + tl.minimum(query_len, (q_tile + 1) * BLOCK_Q)
        kv_lo = 0
        if USE_WINDOW:
            kv_lo = tl.maximum(context + q_tile * BLOCK_Q - window + 1, 0)
        if SPLIT:
            kv_lo = kv_lo + tl.program_id(2) * keys_per_split
            kv_hi = tl.minimum(kv_hi, kv_lo + keys_per_split)

        # Running max starts finite, so exp2(m_old - m_new) is never NaN for an empty tile.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if USE_SINKS and not SPLIT:  # the sink is one more logit with weight and no value
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=-1.0e30)
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        if USE_ALIBI:
            slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(kv_lo, kv_hi, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            t_ok = t < kv_hi
            block = tl.load(table + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
            in_block = (t % BLOCK_SIZE).to(tl.int64)
            k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
            k = tl.load(
                k_ptr + k_off[None, :] + d[:, None], mask=t_ok[None, :] & d_ok[:, None], other=0
            )
            k = _widen(k, q, UPCAST, FP8_MANT, FP8_MIN_EXP)
            s = tl.dot(q, k, input_precision="ieee") if IEEE else tl.dot(q, k)
            s = s * score_mul
            if USE_SOFTCAP:
                s = cap_log2 * _tanh(s)
            if USE_ALIBI:
                s += slope[:, None] * (t[None, :] - pos[:, None]).to(tl.float32)
            visible = t_ok[None, :] & (t[None, :] <= pos[:, None])
            if USE_WINDOW:
                visible = visible & (t[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
            v = tl.load(
                v_ptr + v_off[:, None] + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0
            )
            v = _widen(v, q, UPCAST, FP8_MANT, FP8_MIN_EXP)
            if not UPCAST:
                p = p.to(v.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new

        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / safe_l[:, None]
        if FP8_MANT:
            out = out * v_scale  # V dequantized: sum_k w_k * (stored_v_k * v_scale)
        o_off = row_off[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        if SPLIT:
            split = tl.program_id(2)
            o_off += split * stride_os
            lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
            l_off = row_off * stride_lt + head * stride_lh + split
            tl.store(lse_ptr + l_off, lse, mask=row_ok)
        tl.store(
            out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :]
        )


@triton.jit  # type: ignore[untyped-decorator]
def _widen(x, q, UPCAST: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr):  # type: ignore[no-untyped-def]
    """A loaded K or V tile in the dtype of the dot: float32, or the query's (fp8 decoded)."""
    if FP8_MANT:
        x = fp8_decode(x, FP8_MANT, FP8_MIN_EXP)  # exact in float16 and bfloat16 too
        if not UPCAST:
            x = x.to(q.dtype)
    elif UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _tanh(x):  # type: ignore[no-untyped-def]
    """``tanh`` from one exp2 of a non-positive argument: no overflow at any magnitude."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2 |x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])  # type: ignore[untyped-decorator]
def _merge_kernel(  # type: ignore[no-untyped-def]
    part_ptr,
    lse_ptr,
    out_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    num_seqs,
    num_splits,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """Program ``(t, h)`` merges token ``t``, head ``h``: weights ``2^(lse_s - max lse)``.

    Rows past the batch's last token are padding: nothing to merge, nothing written.
    A sink (log2 units) joins here, once: in the max and the total, with no value.
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    real = t < tl.load(query_start_loc_ptr + num_seqs).to(tl.int64)
    s = tl.arange(0, SPLIT_PAD)
    s_ok = s < tl.where(real, num_splits, 0)
    lse = tl.load(lse_ptr + t * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    top = tl.maximum(tl.max(lse, 0), -1.0e30)  # finite even for a padding row (all -inf)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + h)
        top = tl.maximum(top, sink)
    w = tl.where(s_ok, tl.exp2(lse - top), 0.0)
    d = tl.arange(0, HEAD_PAD)
    part = tl.load(
        part_ptr + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=(w > 0.0)[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    if USE_SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < tl.where(real, HEAD_DIM, 0),
    )


@dataclass(frozen=True)
class _Plan:
    """Tile sizes and the number of KV splits for one launch.

    ``keys`` is the most keys one query tile can see (the window's span, or the
    longest context); splits divide that.
    """

    block_q: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    keys: int


@dataclass(frozen=True)
class _Variant:
    """One layer's variant and fp8 scales, checked, as the kernels take them.

    ``sinks`` and ``alibi`` are float32 ``[H]`` tensors on the device, in log2 units.
    """

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    alibi: torch.Tensor | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    check_indices: bool = True,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal paged attention for every token of the flattened batch: ``[T, H, D]``.

    ``query`` is ``[>= T, H, D]`` (rows past ``T = query_start_loc[-1]`` are
    padding, left alone in ``out``); ``k_cache``/``v_cache`` are one layer's
    ``[num_blocks, B, H_kv, D]``; ``query_start_loc`` ``[S + 1]``, ``seq_lens``
    ``[S]`` and ``block_tables`` ``[S, W]`` are int32 as in :mod:`spec.batch`.
    ``num_splits`` forces the split-KV path (``> 1``) or the single pass (``1``);
    ``None`` lets a heuristic choose. ``max_query_len``/``max_seq_len`` size the
    grid; passing them avoids a device read-back. ``check_indices`` validates the
    metadata on the host (a GPU sync); an engine that trusts its scheduler may
    turn it off. ``block_n`` overrides the key tile width (a power of two >= 16;
    tests use it to force many loop iterations on short contexts).

    Variants, as :class:`spec.attention.AttentionVariant` defines them:
    ``window`` (keys ``p - window < k <= p``; table entries of blocks wholly
    before the first query's window may be ``-1``, released), ``softcap``,
    ``sinks`` and ``alibi_slopes`` (float32 ``[H]`` tensors on the device).
    An fp8 cache (``torch.float8_e4m3fn``/``float8_e5m2``) is dequantized as
    ``stored * k_scale`` and ``stored * v_scale``; the query stays in its float dtype.
    """
    q, k_cache, v_cache, qsl, lens, tables = _check_inputs(
        query, k_cache, v_cache, query_start_loc, seq_lens, block_tables
    )
    variant = _check_variant(window, softcap, sinks, alibi_slopes, q, k_scale, v_scale)
    num_seqs, (_, _, num_kv_heads, head_dim) = lens.shape[0], k_cache.shape
    if check_indices:
        true_max = _check_metadata(qsl, lens, tables, k_cache.shape, q.shape[0], window)
        given = (max_query_len, max_seq_len)
        if any(g is not None and g < t for g, t in zip(given, true_max, strict=True)):
            raise InvalidRequestError(
                f"max_query_len, max_seq_len = {given} but the batch has {true_max}"
            )
    if max_query_len is None:
        max_query_len = int((qsl[1:] - qsl[:-1]).max()) if num_seqs else 0
    if max_seq_len is None:
        max_seq_len = int(lens.max()) if num_seqs else 0
    if out is None:
        out = torch.empty_like(q)
    else:
        _check_out(out, q)
    if num_seqs == 0 or max_query_len == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_scale("scale", scale)
    group = q.shape[1] // num_kv_heads
    plan = _plan(
        num_seqs,
        num_kv_heads,
        group,
        head_dim,
        max_query_len,
        max_seq_len,
        num_splits,
        launch_target(q.device),
        block_n,
        window,
    )
    # Triton's own interpreter computes bfloat16 on raw bits and converts float32 to it by
    # truncation: there, the kernel works in float32 and writes float32, and torch rounds.
    # Under the conformance suite's honest interpreter it runs the GPU's bfloat16 code.
    staged = out.dtype == torch.bfloat16 and not bf16_as_compiled()
    target = torch.empty(out.shape, dtype=torch.float32, device=out.device) if staged else out
    _launch(
        q, k_cache, v_cache, target, qsl, lens, tables, scale, variant, group, plan, max_query_len
    )
    if staged:
        num_tokens = int(qsl[-1])
        out[:num_tokens] = target[:num_tokens].to(torch.bfloat16)
    return out


def _check_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Types, dtypes, shapes, strides and devices; the index ranges are :func:`_check_metadata`."""
    k_cache, v_cache = check_cache_pair(k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if head_dim > MAX_HEAD_DIM:
        raise InvalidRequestError(f"head dim {head_dim} > {MAX_HEAD_DIM} is not supported")
    q = check_tensor("query", query, 3, FLOAT_DTYPES)
    if q.dtype != k_cache.dtype and k_cache.dtype not in FP8_NAMES:
        raise InvalidRequestError(f"query dtype {q.dtype} differs from the cache's {k_cache.dtype}")
    if q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise InvalidRequestError(
            f"query has shape {tuple(q.shape)}: need head dim {head_dim} and a multiple of "
            f"{num_kv_heads} heads"
        )
    check_last_dim_dense("query", q)
    qsl = check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    lens = check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    tables = check_tensor("block_tables", block_tables, 2, (torch.int32,))
    num_seqs = lens.shape[0]
    if qsl.shape[0] != num_seqs + 1 or tables.shape[0] != num_seqs:
        raise InvalidRequestError(
            f"{num_seqs} seq_lens need query_start_loc of {num_seqs + 1} and {num_seqs} table "
            f"rows, got {qsl.shape[0]} and {tables.shape[0]}"
        )
    if not (qsl.is_contiguous() and lens.is_contiguous() and tables.stride(1) == 1):
        raise InvalidRequestError("query_start_loc, seq_lens and block_tables rows must be dense")
    named = {"query": q, "v_cache": v_cache, "query_start_loc": qsl, "seq_lens": lens}
    check_device(k_cache.device, *named.items(), ("block_tables", tables))
    return q, k_cache, v_cache, qsl, lens, tables


def _check_variant(
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    q: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> _Variant:
    """The variant arguments, checked, with per-head tensors converted to log2 units."""
    per_head = []
    for name, x in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if x is not None:
            x = check_tensor(name, x, 1, (torch.float32,))
            if x.shape[0] != q.shape[1]:
                raise InvalidRequestError(
                    f"{name} has {x.shape[0]} entries, but there are {q.shape[1]} query heads"
                )
            check_device(q.device, (name, x))
            x = x.contiguous() * _LOG2E
        per_head.append(x)
    return _Variant(
        window=None if window is None else check_int("window", window, low=1),
        softcap=None if softcap is None else check_scale("softcap", softcap),
        sinks=per_head[0],
        alibi=per_head[1],
        k_scale=check_scale("k_scale", k_scale),
        v_scale=check_scale("v_scale", v_scale),
    )


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    qsl: torch.Tensor,
    lens: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    variant: _Variant,
    group: int,
    plan: _Plan,
    max_query_len: int,
) -> None:
    num_seqs, num_kv_heads = lens.shape[0], k_cache.shape[2]
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    head_pad = max(16, next_pow2(head_dim))
    num_q_tiles = cdiv(max_query_len, plan.block_q)
    split = plan.num_splits > 1
    keys_per_split = cdiv(cdiv(plan.keys, plan.num_splits), plan.block_n) * plan.block_n
    upcast = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and not bf16_as_compiled())
    ieee = q.dtype == torch.float32  # float32 products in full, not TF32, compiled or not
    fp8 = fp8_constexprs(k_cache.dtype)
    fp8.pop("FP8_MAX")  # only the KV write saturates
    k_scale = variant.k_scale if fp8["FP8_MANT"] else 1.0
    if variant.softcap is None:
        score_mul, cap_log2 = scale * k_scale * _LOG2E, 0.0
    else:
        score_mul, cap_log2 = scale * k_scale / variant.softcap, variant.softcap * _LOG2E
    dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
    sinks = dummy if variant.sinks is None else variant.sinks
    if split:
        num_tokens, num_heads = q.shape[0], q.shape[1]
        part = torch.empty(
            num_tokens, num_heads, plan.num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        lse = torch.empty(
            num_tokens, num_heads, plan.num_splits, dtype=torch.float32, device=q.device
        )
        target, t_strides, l_strides = (
            part,
            (part.stride(0), part.stride(1), part.stride(2)),
            (lse.stride(0), lse.stride(1)),
        )
    else:
        lse = dummy
        target, t_strides, l_strides = out, (out.stride(0), out.stride(1), 0), (0, 0)
    grid = (num_seqs * num_q_tiles, num_kv_heads, plan.num_splits)
    _attention_kernel[grid](
        q,
        as_bytes(k_cache),
        as_bytes(v_cache),
        target,
        lse,
        qsl,
        lens,
        tables,
        sinks,
        dummy if variant.alibi is None else variant.alibi,
        score_mul,
        cap_log2,
        variant.v_scale,
        variant.window or 0,
        num_q_tiles,
        keys_per_split,
        q.stride(0),
        q.stride(1),
        *t_strides,
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        tables.stride(0),
        *l_strides,
        GROUP=group,
        GROUP_PAD=next_pow2(group),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_q * next_pow2(group),
        BLOCK_N=plan.block_n,
        SPLIT=split,
        UPCAST=upcast,
        IEEE=ieee,
        USE_SOFTCAP=variant.softcap is not None,
        USE_ALIBI=variant.alibi is not None,
        USE_WINDOW=variant.window is not None,
        USE_SINKS=variant.sinks is not None,
        **fp8,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if split:
        _merge_kernel[(q.shape[0], q.shape[1])](
            part,
            lse,
            out,
            qsl,
            sinks,
            num_seqs,
            plan.num_splits,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            SPLIT_PAD=next_pow2(plan.num_splits),
            USE_SINKS=variant.sinks is not None,
        )


def _plan(
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None,
    target: LaunchTarget,
    block_n: int | None = None,
    window: int | None = None,
) -> _Plan:
    """Tile sizes, and how many KV splits: forced, or by the occupancy heuristic, for ``target``.

    A GPU's plan (:mod:`.target`; the interpreter runs it too, by default):
    decode tiles have 16 rows (the smallest ``tl.dot``) and prefill tiles 64;
    a decode batch that would leave the GPU idle (fewer programs than twice
    the SM count) with contexts of 1024+ keys is split so that it fills it.
    The interpreter's own plan: each program costs milliseconds per loop step,
    so one fat program per (sequence, KV head), and a long decode (256+ keys)
    is split all the same, so that the split-KV kernel and its merge run too.
    With a window, "keys" is what one query tile sees (``w + BLOCK_Q - 1`` at
    most), not the context: a short window over a long context needs no split.
    """
    group_pad = next_pow2(group)
    head_pad = max(16, next_pow2(head_dim))
    if target.gpu:
        rows = 16 if max_query_len * group_pad <= 16 else 64
    else:
        rows = max(16, min(256, next_pow2(max_query_len) * group_pad))
    block_q = max(1, rows // group_pad)
    keys = max_seq_len
    if window is not None:
        keys = min(keys, window + min(max_query_len, block_q) - 1)
    if target.gpu:
        tile_n = 64 if head_pad <= 128 else 32
        warps, stages = 4, 2 if head_pad <= 128 else 1
    else:
        tile_n = min(64, max(16, next_pow2(keys)))
        warps, stages = 4, 1
    if block_n is None:
        block_n = tile_n
    elif block_n < 16 or block_n != next_pow2(block_n):
        raise InvalidRequestError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        num_splits = _auto_splits(
            num_seqs * cdiv(max_query_len, block_q) * num_kv_heads, rows, keys, target
        )
    if not 1 <= num_splits <= 1024:
        raise InvalidRequestError(f"num_splits must be in 1..1024, got {num_splits}")
    return _Plan(block_q, block_n, num_splits, warps, stages, keys)


@dataclass(frozen=True)
class SplitRule:
    """When a plan splits a decode's keys: from ``min_keys`` visible keys, about ``part_keys``
    keys a part, at most ``max_parts`` parts; on a GPU only while the call's programs
    (sequences x KV heads, or x head tiles) are fewer than twice the SMs."""

    min_keys: int
    part_keys: int
    max_parts: int


def split_rule(target: LaunchTarget) -> SplitRule:
    """The split rule of ``target``'s plans (both attention kernels follow it).

    >>> from backend_gpu.kernels.target import FAT_PROGRAMS, H200
    >>> split_rule(H200), split_rule(FAT_PROGRAMS).min_keys
    (SplitRule(min_keys=1024, part_keys=512, max_parts=64), 256)
    """
    return SplitRule(1024, 512, 64) if target.gpu else SplitRule(256, 128, 4)


def _auto_splits(programs: int, rows: int, max_keys: int, target: LaunchTarget) -> int:
    rule = split_rule(target)
    if rows > 16 or max_keys < rule.min_keys:
        return 1
    if target.num_sms is None:
        return min(rule.max_parts, cdiv(max_keys, rule.part_keys))
    if programs >= 2 * target.num_sms:
        return 1
    fill = cdiv(2 * target.num_sms, programs)  # parts enough to fill the SMs twice over
    return max(1, min(fill, cdiv(max_keys, rule.part_keys), rule.max_parts))


def _check_metadata(
    qsl: torch.Tensor,
    lens: torch.Tensor,
    tables: torch.Tensor,
    cache_shape: torch.Size,
    query_rows: int,
    window: int | None = None,
) -> tuple[int, int]:
    """The metadata is well formed and every table entry that will be read is a block.

    With a window, entries of blocks wholly before the first query's window are
    never read: they may be anything (``-1`` for a released block).
    Returns the batch's true ``(max_query_len, max_seq_len)``.
    """
    num_blocks, block_size = cache_shape[0], cache_shape[1]
    starts, seq_lens = qsl.cpu().tolist(), lens.cpu().tolist()
    if starts[0] != 0 or any(b < a for a, b in itertools.pairwise(starts)):
        raise InvalidRequestError(f"query_start_loc must start at 0 and not decrease: {starts}")
    if starts[-1] > query_rows:
        raise InvalidRequestError(
            f"the batch has {starts[-1]} tokens but query has {query_rows} rows"
        )
    host_tables = tables.cpu()
    width = host_tables.shape[1]
    for i, seq_len in enumerate(seq_lens):
        query_len = starts[i + 1] - starts[i]
        if seq_len < query_len:
            raise InvalidRequestError(
                f"sequence {i}: seq_len {seq_len} < its {query_len} new tokens"
            )
        used = cdiv(seq_len, block_size)
        if used > width:
            raise InvalidRequestError(
                f"sequence {i}: {seq_len} tokens need {used} blocks, the table has {width}"
            )
        first = 0 if window is None else max(0, seq_len - query_len - window + 1) // block_size
        row = host_tables[i, first:used]
        bad = (row < 0) | (row >= num_blocks)
        if bool(bad.any()):
            raise InvalidRequestError(
                f"sequence {i}: block {int(row[bad][0])} is outside 0..{num_blocks - 1}"
            )
    query_lens = [b - a for a, b in itertools.pairwise(starts)]
    return max(query_lens, default=0), max(seq_lens, default=0)


def _check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
        raise InvalidRequestError(f"out must match query: {tuple(q.shape)} {q.dtype}")
    if out.device != q.device:
        raise InvalidRequestError(f"out is on {out.device}, expected {q.device}")
    check_last_dim_dense("out", out)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    num_heads: int,
    head_dim: int,
    max_query_len: int,
    max_seq_len: int,
    device: torch.device,
    window: int | None = None,
) -> int:
    """How many KV splits :func:`paged_attention` picks by itself for a batch of this shape."""
    group = num_heads // num_kv_heads
    plan = _plan(
        num_seqs, num_kv_heads, group, head_dim, max_query_len, max_seq_len, None,
        launch_target(device), window=window,
    )  # fmt: skip
    return plan.num_splits
