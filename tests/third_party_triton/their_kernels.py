"""An outside project's paged KV kernels, as a kernel author would ship them (not ours).

This stands in for a library a reader already has: its own names, its own
argument order and its own limits, written without this project in mind (it
imports only torch and triton). ``docs/plugging-in.md`` wires it to the
contract through ``adapter.py`` next to it. Its API:

* ``store_kv(key, value, k_cache, v_cache, slots)``: token ``i``'s K and V rows
  go to cache slot ``slots[i]`` (int32; ``-1`` skips the token).
* ``paged_decode(out, q, k_cache, v_cache, block_table, seq_lens, sm_scale)``:
  one new token per sequence (row ``i`` of ``q`` is sequence ``i``'s last
  token), attending to its ``seq_lens[i]`` cached tokens through
  ``block_table[i]`` (int32 ``[num_seqs, max_pages]``).

Caches are ``[num_blocks, page_size, num_kv_heads, head_dim]``, contiguous.
Its limits, as its README would state them: decode only; ``page_size`` a
power of two (a token's page and offset are a shift and a mask); head dims up
to 256; on a GPU, float16 and bfloat16 need ``head_dim >= 16`` (the score and
output products are ``tl.dot`` tiles, whose inner dimension must be at least 16
there). It has no block-copy kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

MAX_HEAD_DIM = 256
_MIN_DOT = 16  # a GPU's tl.dot tiles are at least 16 in every dimension


@triton.jit  # type: ignore[untyped-decorator]
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    num_tokens,
    key_stride,
    value_stride,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
    TOKENS: tl.constexpr,
):
    # TOKENS tokens per program, each a K row and a V row of ROW = H_kv * D elements.
    tok = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slots_ptr + tok, mask=tok < num_tokens, other=-1)
    slot = slot.to(tl.int64)  # int64 before scaling: a large pool passes 2^31 elements
    cols = tl.arange(0, ROW_PAD)
    ok = (slot >= 0)[:, None] & (cols < ROW)[None, :]
    tok = tok.to(tl.int64)
    k = tl.load(key_ptr + tok[:, None] * key_stride + cols[None, :], mask=ok)
    v = tl.load(value_ptr + tok[:, None] * value_stride + cols[None, :], mask=ok)
    dst = slot[:, None] * ROW + cols[None, :]
    tl.store(k_cache_ptr + dst, k, mask=ok)
    tl.store(v_cache_ptr + dst, v, mask=ok)


@triton.jit  # type: ignore[untyped-decorator]
def _paged_decode_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    sm_scale,
    stride_q,
    stride_o,
    stride_table,
    stride_page,
    stride_tok,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    LOG2_PAGE: tl.constexpr,
    TILE: tl.constexpr,
    IEEE: tl.constexpr,
):
    # One program per (sequence, KV head): the GROUP query heads that read this KV
    # head are the rows of one tile, padded to GROUP_PAD; keys go TILE tokens at a time.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    head = kv_head * GROUP + g
    q_off = seq.to(tl.int64) * stride_q + head[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0)

    m = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_table
    for start in range(0, seq_len, TILE):
        t = start + tl.arange(0, TILE)
        t_ok = t < seq_len
        page = tl.load(table + (t >> LOG2_PAGE), mask=t_ok, other=0).to(tl.int64)
        offset = (t & ((1 << LOG2_PAGE) - 1)).to(tl.int64)
        kv_off = page * stride_page + offset * stride_tok + kv_head * HEAD_DIM
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = (
            tl.dot(q, tl.trans(k), input_precision="ieee")
            if IEEE
            else tl.dot(q, tl.trans(k))
        )
        s = tl.where(t_ok[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        pv = tl.dot(p, v, input_precision="ieee") if IEEE else tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    out = acc / l_sum[:, None]
    o_off = seq.to(tl.int64) * stride_o + head[:, None] * HEAD_DIM + d[None, :]
    tl.store(
        out_ptr + o_off,
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    **launch: Any,
) -> None:
    """Write ``key[i]``, ``value[i]`` (``[T, H_kv, D]``) into ``slots[i]``; -1 skips.

    ``launch``: Triton launch options (``num_warps=8``, ...), passed to the kernel.
    """
    n = slots.numel()
    if n == 0:
        return
    assert slots.dtype == torch.int32, "slots must be int32"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), (
        "caches must be contiguous"
    )
    assert key.stride(-1) == value.stride(-1) == 1 and key.stride(-2) == key.shape[-1]
    row = k_cache.shape[2] * k_cache.shape[3]
    tokens = max(1, min(64, 4096 // _pow2(row)))  # a tile of at most 4096 elements
    _store_kv_kernel[(triton.cdiv(n, tokens),)](
        key, value, k_cache, v_cache, slots, n, key.stride(0), value.stride(0),
        ROW=row, ROW_PAD=_pow2(row), TOKENS=tokens, **launch,
    )  # fmt: skip


def paged_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    fast_fp32: bool = False,
    **launch: Any,
) -> None:
    """Decode attention: ``out[i]`` (``[num_seqs, H, D]``), sequence i's new token.

    ``fast_fp32``: float32 products on the tensor cores at ``tl.dot``'s default
    precision (TF32 on NVIDIA GPUs: operands keep 10 mantissa bits), not IEEE.
    ``launch``: Triton launch options (``num_warps=8``, ...), passed to the kernel.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    assert head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
    assert block_table.dtype == seq_lens.dtype == torch.int32
    assert q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous()
    if num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, q, k_cache, v_cache, block_table, seq_lens, sm_scale,
        q.stride(0), out.stride(0), block_table.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        GROUP=group, GROUP_PAD=max(_MIN_DOT, _pow2(group)),
        HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim),
        LOG2_PAGE=page_size.bit_length() - 1, TILE=max(64, page_size),
        IEEE=q.dtype == torch.float32 and not fast_fp32, **launch,
    )  # fmt: skip
