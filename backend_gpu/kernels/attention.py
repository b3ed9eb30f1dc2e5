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

The softmax, its variants (:mod:`.variant`) and the stores are
:mod:`.online_softmax`'s. Split-KV (flash-decoding): with few programs and long
contexts, a third grid axis cuts each sequence's keys into ``num_splits`` ranges
(:mod:`.plan`); each writes a partial output and its log-sum-exp, and
:func:`_merge_kernel` merges the partials, one head's parts as one tile, adding a
sink once (the splits leave it out) as one more term of weight
``2^(sink - top)`` and no value. An empty split has ``lse = -inf`` and weight zero.

fp8 KV: the cache holds fp8 bytes, decoded exactly (:mod:`._fp8`), which is exact
in float16 and bfloat16 too, so the dot products lose nothing either.

The interpreter runs the same code a GPU compiles (float16 and bfloat16 dot
products on their own operands, probabilities rounded to the activation dtype
before ``P @ V``; float32 with IEEE products, never TF32), with one exception:
Triton's own interpreter computes bfloat16 on raw bits, so under it, and only
there, bfloat16 is upcast to float32 (:func:`.launch.staged`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from backend_gpu.kernels._checks import (
    FLOAT_DTYPES,
    check_cache_pair,
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
from spec.validate import check_scale

MAX_HEAD_DIM = 256
"""Largest head dim the kernels are built for: a 256-wide K tile already fills shared memory."""


# Counts, the window and the table's width change from batch to batch: not specialisations to
# compile (each would add kernels for values that are 1 or divisible by 16; a conformance run
# launched 118 distinct ones before, 281 across the kernels).
@triton.jit(do_not_specialize=["window", "num_q_tiles", "keys_per_split", "stride_bt"])  # type: ignore[untyped-decorator]
def _attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr, alibi_ptr,
    score_mul, cap_log2, v_scale, window, num_q_tiles, keys_per_split,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_bt, stride_lt, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_ALIBI: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
):  # fmt: skip
    # BLOCK_M = BLOCK_Q * GROUP_PAD rows: query tokens x the heads of one KV head's group.
    seq, q_tile, q_start, query_len = query_tile(query_start_loc_ptr, num_q_tiles)
    kv_head = tl.program_id(1)
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
        kv_lo, kv_hi, m_i, l_i, acc, slope = softmax_start(
            sinks_ptr, alibi_ptr, head, row_ok, context, query_len, q_tile, window,
            keys_per_split, BLOCK_Q, BLOCK_M, HEAD_PAD, SPLIT, USE_WINDOW, USE_SINKS, USE_ALIBI,
        )  # fmt: skip
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
            # Each tile in the dot's dtype, q's (fp8: decoded first).
            k = (fp8_decode(k, FP8_MANT, FP8_MIN_EXP) if FP8_MANT else k).to(q.dtype)
            s = tl.dot(q, k, input_precision="ieee" if IEEE else None)
            p, alpha, m_i, l_i = softmax_step(
                s, m_i, l_i, t, t_ok, pos, slope, score_mul, cap_log2, window,
                USE_SOFTCAP, USE_ALIBI, USE_WINDOW,
            )  # fmt: skip
            v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
            v = tl.load(
                v_ptr + v_off[:, None] + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0
            )
            v = (fp8_decode(v, FP8_MANT, FP8_MIN_EXP) if FP8_MANT else v).to(q.dtype)
            p = p.to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee" if IEEE else None)
        store_rows(
            out_ptr, lse_ptr, acc, m_i, l_i, v_scale, row_off, head, row_ok, d, d_ok,
            stride_ot, stride_oh, stride_os, stride_lt, stride_lh, SPLIT, FP8_MANT,
        )  # fmt: skip


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])  # type: ignore[untyped-decorator]
def _merge_kernel(  # type: ignore[no-untyped-def]
    part_ptr, lse_ptr, out_ptr, query_start_loc_ptr, sinks_ptr, num_seqs, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLIT_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
):  # fmt: skip
    """Program ``(t, h)`` merges token ``t``, head ``h``, its parts as one ``[SPLIT_PAD,
    HEAD_PAD]`` tile: weights ``2^(lse_s - max lse)``.

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
    variant = check_variant(window, softcap, sinks, alibi_slopes, q, k_scale, v_scale)
    num_seqs, (_, _, num_kv_heads, head_dim) = lens.shape[0], k_cache.shape
    given = (max_query_len, max_seq_len)
    max_query_len, max_seq_len = batch_maxima(
        qsl, lens, tables, k_cache.shape, q.shape[0], window, given, check_indices
    )
    if out is None:
        out = torch.empty_like(q)
    else:
        _check_out(out, q)
    if num_seqs == 0 or max_query_len == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_scale("scale", scale)
    batch = BatchShape(num_seqs, max_query_len, max_seq_len, window)
    group = q.shape[1] // num_kv_heads
    plan = _plan(batch, num_kv_heads, group, head_dim, launch_target(q.device), num_splits, block_n)
    written = staged(out)
    head_pad = max(16, next_pow2(head_dim))
    parts = launch(
        _attention_kernel, (k_cache, v_cache), q, written, (qsl, lens, tables), scale, variant,
        plan, GROUP=group, GROUP_PAD=next_pow2(group), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=plan.block_q, BLOCK_M=plan.block_q * next_pow2(group),
        BLOCK_N=plan.block_n,
    )  # fmt: skip
    if parts is not None:
        _merge_kernel[(q.shape[0], q.shape[1])](
            *parts.merge_args(written, qsl, num_seqs), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            SPLIT_PAD=next_pow2(plan.num_splits), USE_SINKS=variant.sinks is not None,
        )  # fmt: skip
    return unstaged(out, written, qsl)


def _check_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Types, dtypes, shapes, strides and devices; the index ranges are
    :func:`.metadata.batch_maxima`'s."""
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
    qsl, lens, tables = check_batch(query_start_loc, seq_lens, block_tables)
    named = {"query": q, "v_cache": v_cache, "query_start_loc": qsl, "seq_lens": lens}
    check_device(k_cache.device, *named.items(), ("block_tables", tables))
    return q, k_cache, v_cache, qsl, lens, tables


def _plan(
    batch: BatchShape,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    target: LaunchTarget,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> Plan:
    """Tile sizes, and how many KV splits: forced, or by the occupancy heuristic, for ``target``.

    A GPU's plan (:mod:`.target`; the interpreter runs it too, by default):
    decode tiles have 16 rows (the smallest ``tl.dot``) and prefill tiles 64;
    a decode batch that would leave the GPU idle (fewer programs than twice
    the SM count) with contexts of 1024+ keys is split so that it fills it.
    The interpreter's own plan: each program costs milliseconds per loop step,
    so one fat program per (sequence, KV head), and a long decode (256+ keys)
    is split all the same, so that the split-KV kernel and its merge run too
    (:func:`.plan.finish_plan`).
    """
    group_pad = next_pow2(group)
    if target.gpu:
        rows = 16 if batch.max_query_len * group_pad <= 16 else 64
    else:
        rows = max(16, min(256, next_pow2(batch.max_query_len) * group_pad))
    gpu_tile = (64, 4, 2) if max(16, next_pow2(head_dim)) <= 128 else (32, 4, 1)
    block_q = max(1, rows // group_pad)
    return finish_plan(
        target, group, num_kv_heads, block_q, rows, gpu_tile, batch, num_splits, block_n
    )


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
    batch = BatchShape(num_seqs, max_query_len, max_seq_len, window)
    return _plan(batch, num_kv_heads, group, head_dim, launch_target(device)).num_splits
