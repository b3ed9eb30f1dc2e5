"""Latent paged attention (multi-head latent attention, absorbed form) for a flattened batch.

The cache of one layer is ``[num_blocks, B, latent_dim + rope_dim]``: a row
``[c_kv, k_rope]`` a token, one for every query head (:mod:`spec.kv_memory`).
Query head ``h`` of a token brings ``[q_latent, q_rope]``; its score against
token ``t`` is ``scale * (q_latent . c_kv[t] + q_rope . k_rope[t])`` and its
output the softmax-weighted sum of ``c_kv[t]`` (:func:`spec.attention.attend_latent`).

Each program owns a tile of query rows of one sequence: ``BLOCK_Q`` query
tokens times ``HEADS`` query heads, packed as the rows of the score tile (the
query heads share the one KV "head", as in multi-query attention). It walks
the sequence's keys in tiles of ``BLOCK_N`` tokens through the block table
and loads each tile's rows once, in two parts that are powers of two as
``tl.dot`` needs (a 576-wide row is a 512 tile and a 64 tile, not one padded
to 1024): the latent part ``[BLOCK_N, LATENT_PAD]`` serves the scores
(transposed) *and* the values, the rope part ``[ROPE_PAD, BLOCK_N]`` the
scores. A float32 online softmax runs over the tiles.

Split-KV (flash-decoding): a third grid axis cuts each sequence's keys into
``num_splits`` ranges; each writes a partial output normalised by its own sum
and its log-sum-exp, and :func:`_merge_kernel` merges them. Variants (window,
soft-cap, ALiBi, sinks) and fp8 caches are the same rules as in
:mod:`.attention`: an fp8 row has one scale, folded into the score
multiplier and into the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backend_gpu.kernels._checks import (
    CACHE_DTYPES,
    FLOAT_DTYPES,
    bf16_as_compiled,
    check_contiguous,
    check_device,
    check_last_dim_dense,
    check_tensor,
    next_pow2,
)
from backend_gpu.kernels._fp8 import FP8_NAMES, as_bytes, fp8_constexprs
from backend_gpu.kernels.attention import (  # the same rules as the ordinary kernel's
    _LOG2E,
    _auto_splits,
    _check_metadata,
    _check_variant,
    _tanh,
    _Variant,
    _widen,
)
from backend_gpu.kernels.target import LaunchTarget, launch_target
from spec.errors import InvalidRequestError
from spec.kv_budget import cdiv
from spec.validate import check_int, check_scale

MAX_LATENT_DIM = 512
"""Widest latent part the kernel is built for: DeepSeek-V2/V3's ``kv_lora_rank``. A GPU
program holds a ``[16, 512]`` float32 accumulator; a wider one would spill."""
MAX_ROPE_DIM = 128
"""Widest rope part the kernel is built for (DeepSeek's is 64)."""


# Integers that vary per batch are not specialisations to compile (as in .attention).
@triton.jit(do_not_specialize=["window", "num_q_tiles", "keys_per_split", "stride_bt"])  # type: ignore[untyped-decorator]
def _latent_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    cache_ptr,
    out_ptr,
    lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    sinks_ptr,
    alibi_ptr,
    score_mul,
    cap_log2,
    kv_scale,
    window,
    num_q_tiles,
    keys_per_split,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_os,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_lt,
    stride_lh,
    NUM_HEADS: tl.constexpr,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
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
    # Scores in log2 units, as in .attention: score_mul is scale * kv_scale * log2(e), or with
    # a soft-cap c, scale * kv_scale / c and the capped score cap_log2 * tanh(.). Sinks and
    # ALiBi slopes come pre-multiplied by log2(e). Row r: token r // HEADS_PAD of the tile,
    # head head_tile * HEADS + r % HEADS_PAD.
    seq = tl.program_id(0) // num_q_tiles
    q_tile = tl.program_id(0) % num_q_tiles
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - query_len
        rows = tl.arange(0, BLOCK_M)
        tok = q_tile * BLOCK_Q + rows // HEADS_PAD
        head = tl.program_id(1) * HEADS + rows % HEADS_PAD
        row_ok = (tok < query_len) & (rows % HEADS_PAD < HEADS) & (head < NUM_HEADS)
        pos = context + tok
        c = tl.arange(0, LATENT_PAD)
        c_ok = c < LATENT
        r = tl.arange(0, ROPE_PAD)
        r_ok = r < ROPE
        row_off = (q_start + tok).to(tl.int64)
        q_row = q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh
        q_lat = tl.load(q_row + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
        q_rope = tl.load(
            q_row + LATENT + r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0
        )
        if UPCAST:
            q_lat = q_lat.to(tl.float32)
            q_rope = q_rope.to(tl.float32)

        # The keys this tile may see, as in .attention: from the window's first on (tiles wholly
        # before it are never read), to the last real token's position; a split takes a range.
        kv_hi = context + tl.minimum(query_len, (q_tile + 1) * BLOCK_Q)
        kv_lo = 0
        if USE_WINDOW:
            kv_lo = tl.maximum(context + q_tile * BLOCK_Q - window + 1, 0)
        if SPLIT:
            kv_lo = kv_lo + tl.program_id(2) * keys_per_split
            kv_hi = tl.minimum(kv_hi, kv_lo + keys_per_split)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if USE_SINKS and not SPLIT:  # one more logit, with weight and no value
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=-1.0e30)
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        if USE_ALIBI:
            slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)
        acc = tl.zeros([BLOCK_M, LATENT_PAD], dtype=tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(kv_lo, kv_hi, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            t_ok = t < kv_hi
            block = tl.load(table + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
            row = cache_ptr + block * stride_cb + (t % BLOCK_SIZE).to(tl.int64) * stride_cs
            # One load of the latent part: the values, and (transposed) the scores' keys.
            kv = tl.load(row[:, None] + c[None, :], mask=t_ok[:, None] & c_ok[None, :], other=0)
            kr = tl.load(
                row[None, :] + LATENT + r[:, None], mask=t_ok[None, :] & r_ok[:, None], other=0
            )
            kv = _widen(kv, q_lat, UPCAST, FP8_MANT, FP8_MIN_EXP)
            kr = _widen(kr, q_lat, UPCAST, FP8_MANT, FP8_MIN_EXP)
            if IEEE:
                s = tl.dot(q_lat, tl.trans(kv), input_precision="ieee")
                s += tl.dot(q_rope, kr, input_precision="ieee")
            else:
                s = tl.dot(q_lat, tl.trans(kv)) + tl.dot(q_rope, kr)
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
            if not UPCAST:
                p = p.to(kv.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, kv)
            m_i = m_new

        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / safe_l[:, None]
        if FP8_MANT:
            out = out * kv_scale  # the values dequantized: sum_t w_t * (stored_t * scale)
        o_off = row_off[:, None] * stride_ot + head[:, None] * stride_oh + c[None, :]
        if SPLIT:
            split = tl.program_id(2)
            o_off += split * stride_os
            lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
            tl.store(lse_ptr + row_off * stride_lt + head * stride_lh + split, lse, mask=row_ok)
        out_mask = row_ok[:, None] & c_ok[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


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
    NUM_HEADS: tl.constexpr,
    HEADS: tl.constexpr,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """Program ``(t, j)`` merges token ``t``'s heads ``j * HEADS ..``: weights ``2^(lse - top)``.

    The splits' log-sum-exps come as one ``[HEADS, SPLIT_PAD]`` tile; the partial
    outputs one split at a time, so a program holds one ``[HEADS, LATENT_PAD]``
    accumulator however many splits there are. Rows past the batch's last token are
    padding: not written. A sink (log2 units) joins the top and the total once.
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    real = t < tl.load(query_start_loc_ptr + num_seqs).to(tl.int64)
    h_ok = h < tl.where(real, NUM_HEADS, 0)
    s = tl.arange(0, SPLIT_PAD)
    s_ok = s < num_splits
    lse = tl.load(
        lse_ptr + t * stride_lt + h[:, None] * stride_lh + s[None, :],
        mask=h_ok[:, None] & s_ok[None, :],
        other=float("-inf"),
    )
    top = tl.maximum(tl.max(lse, 1), -1.0e30)  # finite for a row of empty splits
    if USE_SINKS:
        sink = tl.load(sinks_ptr + h, mask=h_ok, other=-1.0e30)
        top = tl.maximum(top, sink)
    w = tl.where(s_ok[None, :], tl.exp2(lse - top[:, None]), 0.0)
    total = tl.sum(w, 1)
    if USE_SINKS:
        total += tl.exp2(sink - top)
    c = tl.arange(0, LATENT_PAD)
    c_ok = c < LATENT
    acc = tl.zeros([HEADS, LATENT_PAD], dtype=tl.float32)
    for j in range(0, num_splits):
        w_j = tl.sum(tl.where(s[None, :] == j, w, 0.0), 1)
        part = tl.load(
            part_ptr + t * stride_pt + h[:, None] * stride_ph + j * stride_ps + c[None, :],
            mask=(h_ok & (w_j > 0.0))[:, None] & c_ok[None, :],
            other=0.0,
        )
        acc += part * w_j[:, None]
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(
        out_ptr + t * stride_ot + h[:, None] * stride_oh + c[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & c_ok[None, :],
    )


@dataclass(frozen=True)
class LatentPlan:
    """Tiles and splits of one launch: ``heads`` query heads a program, ``block_q`` tokens,
    ``block_n`` keys a tile, ``num_splits`` KV ranges; ``keys`` the most keys a tile sees."""

    heads: int
    block_q: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    keys: int


def latent_plan(
    num_seqs: int,
    num_heads: int,
    latent_dim: int,
    max_query_len: int,
    max_seq_len: int,
    target: LaunchTarget,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
) -> LatentPlan:
    """The launch for ``target`` (:mod:`.target`): a GPU's, or the interpreter's own.

    A GPU's: 16 rows a program (16 query heads of one decode token, the
    smallest ``tl.dot``; with fewer heads, several tokens), key tiles of 32
    when the latent part is 512 wide (the tile and the ``[16, 512]``
    accumulator fill a program); a decode batch whose programs would leave
    the GPU idle with 1,024+ keys is split to fill it. The interpreter's own:
    one fat program of every head and up to 256 rows, and a long decode
    (256+ keys) split all the same, so that the merge runs on a CPU too.

    >>> from backend_gpu.kernels.target import FAT_PROGRAMS, H200
    >>> p = latent_plan(4, 128, 512, 1, 8192, H200)    # 4 decodes of 128 heads: 32 programs
    >>> p.heads, p.block_q, p.block_n, p.num_splits
    (16, 1, 32, 9)
    >>> p = latent_plan(4, 128, 512, 1, 8192, FAT_PROGRAMS)
    >>> p.heads, p.block_q, p.num_splits
    (128, 1, 1)
    """
    heads_pad = next_pow2(num_heads)
    latent_pad = max(16, next_pow2(latent_dim))
    if target.gpu:
        heads = min(num_heads, 16)
        rows = 16 if max_query_len * next_pow2(heads) <= 16 or latent_pad > 128 else 64
    else:
        heads = num_heads
        rows = max(16, min(256, next_pow2(max_query_len) * heads_pad))
    block_q = max(1, rows // next_pow2(heads))
    keys = max_seq_len
    if window is not None:
        keys = min(keys, window + min(max_query_len, block_q) - 1)
    if target.gpu:
        tile_n = 32 if latent_pad >= 512 else 64
        warps, stages = (8, 1) if latent_pad >= 512 else (4, 2)
    else:
        tile_n = min(64, max(16, next_pow2(keys)))
        warps, stages = 4, 1
    if block_n is None:
        block_n = tile_n
    elif block_n < 16 or block_n != next_pow2(block_n):
        raise InvalidRequestError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        programs = num_seqs * cdiv(max_query_len, block_q) * cdiv(num_heads, heads)
        num_splits = _auto_splits(programs, block_q * next_pow2(heads), keys, target)
    if not 1 <= num_splits <= 1024:
        raise InvalidRequestError(f"num_splits must be in 1..1024, got {num_splits}")
    return LatentPlan(heads, block_q, block_n, num_splits, warps, stages, keys)


def paged_latent_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    latent_dim: int,
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
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Latent causal paged attention for every token of the flattened batch: ``[T, H, latent_dim]``.

    ``query`` is ``[>= T, H, latent_dim + rope_dim]`` (each head ``[q_latent,
    q_rope]``; rows past ``T = query_start_loc[-1]`` are padding, left alone in
    ``out``); ``cache`` is one layer's rows ``[num_blocks, B, latent_dim +
    rope_dim]``, contiguous; the metadata int32 as in :mod:`spec.batch`.
    ``scale`` is the model's (never derived from the row width). The other
    keywords are :func:`.attention.paged_attention`'s; an fp8 cache has one
    scale, ``kv_scale``, for the whole row.
    """
    q, cache, qsl, lens, tables = _check_inputs(
        query, cache, query_start_loc, seq_lens, block_tables, latent_dim
    )
    scale = check_scale("scale", scale)
    variant = _check_variant(window, softcap, sinks, alibi_slopes, q)  # its scales: kv_scale
    kv_scale = check_scale("kv_scale", kv_scale)
    num_seqs = lens.shape[0]
    if check_indices:
        true_max = _check_metadata(qsl, lens, tables, cache.shape, q.shape[0], window)
        given = (max_query_len, max_seq_len)
        if any(g is not None and g < t for g, t in zip(given, true_max, strict=True)):
            raise InvalidRequestError(
                f"max_query_len, max_seq_len = {given} but the batch has {true_max}"
            )
    if max_query_len is None:
        max_query_len = int((qsl[1:] - qsl[:-1]).max()) if num_seqs else 0
    if max_seq_len is None:
        max_seq_len = int(lens.max()) if num_seqs else 0
    shape = (q.shape[0], q.shape[1], latent_dim)
    if out is None:
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != q.dtype:
        raise InvalidRequestError(f"out must be {shape} {q.dtype}")
    else:
        check_device(q.device, ("out", out))
        check_last_dim_dense("out", out)
    if num_seqs == 0 or max_query_len == 0:
        return out
    plan = latent_plan(
        num_seqs, q.shape[1], latent_dim, max_query_len, max_seq_len, launch_target(q.device),
        num_splits=num_splits, block_n=block_n, window=window,
    )  # fmt: skip
    # Triton's own interpreter computes bfloat16 on raw bits and converts to it by truncation:
    # there the kernel works and writes in float32, and torch rounds (as .attention does).
    staged = out.dtype == torch.bfloat16 and not bf16_as_compiled()
    target = torch.empty(out.shape, dtype=torch.float32, device=out.device) if staged else out
    _launch(q, cache, target, qsl, lens, tables, scale, kv_scale, variant, plan, max_query_len)
    if staged:
        num_tokens = int(qsl[-1])
        out[:num_tokens] = target[:num_tokens].to(torch.bfloat16)
    return out


def _check_inputs(
    query: torch.Tensor,
    cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    latent_dim: int,
) -> tuple[torch.Tensor, ...]:
    """Types, dtypes, widths, strides and devices; the index ranges are :func:`_check_metadata`."""
    cache = check_tensor("cache", cache, 3, CACHE_DTYPES)
    check_contiguous("cache", cache)
    width = cache.shape[2]
    latent_dim = check_int("latent_dim", latent_dim, low=1, high=width - 1)
    rope = width - latent_dim
    if latent_dim > MAX_LATENT_DIM or rope > MAX_ROPE_DIM:
        raise InvalidRequestError(
            f"latent layout {latent_dim}+{rope}: the kernel is built for latent_dim <= "
            f"{MAX_LATENT_DIM} and rope_dim <= {MAX_ROPE_DIM}"
        )
    q = check_tensor("query", query, 3, FLOAT_DTYPES)
    if q.dtype != cache.dtype and cache.dtype not in FP8_NAMES:
        raise InvalidRequestError(f"query dtype {q.dtype} differs from the cache's {cache.dtype}")
    if q.shape[2] != width:
        raise InvalidRequestError(
            f"query has shape {tuple(q.shape)}: each head must be [q_latent ({latent_dim}), "
            f"q_rope ({rope})], {width} wide like the cache's rows"
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
    named = {"query": q, "query_start_loc": qsl, "seq_lens": lens, "block_tables": tables}
    check_device(cache.device, *named.items())
    return q, cache, qsl, lens, tables


def _launch(
    q: torch.Tensor,
    cache: torch.Tensor,
    out: torch.Tensor,
    qsl: torch.Tensor,
    lens: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    kv_scale: float,
    variant: _Variant,
    plan: LatentPlan,
    max_query_len: int,
) -> None:
    num_seqs, (num_tokens, num_heads, _), latent = lens.shape[0], q.shape, out.shape[2]
    rope = cache.shape[2] - latent
    latent_pad, heads_pad = max(16, next_pow2(latent)), next_pow2(plan.heads)
    num_q_tiles = cdiv(max_query_len, plan.block_q)
    split = plan.num_splits > 1
    keys_per_split = cdiv(cdiv(plan.keys, plan.num_splits), plan.block_n) * plan.block_n
    upcast = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and not bf16_as_compiled())
    fp8 = fp8_constexprs(cache.dtype)
    fp8.pop("FP8_MAX")  # only the KV write saturates
    kv_scale = kv_scale if fp8["FP8_MANT"] else 1.0
    if variant.softcap is None:
        score_mul, cap_log2 = scale * kv_scale * _LOG2E, 0.0
    else:
        score_mul, cap_log2 = scale * kv_scale / variant.softcap, variant.softcap * _LOG2E
    dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
    sinks = dummy if variant.sinks is None else variant.sinks
    if split:
        part = torch.empty(
            num_tokens, num_heads, plan.num_splits, latent, dtype=torch.float32, device=q.device
        )
        lse = torch.empty(
            num_tokens, num_heads, plan.num_splits, dtype=torch.float32, device=q.device
        )
        target, t_strides = part, (part.stride(0), part.stride(1), part.stride(2))
        l_strides = (lse.stride(0), lse.stride(1))
    else:
        lse, target = dummy, out
        t_strides, l_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    grid = (num_seqs * num_q_tiles, cdiv(num_heads, plan.heads), plan.num_splits)
    _latent_kernel[grid](
        q, as_bytes(cache), target, lse, qsl, lens, tables, sinks,
        dummy if variant.alibi is None else variant.alibi,
        score_mul, cap_log2, kv_scale, variant.window or 0, num_q_tiles, keys_per_split,
        q.stride(0), q.stride(1), *t_strides, cache.stride(0), cache.stride(1),
        tables.stride(0), *l_strides,
        NUM_HEADS=num_heads, HEADS=plan.heads, HEADS_PAD=heads_pad,
        LATENT=latent, LATENT_PAD=latent_pad, ROPE=rope, ROPE_PAD=max(16, next_pow2(rope)),
        BLOCK_SIZE=cache.shape[1], BLOCK_Q=plan.block_q, BLOCK_M=plan.block_q * heads_pad,
        BLOCK_N=plan.block_n, SPLIT=split, UPCAST=upcast, IEEE=q.dtype == torch.float32,
        USE_SOFTCAP=variant.softcap is not None, USE_ALIBI=variant.alibi is not None,
        USE_WINDOW=variant.window is not None, USE_SINKS=variant.sinks is not None,
        **fp8, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    if split:
        merge_heads = heads_pad if not launch_target(q.device).gpu else min(heads_pad, 16)
        _merge_kernel[(num_tokens, cdiv(num_heads, merge_heads))](
            part, lse, out, qsl, sinks, num_seqs, plan.num_splits,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEADS=merge_heads, LATENT=latent, LATENT_PAD=latent_pad,
            SPLIT_PAD=next_pow2(plan.num_splits), USE_SINKS=variant.sinks is not None,
        )  # fmt: skip
