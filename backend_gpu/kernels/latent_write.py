"""Latent KV write: each new token's ``[c_kv, k_rope]`` into its slot's row of the layer's cache.

The cache is ``[num_blocks, block_size, latent_dim + rope_dim]``, so slot ``s``
is row ``s`` of its ``[num_blocks * block_size, width]`` view, c_kv in the
first ``latent_dim`` columns and k_rope after them (:mod:`spec.kv_memory`'s
latent layout). Padding slots (``-1``) write nothing, and rows past
``len(slot_mapping)`` are never read. An fp8 cache stores
:func:`spec.quant.quantize` of both parts with the row's one scale: the
division in float32 with IEEE rounding (``div_rn``), then fp8, ties to
even, saturating, as :mod:`.kv_write` does.
"""

from __future__ import annotations

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
    check_write_slots,
)
from backend_gpu.kernels._fp8 import as_bytes, fp8_constexprs, fp8_quantize
from backend_gpu.kernels.plan import write_tile
from backend_gpu.kernels.target import launch_target
from spec.errors import InvalidRequestError
from spec.validate import check_scale


# The token count varies with every write: not a specialisation to compile (as in .kv_write).
@triton.jit(do_not_specialize=["num_tokens"])  # type: ignore[untyped-decorator]
def _latent_write_kernel(  # type: ignore[no-untyped-def]
    c_kv_ptr, k_rope_ptr, cache_ptr, slot_ptr, num_tokens, stride_ct, stride_rt, scale,
    LATENT: tl.constexpr, ROPE: tl.constexpr, ROW_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """One program writes ``BLOCK_T`` tokens' rows: column ``j`` is ``c_kv[j]`` below
    ``LATENT``, ``k_rope[j - LATENT]`` from there to ``LATENT + ROPE``."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)
    keep = (tok_ok & (slot >= 0))[:, None]
    col = tl.arange(0, ROW_PAD)[None, :]
    is_latent = col < LATENT
    is_rope = (col >= LATENT) & (col < LATENT + ROPE)
    tok64 = tok.to(tl.int64)[:, None]
    c = tl.load(c_kv_ptr + tok64 * stride_ct + col, mask=keep & is_latent, other=0)
    rope_col = tl.maximum(col - LATENT, 0)
    r = tl.load(k_rope_ptr + tok64 * stride_rt + rope_col, mask=keep & is_rope, other=0)
    x = tl.where(is_latent, c, r)
    if FP8_MANT:
        x = fp8_quantize(x, scale, FP8_MANT, FP8_MIN_EXP, FP8_MAX)
    dst = cache_ptr + slot[:, None] * (LATENT + ROPE) + col
    tl.store(dst, x, mask=keep & (col < LATENT + ROPE))


def write_latent(
    c_kv: torch.Tensor,
    k_rope: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
    scale: float = 1.0,
) -> None:
    """Write row ``[c_kv[i], k_rope[i]]`` into slot ``slot_mapping[i]`` of ``cache``.

    ``c_kv`` is ``[>= T, 1, latent_dim]`` and ``k_rope`` ``[>= T, 1, rope_dim]``
    (vLLM's ``kv_c`` and ``k_pe``) with ``latent_dim + rope_dim`` the cache's
    row width; ``T = len(slot_mapping)`` (int64), and slot ``-1`` is skipped.
    They must have the cache's dtype, or, for an fp8 cache, any float dtype:
    both are quantized with ``scale``. ``check_slots`` validates the slot range
    on the host (a GPU sync).
    """
    cache = check_tensor("cache", cache, 3, CACHE_DTYPES)
    check_contiguous("cache", cache)
    num_blocks, block_size, width = cache.shape
    slots = check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    n = slots.shape[0]
    fp8 = fp8_constexprs(cache.dtype)
    scale = check_scale("scale", scale)
    parts = []
    for name, x in (("c_kv", c_kv), ("k_rope", k_rope)):
        x = check_tensor(name, x, 3, FLOAT_DTYPES if fp8["FP8_MANT"] else (cache.dtype,))
        if x.shape[1] != 1 or x.shape[0] < n:
            raise InvalidRequestError(f"{name} has shape {tuple(x.shape)}, expected [>= {n}, 1, _]")
        check_last_dim_dense(name, x)
        parts.append(x)
    latent, rope = parts[0].shape[2], parts[1].shape[2]
    if latent + rope != width:
        raise InvalidRequestError(
            f"c_kv ({latent}) and k_rope ({rope}) are {latent + rope} wide, "
            f"the cache's rows {width}"
        )
    check_device(cache.device, ("c_kv", c_kv), ("k_rope", k_rope), ("slot_mapping", slots))
    check_write_slots(slots, num_blocks * block_size, check_slots)
    if n == 0:
        return
    row_pad, block_t = write_tile(width, launch_target(cache.device))
    _latent_write_kernel[(triton.cdiv(n, block_t),)](
        parts[0], parts[1], as_bytes(cache), slots, n, parts[0].stride(0), parts[1].stride(0),
        scale, LATENT=latent, ROPE=rope, ROW_PAD=row_pad, BLOCK_T=block_t, **fp8,
    )  # fmt: skip
