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
scores. The online softmax, the variants, split-KV and fp8 are the same as
:mod:`.attention`'s (:mod:`.online_softmax`); an fp8 row has one scale, folded
into the score multiplier and into the output. :func:`_merge_kernel` merges a
head tile's parts one part at a time (a tile of 16 heads x 512 holds no more).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from backend_gpu.kernels._checks import (
    CACHE_DTYPES,
    FLOAT_DTYPES,
    check_contiguous,
    check_device,
    check_last_dim_dense,
    check_tensor,
    next_pow2,
)
from backend_gpu.kernels._fp8 import FP8_NAMES, fp8_decode
from backend_gpu.kernels.launch import launch, staged, unstaged
from backend_gpu.kernels.metadata import batch_maxima, check_batch
from backend_gpu.kernels.online_softmax import (
    query_tile,
    softmax_start,
    softmax_step,
    store_rows,
)
from backend_gpu.kernels.plan import BatchShape, Plan, finish_plan
from backend_gpu.kernels.target import LaunchTarget, launch_target
from backend_gpu.kernels.variant import check_variant
from spec.errors import InvalidRequestError
from spec.kv_budget import cdiv
from spec.validate import check_int, check_scale

MAX_LATENT_DIM = 512
"""Widest latent part the kernel is built for: DeepSeek-V2/V3's ``kv_lora_rank``. A GPU
program holds a ``[16, 512]`` float32 accumulator; a wider one would spill."""
MAX_ROPE_DIM = 128
"""Widest rope part the kernel is built for (DeepSeek's is 64)."""


def latent_limits(latent_dim: int, rope_dim: int) -> str | None:
    """The widths the latent kernels are built for, if ``latent_dim + rope_dim`` exceeds them.

    >>> latent_limits(512, 64), latent_limits(576, 64)
    (None, 'latent_dim <= 512 and rope_dim <= 128')
    """
    if latent_dim <= MAX_LATENT_DIM and rope_dim <= MAX_ROPE_DIM:
        return None
    return f"latent_dim <= {MAX_LATENT_DIM} and rope_dim <= {MAX_ROPE_DIM}"


# Integers that vary per batch are not specialisations to compile (as in .attention).
@triton.jit(do_not_specialize=["window", "num_q_tiles", "keys_per_split", "stride_bt"])  # type: ignore[untyped-decorator]
def _latent_kernel(  # type: ignore[no-untyped-def]
    q_ptr, cache_ptr, out_ptr, lse_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    sinks_ptr, alibi_ptr, score_mul, cap_log2, kv_scale, window, num_q_tiles, keys_per_split,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_cb, stride_cs, stride_bt,
    stride_lt, stride_lh, NUM_HEADS: tl.constexpr, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    LATENT: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr,
    FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
):  # fmt: skip
    # Row r: token r // HEADS_PAD of the tile, head head_tile * HEADS + r % HEADS_PAD.
    seq, q_tile, q_start, query_len = query_tile(query_start_loc_ptr, num_q_tiles)
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

        kv_lo, kv_hi, m_i, l_i, acc, slope = softmax_start(
            sinks_ptr, alibi_ptr, head, row_ok, context, query_len, q_tile, window,
            keys_per_split, BLOCK_Q, BLOCK_M, LATENT_PAD, SPLIT, USE_WINDOW, USE_SINKS, USE_ALIBI,
        )  # fmt: skip
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
            # Both parts in the dot's dtype, q's (fp8: decoded first).
            kv = (fp8_decode(kv, FP8_MANT, FP8_MIN_EXP) if FP8_MANT else kv).to(q_lat.dtype)
            kr = (fp8_decode(kr, FP8_MANT, FP8_MIN_EXP) if FP8_MANT else kr).to(q_lat.dtype)
            s = tl.dot(q_lat, tl.trans(kv), input_precision="ieee" if IEEE else None)
            s = s + tl.dot(q_rope, kr, input_precision="ieee" if IEEE else None)
            p, alpha, m_i, l_i = softmax_step(
                s, m_i, l_i, t, t_ok, pos, slope, score_mul, cap_log2, window,
                USE_SOFTCAP, USE_ALIBI, USE_WINDOW,
            )  # fmt: skip
            p = p.to(kv.dtype)
            acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee" if IEEE else None)
        store_rows(
            out_ptr, lse_ptr, acc, m_i, l_i, kv_scale, row_off, head, row_ok, c, c_ok,
            stride_ot, stride_oh, stride_os, stride_lt, stride_lh, SPLIT, FP8_MANT,
        )  # fmt: skip


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])  # type: ignore[untyped-decorator]
def _merge_kernel(  # type: ignore[no-untyped-def]
    part_ptr, lse_ptr, out_ptr, query_start_loc_ptr, sinks_ptr, num_seqs, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEADS: tl.constexpr, LATENT: tl.constexpr, LATENT_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr, USE_SINKS: tl.constexpr,
):  # fmt: skip
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
) -> Plan:
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
    gpu_tile = (32, 8, 1) if latent_pad >= 512 else (64, 4, 2)
    batch = BatchShape(num_seqs, max_query_len, max_seq_len, window)
    return finish_plan(
        target, heads, cdiv(num_heads, heads), block_q, block_q * next_pow2(heads), gpu_tile,
        batch, num_splits, block_n,
    )  # fmt: skip


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
    q, cache, qsl, lens, tables, rope_dim = _check_inputs(
        query, cache, query_start_loc, seq_lens, block_tables, latent_dim
    )
    scale = check_scale("scale", scale)
    variant = check_variant(window, softcap, sinks, alibi_slopes, q)
    kv_scale = check_scale("kv_scale", kv_scale)
    variant = replace(variant, k_scale=kv_scale, v_scale=kv_scale)  # one scale for the row
    num_seqs, num_heads = lens.shape[0], q.shape[1]
    given = (max_query_len, max_seq_len)
    max_query_len, max_seq_len = batch_maxima(
        qsl, lens, tables, cache.shape, q.shape[0], window, given, check_indices
    )
    shape = (q.shape[0], num_heads, latent_dim)
    if out is None:
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != q.dtype:
        raise InvalidRequestError(f"out must be {shape} {q.dtype}")
    else:
        check_device(q.device, ("out", out))
        check_last_dim_dense("out", out)
    if num_seqs == 0 or max_query_len == 0:
        return out
    target = launch_target(q.device)
    plan = latent_plan(
        num_seqs, num_heads, latent_dim, max_query_len, max_seq_len, target,
        num_splits=num_splits, block_n=block_n, window=window,
    )  # fmt: skip
    written = staged(out)
    latent_pad, heads_pad = max(16, next_pow2(latent_dim)), next_pow2(plan.heads)
    parts = launch(
        _latent_kernel, (cache,), q, written, (qsl, lens, tables), scale, variant, plan,
        NUM_HEADS=num_heads, HEADS=plan.heads, HEADS_PAD=heads_pad, LATENT=latent_dim,
        LATENT_PAD=latent_pad, ROPE=rope_dim, ROPE_PAD=max(16, next_pow2(rope_dim)),
        BLOCK_SIZE=cache.shape[1], BLOCK_Q=plan.block_q, BLOCK_M=plan.block_q * heads_pad,
        BLOCK_N=plan.block_n,
    )  # fmt: skip
    if parts is not None:
        merge_heads = heads_pad if not target.gpu else min(heads_pad, 16)
        _merge_kernel[(q.shape[0], cdiv(num_heads, merge_heads))](
            *parts.merge_args(written, qsl, num_seqs), NUM_HEADS=num_heads, HEADS=merge_heads,
            LATENT=latent_dim, LATENT_PAD=latent_pad, SPLIT_PAD=next_pow2(plan.num_splits),
            USE_SINKS=variant.sinks is not None,
        )  # fmt: skip
    return unstaged(out, written, qsl)


def _check_inputs(
    query: torch.Tensor,
    cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    latent_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Types, dtypes, widths, strides and devices, and the rope part's width; the index ranges
    are :func:`.metadata.batch_maxima`'s."""
    cache = check_tensor("cache", cache, 3, CACHE_DTYPES)
    check_contiguous("cache", cache)
    width = cache.shape[2]
    latent_dim = check_int("latent_dim", latent_dim, low=1, high=width - 1)
    rope = width - latent_dim
    limits = latent_limits(latent_dim, rope)
    if limits:
        raise InvalidRequestError(
            f"latent layout {latent_dim}+{rope}: the kernel is built for {limits}"
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
    qsl, lens, tables = check_batch(query_start_loc, seq_lens, block_tables)
    named = {"query": q, "query_start_loc": qsl, "seq_lens": lens, "block_tables": tables}
    check_device(cache.device, *named.items())
    return q, cache, qsl, lens, tables, rope
