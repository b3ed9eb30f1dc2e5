"""The online softmax of both attention kernels: one tile of query rows over tiles of keys.

Each query row keeps, in float32, the running max ``m`` of its scores (log2 units), the
sum ``l`` of ``2^(s - m)`` and ``acc``, the values weighted alike; each key tile rescales
the three by ``2^(m_old - m_new)``. After the last tile ``acc / l`` is the row's output
and ``m + log2(l)`` its log-sum-exp, by which split-KV's merge weighs a part. The kernels
(:mod:`.attention`, :mod:`.latent_attention`) own their tile loads and scoring; the
softmax, its variants and the stores are these three helpers. Why not smaller ones: each
helper call re-patches ``triton.language`` under Triton's interpreter (half a millisecond),
so a key tile costs one call.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def query_tile(query_start_loc_ptr, num_q_tiles):  # type: ignore[no-untyped-def]
    """``(seq, q_tile, q_start, query_len)``: this program holds query tile ``q_tile`` of
    sequence ``seq``, whose ``query_len`` new tokens are the batch's rows ``q_start ..``."""
    seq = tl.program_id(0) // num_q_tiles
    q_tile = tl.program_id(0) % num_q_tiles
    q_start = tl.load(query_start_loc_ptr + seq)
    return seq, q_tile, q_start, tl.load(query_start_loc_ptr + seq + 1) - q_start


@triton.jit  # type: ignore[untyped-decorator]
def softmax_start(  # type: ignore[no-untyped-def]
    sinks_ptr, alibi_ptr, head, row_ok, context, query_len, q_tile, window, keys_per_split,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH_PAD: tl.constexpr, SPLIT: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr, USE_ALIBI: tl.constexpr,
):  # fmt: skip
    """``(kv_lo, kv_hi, m, l, acc, slope)``: the keys a query tile walks, the softmax's start
    and its rows' ALiBi slopes.

    The keys run to the position of the tile's last real token and, with a window of
    ``w``, from ``w - 1`` before its first token's: tiles wholly before the window are
    never read (their blocks may be released), so a decode at ``p`` reads ``ceil(min(w,
    p + 1) / BLOCK_N)`` tiles. A split takes its range of those. ``m`` starts finite, so
    ``exp2(m_old - m_new)`` is never NaN for an empty tile; a sink is one more logit with
    weight and no value (split: the merge adds it, once).
    """
    kv_hi = context + tl.minimum(query_len, (q_tile + 1) * BLOCK_Q)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(context + q_tile * BLOCK_Q - window + 1, 0)
    if SPLIT:
        kv_lo = kv_lo + tl.program_id(2) * keys_per_split
        kv_hi = tl.minimum(kv_hi, kv_lo + keys_per_split)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS and not SPLIT:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=-1.0e30)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    slope = 0.0
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)
    acc = tl.zeros([BLOCK_M, WIDTH_PAD], dtype=tl.float32)
    return kv_lo, kv_hi, m_i, l_i, acc, slope


@triton.jit  # type: ignore[untyped-decorator]
def softmax_step(  # type: ignore[no-untyped-def]
    s, m_i, l_i, t, t_ok, pos, slope, score_mul, cap_log2, window,
    USE_SOFTCAP: tl.constexpr, USE_ALIBI: tl.constexpr, USE_WINDOW: tl.constexpr,
):  # fmt: skip
    """``(p, alpha, m, l)`` after the key tile ``t`` of dot products ``s``: the caller adds
    ``p @ values`` to ``acc * alpha``.

    ``score_mul`` is ``scale * k_scale * log2(e)``, or with a soft-cap ``c``, ``scale *
    k_scale / c``, and the capped score ``cap_log2 * tanh(.)`` (``c * log2(e)``); ``tanh``
    from one ``exp2`` of ``-2|x|``, which never overflows. Query row ``r`` at position
    ``pos[r]`` sees keys ``t <= pos[r]`` (and ``> pos[r] - window``).
    """
    s = s * score_mul
    if USE_SOFTCAP:
        e = tl.exp2(-2.8853900817779268 * tl.abs(s))  # exp(-2 |s|)
        tanh = (1.0 - e) / (1.0 + e)
        s = cap_log2 * tl.where(s < 0, -tanh, tanh)
    if USE_ALIBI:
        s += slope[:, None] * (t[None, :] - pos[:, None]).to(tl.float32)
    visible = t_ok[None, :] & (t[None, :] <= pos[:, None])
    if USE_WINDOW:
        visible = visible & (t[None, :] > pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit  # type: ignore[untyped-decorator]
def store_rows(  # type: ignore[no-untyped-def]
    out_ptr, lse_ptr, acc, m_i, l_i, v_scale, row_off, head, row_ok, col, col_ok,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    SPLIT: tl.constexpr, FP8_MANT: tl.constexpr,
):  # fmt: skip
    """Store the tile's rows ``acc / l``; split, as this part of ``[T, H, parts, width]``, with
    its log-sum-exp ``m + log2(l)`` (``-inf`` for no key). fp8 values are dequantized here,
    once: ``sum_t w_t * (stored_t * v_scale)``."""
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / safe_l[:, None]
    if FP8_MANT:
        out = out * v_scale
    o_off = row_off[:, None] * stride_ot + head[:, None] * stride_oh + col[None, :]
    if SPLIT:
        split = tl.program_id(2)
        o_off += split * stride_os
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        l_off = row_off * stride_lt + head * stride_lh + split
        tl.store(lse_ptr + l_off, lse, mask=row_ok)
    tl.store(
        out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :]
    )
