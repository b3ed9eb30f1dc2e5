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

Under the interpreter, loaded values are upcast to float32 before any
arithmetic, because the interpreter's bfloat16 arithmetic is wrong.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backend_gpu.kernels._checks import (
    FLOAT_DTYPES,
    cdiv,
    check_cache_pair,
    check_device,
    check_last_dim_dense,
    check_tensor,
    interpreting,
    next_pow2,
)
from spec.errors import InvalidRequestError

_LOG2E = 1.4426950408889634

MAX_HEAD_DIM = 256
"""Largest head dim the kernels are built for: a 256-wide K tile already fills shared memory."""


@triton.jit  # type: ignore[untyped-decorator]
def _attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
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
):
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

        # Keys this tile may see: 0 .. (position of its last real token), within this split.
        kv_hi = context + tl.minimum(query_len, (q_tile + 1) * BLOCK_Q)
        kv_lo = 0
        if SPLIT:
            kv_lo = tl.program_id(2) * keys_per_split
            kv_hi = tl.minimum(kv_hi, kv_lo + keys_per_split)

        # Running max starts finite, so exp2(m_old - m_new) is never NaN for an empty tile.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(kv_lo, kv_hi, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            t_ok = t < kv_hi
            block = tl.load(table + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
            in_block = (t % BLOCK_SIZE).to(tl.int64)
            k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
            k = tl.load(
                k_ptr + k_off[None, :] + d[:, None], mask=t_ok[None, :] & d_ok[:, None], other=0.0
            )
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, k, input_precision="ieee") if IEEE else tl.dot(q, k)
            visible = t_ok[None, :] & (t[None, :] <= pos[:, None])
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
            v = tl.load(
                v_ptr + v_off[:, None] + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0
            )
            if UPCAST:
                v = v.to(tl.float32)
            else:
                p = p.to(v.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new

        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / safe_l[:, None]
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
def _merge_kernel(  # type: ignore[no-untyped-def]
    part_ptr,
    lse_ptr,
    out_ptr,
    query_start_loc_ptr,
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
):
    """Program ``(t, h)`` merges token ``t``, head ``h``: weights ``2^(lse_s - max lse)``.

    Rows past the batch's last token are padding: nothing to merge, nothing written.
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    real = t < tl.load(query_start_loc_ptr + num_seqs).to(tl.int64)
    s = tl.arange(0, SPLIT_PAD)
    s_ok = s < tl.where(real, num_splits, 0)
    lse = tl.load(lse_ptr + t * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    top = tl.maximum(tl.max(lse, 0), -1.0e30)  # finite even for a padding row (all -inf)
    w = tl.where(s_ok, tl.exp2(lse - top), 0.0)
    d = tl.arange(0, HEAD_PAD)
    part = tl.load(
        part_ptr + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=(w > 0.0)[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < tl.where(real, HEAD_DIM, 0),
    )


@dataclass(frozen=True)
class _Plan:
    """Tile sizes and the number of KV splits for one launch."""

    block_q: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


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
    """
    q, k_cache, v_cache, qsl, lens, tables = _check_inputs(
        query, k_cache, v_cache, query_start_loc, seq_lens, block_tables
    )
    num_seqs, (_, _, num_kv_heads, head_dim) = lens.shape[0], k_cache.shape
    if check_indices:
        true_max = _check_metadata(qsl, lens, tables, k_cache.shape, q.shape[0])
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
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    group = q.shape[1] // num_kv_heads
    plan = _plan(
        num_seqs,
        num_kv_heads,
        group,
        head_dim,
        max_query_len,
        max_seq_len,
        num_splits,
        q.device,
        block_n,
    )
    # The interpreter converts float32 to bfloat16 by truncation (toward zero), a GPU to
    # nearest: under it, the kernel writes float32 and torch rounds (the suite's bias check
    # sees the difference).
    staged = interpreting() and out.dtype == torch.bfloat16
    target = torch.empty(out.shape, dtype=torch.float32, device=out.device) if staged else out
    _launch(
        q,
        k_cache,
        v_cache,
        target,
        qsl,
        lens,
        tables,
        scale,
        group,
        plan,
        max_query_len,
        max_seq_len,
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
    if q.dtype != k_cache.dtype:
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


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    qsl: torch.Tensor,
    lens: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    group: int,
    plan: _Plan,
    max_query_len: int,
    max_seq_len: int,
) -> None:
    num_seqs, num_kv_heads = lens.shape[0], k_cache.shape[2]
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    head_pad = max(16, next_pow2(head_dim))
    num_q_tiles = cdiv(max_query_len, plan.block_q)
    split = plan.num_splits > 1
    keys_per_split = cdiv(cdiv(max_seq_len, plan.num_splits), plan.block_n) * plan.block_n
    upcast = interpreting() or q.dtype == torch.float32
    ieee = q.dtype == torch.float32 and not interpreting()
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
        lse = torch.empty(1, dtype=torch.float32, device=q.device)
        target, t_strides, l_strides = out, (out.stride(0), out.stride(1), 0), (0, 0)
    grid = (num_seqs * num_q_tiles, num_kv_heads, plan.num_splits)
    _attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        target,
        lse,
        qsl,
        lens,
        tables,
        scale * _LOG2E,
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
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if split:
        _merge_kernel[(q.shape[0], q.shape[1])](
            part,
            lse,
            out,
            qsl,
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
        )


def _plan(
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None,
    device: torch.device,
    block_n: int | None = None,
) -> _Plan:
    """Tile sizes, and how many KV splits: forced, or by the occupancy heuristic.

    Under the interpreter each program costs milliseconds per loop step, so
    one fat program per (sequence, KV head) is best; speed does not matter
    there, coverage does, so a long decode (256+ keys) is split all the same,
    so that the CPU path runs the split-KV kernel and its merge too. On a GPU,
    decode tiles have 16 rows (the smallest ``tl.dot``) and prefill
    tiles 64; a decode batch that would leave the GPU idle (fewer programs than
    twice the SM count) with contexts of 1024+ keys is split so that it fills it.
    """
    group_pad = next_pow2(group)
    head_pad = max(16, next_pow2(head_dim))
    if device.type == "cpu":
        rows = max(16, min(256, next_pow2(max_query_len) * group_pad))
        tile_n = min(64, max(16, next_pow2(max_seq_len)))
        warps, stages = 4, 1
    else:
        rows = 16 if max_query_len * group_pad <= 16 else 64
        tile_n = 64 if head_pad <= 128 else 32
        warps, stages = 4, 2 if head_pad <= 128 else 1
    block_q = max(1, rows // group_pad)
    if block_n is None:
        block_n = tile_n
    elif block_n < 16 or block_n != next_pow2(block_n):
        raise InvalidRequestError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        num_splits = _auto_splits(
            num_seqs * cdiv(max_query_len, block_q) * num_kv_heads, rows, max_seq_len, device
        )
    if not 1 <= num_splits <= 1024:
        raise InvalidRequestError(f"num_splits must be in 1..1024, got {num_splits}")
    return _Plan(block_q, block_n, num_splits, warps, stages)


def _auto_splits(programs: int, rows: int, max_seq_len: int, device: torch.device) -> int:
    if device.type == "cpu":
        return 1 if rows > 16 or max_seq_len < 256 else min(4, cdiv(max_seq_len, 128))
    if device.type != "cuda" or rows > 16 or max_seq_len < 1024:
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= 2 * sms:
        return 1
    return max(1, min(cdiv(2 * sms, programs), cdiv(max_seq_len, 512), 64))


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _check_metadata(
    qsl: torch.Tensor,
    lens: torch.Tensor,
    tables: torch.Tensor,
    cache_shape: torch.Size,
    query_rows: int,
) -> tuple[int, int]:
    """The metadata is well formed and every table entry that will be read is a block.

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
        row = host_tables[i, :used]
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
) -> int:
    """How many KV splits :func:`paged_attention` picks by itself for a batch of this shape."""
    group = num_heads // num_kv_heads
    plan = _plan(num_seqs, num_kv_heads, group, head_dim, max_query_len, max_seq_len, None, device)
    return plan.num_splits
