"""KV write (``reshape_and_cache``): scatter the new tokens' K and V rows into their slots.

Slot ``s`` is row ``s`` of the cache viewed as ``[num_blocks * block_size, H_kv * D]``,
so one token's K (or V) is one contiguous row on both sides. Padding slots
(``-1``) write nothing, and the token count is ``len(slot_mapping)``: rows of
``key`` past it are padding that is never read.

An fp8 cache (``torch.float8_e4m3fn`` / ``float8_e5m2``) stores what
:func:`spec.quant.quantize` defines: ``x / scale`` divided in float32 with
IEEE rounding (``div.rn.f32``), then rounded to fp8, ties to even, saturating
(see :mod:`._fp8`). The spec would also accept the approximate division a
plain ``/`` compiles to (2 ulp: :func:`spec.quant.quantize_range`); this
kernel stores the nominal value, so its bytes equal the spec's everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_gpu.kernels._checks import (
    FLOAT_DTYPES,
    check_cache_pair,
    check_device,
    check_last_dim_dense,
    check_tensor,
    check_write_slots,
)
from backend_gpu.kernels._fp8 import as_bytes, fp8_constexprs, fp8_quantize
from backend_gpu.kernels.plan import write_tile
from backend_gpu.kernels.target import launch_target
from spec.errors import InvalidRequestError
from spec.validate import check_scale


# The token count varies with every write: not a specialisation to compile (compiled Triton would
# otherwise compile once for counts divisible by 16, once for others, once for a single token).
@triton.jit(do_not_specialize=["num_tokens"])  # type: ignore[untyped-decorator]
def _kv_write_kernel(  # type: ignore[no-untyped-def]
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh, k_scale, v_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """One program writes ``BLOCK_T`` tokens; each token's row is ``H_kv * D`` wide.

    ``FP8_MANT > 0``: the cache is fp8 bytes, and each value is quantized first.
    """
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)
    keep = tok_ok & (slot >= 0)
    col = tl.arange(0, ROW_PAD)
    col_ok = col < NUM_KV_HEADS * HEAD_DIM
    head = col // HEAD_DIM
    d = col % HEAD_DIM
    mask = keep[:, None] & col_ok[None, :]
    tok64 = tok.to(tl.int64)[:, None]
    src_k = key_ptr + tok64 * stride_kt + (head * stride_kh + d)[None, :]
    src_v = value_ptr + tok64 * stride_vt + (head * stride_vh + d)[None, :]
    dst = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + col[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    if FP8_MANT:
        k = fp8_quantize(k, k_scale, FP8_MANT, FP8_MIN_EXP, FP8_MAX)
        v = fp8_quantize(v, v_scale, FP8_MANT, FP8_MIN_EXP, FP8_MAX)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key[i]``, ``value[i]`` (``[>= T, H_kv, D]``) into slot ``slot_mapping[i]``.

    ``T = len(slot_mapping)`` (int64, on the cache's device); slot ``-1`` is skipped.
    ``key`` and ``value`` must have the cache's dtype (no silent rounding), or,
    for an fp8 cache, any float dtype: they are quantized with ``k_scale`` and
    ``v_scale`` (the layer's per-tensor scales; ignored for other caches).
    ``check_slots`` validates the slot range on the host, which synchronises a
    GPU; an engine that trusts its scheduler may turn it off.
    """
    k_cache, v_cache = check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    n = slots.shape[0]
    fp8 = fp8_constexprs(k_cache.dtype)
    scales = (check_scale("k_scale", k_scale), check_scale("v_scale", v_scale))
    for name, x in (("key", key), ("value", value)):
        check_tensor(name, x, 3, FLOAT_DTYPES if fp8["FP8_MANT"] else (k_cache.dtype,))
        if x.shape[1:] != k_cache.shape[2:] or x.shape[0] < n:
            raise InvalidRequestError(
                f"{name} has shape {tuple(x.shape)}, expected [>= {n}, {num_kv_heads}, {head_dim}]"
            )
        check_last_dim_dense(name, x)
    named = {"key": key, "value": value, "v_cache": v_cache, "slot_mapping": slots}
    check_device(k_cache.device, *named.items())
    check_write_slots(slots, num_blocks * block_size, check_slots)
    if n == 0:
        return
    row_pad, block_t = write_tile(num_kv_heads * head_dim, launch_target(k_cache.device))
    _kv_write_kernel[(triton.cdiv(n, block_t),)](
        key, value, as_bytes(k_cache), as_bytes(v_cache), slots, n, key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), *scales, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        ROW_PAD=row_pad, BLOCK_T=block_t, **fp8,
    )  # fmt: skip
