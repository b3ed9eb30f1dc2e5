"""Block copy for copy-on-write: copy block ``src`` onto block ``dst``, K and V, every layer.

A block is one contiguous run of ``block_size * H_kv * D`` elements in the
``[num_blocks, block_size, H_kv, D]`` layout, so a copy is a flat memcpy. The
copies of one step must be independent: no block is both a source and a
destination, and no destination repeats, so their order cannot matter.
An fp8 cache is copied as its bytes (NaN bytes included).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from backend_gpu.kernels._checks import (
    check_cache_pair,
    check_device,
    check_tensor,
    independent_copies,
    next_pow2,
)
from backend_gpu.kernels._fp8 import as_bytes
from backend_gpu.kernels.target import launch_target
from spec.errors import InvalidRequestError


@triton.jit  # type: ignore[untyped-decorator]
def _block_copy_kernel(  # type: ignore[no-untyped-def]
    cache_ptr,
    pairs_ptr,
    block_numel,
    CHUNK: tl.constexpr,
):
    """Program ``(c, j)`` copies elements ``j * CHUNK ..`` of copy ``c``'s block."""
    c = tl.program_id(0)
    src = tl.load(pairs_ptr + 2 * c).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * c + 1).to(tl.int64)
    off = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = off < block_numel
    x = tl.load(cache_ptr + src * block_numel + off, mask=mask)
    tl.store(cache_ptr + dst * block_numel + off, x, mask=mask)


def copy_blocks(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    copies: torch.Tensor | Sequence[tuple[int, int]],
) -> None:
    """Execute ``copies`` (``[n, 2]`` int64 pairs ``(src, dst)``) on every layer's K and V."""
    if len(k_caches) != len(v_caches) or not k_caches:
        raise InvalidRequestError(
            f"need as many K as V caches (>= 1), got {len(k_caches)} and {len(v_caches)}"
        )
    pairs_k = [check_cache_pair(k, v) for k, v in zip(k_caches, v_caches, strict=True)]
    first = pairs_k[0][0]
    for layer, (k, _) in enumerate(pairs_k):
        if k.shape != first.shape or k.dtype != first.dtype:
            raise InvalidRequestError(
                f"layer {layer}'s cache differs in shape or dtype from layer 0"
            )
    device = first.device
    pairs = _as_pairs(copies, device)
    tensors = [(f"cache of layer {i}", t) for i, kv in enumerate(pairs_k) for t in kv]
    check_device(device, *tensors, ("copies", pairs))
    independent_copies(pairs.cpu().tolist(), first.shape[0])
    n = pairs.shape[0]
    if n == 0:
        return
    block_numel = first[0].numel()
    chunk = min(next_pow2(block_numel), 2048 if launch_target(device).gpu else 1 << 16)
    grid = (n, triton.cdiv(block_numel, chunk))
    for k, v in pairs_k:
        _block_copy_kernel[grid](as_bytes(k), pairs, block_numel, CHUNK=chunk)
        _block_copy_kernel[grid](as_bytes(v), pairs, block_numel, CHUNK=chunk)


def _as_pairs(
    copies: torch.Tensor | Sequence[tuple[int, int]], device: torch.device
) -> torch.Tensor:
    if isinstance(copies, torch.Tensor):
        pairs = check_tensor("copies", copies, 2, (torch.int64,))
    else:
        pairs = torch.tensor(list(copies), dtype=torch.int64).reshape(-1, 2).to(device)
    if pairs.shape[1] != 2:
        raise InvalidRequestError(
            f"copies must be [n, 2] (src, dst) pairs, got {tuple(pairs.shape)}"
        )
    return pairs.contiguous()
