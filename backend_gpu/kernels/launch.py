"""Launching an attention kernel: what it writes, and the parameters both kernels take alike.

The two kernels' parameters differ only in their caches (K and V, or one latent cache),
those caches' strides and the constexprs of their tiles; the rest, in the same order in
both, is built here. With split-KV a kernel writes float32 parts and their log-sum-exps
(:class:`Parts`), which its merge kernel then reduces into the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backend_gpu.kernels._checks import bf16_as_compiled
from backend_gpu.kernels._fp8 import as_bytes, fp8_constexprs
from backend_gpu.kernels.plan import Plan
from backend_gpu.kernels.variant import Variant


def staged(out: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel writes for ``out``: ``out``, or float32 where bfloat16 here is not
    compiled Triton's. Triton's own interpreter computes bfloat16 on raw bits and converts
    to it by truncation: there the kernel works and writes in float32, and torch rounds
    (:func:`unstaged`). Under the conformance suite's honest interpreter it runs the GPU's
    bfloat16 code."""
    if out.dtype == torch.bfloat16 and not bf16_as_compiled():
        return torch.empty(out.shape, dtype=torch.float32, device=out.device)
    return out


def unstaged(out: torch.Tensor, written: torch.Tensor, qsl: torch.Tensor) -> torch.Tensor:
    """``out`` with the batch's tokens of ``written`` (:func:`staged`) rounded into it."""
    if written is not out:
        num_tokens = int(qsl[-1])
        out[:num_tokens] = written[:num_tokens].to(torch.bfloat16)
    return out


@dataclass(frozen=True)
class Parts:
    """Split-KV's partial outputs ``[T, H, parts, width]``, each normalised by its own sum,
    and their log-sum-exps ``[T, H, parts]`` (log2 units; ``-inf`` for an empty part),
    float32; ``sinks`` (log2 units) join in the merge."""

    part: torch.Tensor
    lse: torch.Tensor
    sinks: torch.Tensor

    def merge_args(self, out: torch.Tensor, qsl: torch.Tensor, num_seqs: int) -> tuple[Any, ...]:
        """The merge kernels' parameters up to their constexprs (the two take the same)."""
        part, lse = self.part, self.lse
        return (
            part, lse, out, qsl, self.sinks, num_seqs, part.shape[2], *part.stride()[:3],
            *lse.stride()[:2], out.stride(0), out.stride(1),
        )  # fmt: skip


def launch(
    kernel: Any,
    caches: tuple[torch.Tensor, ...],
    q: torch.Tensor,
    out: torch.Tensor,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    variant: Variant,
    plan: Plan,
    **tile: int,
) -> Parts | None:
    """Launch ``kernel`` (either attention kernel) by ``plan`` on ``caches``, writing ``out``
    ``[T, H, width]``, or if split the parts it returns. ``batch`` is ``(query_start_loc,
    seq_lens, block_tables)``, ``tile`` the kernel's own constexprs.

    The dot's dtype: float32 inputs with IEEE products (never TF32), compiled or not;
    bfloat16 upcast too where it would be computed on raw bits (:func:`staged`).
    """
    qsl, lens, tables = batch
    split = plan.num_splits > 1
    fp8 = fp8_constexprs(caches[0].dtype)
    fp8.pop("FP8_MAX")  # only the KV write saturates
    dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
    args = variant.kernel_args(scale, bool(fp8["FP8_MANT"]), dummy)
    if split:
        shape, device = (q.shape[0], q.shape[1], plan.num_splits), q.device
        part = torch.empty(*shape, out.shape[2], dtype=torch.float32, device=device)
        lse = torch.empty(*shape, dtype=torch.float32, device=device)
        target, t_strides, l_strides = part, part.stride()[:3], lse.stride()[:2]
    else:
        lse, target, t_strides, l_strides = dummy, out, (out.stride(0), out.stride(1), 0), (0, 0)
    upcast = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and not bf16_as_compiled())
    kernel[plan.grid(lens.shape[0])](
        q, *map(as_bytes, caches), target, lse, qsl, lens, tables, *args, plan.q_tiles,
        plan.keys_per_split, q.stride(0), q.stride(1), *t_strides,
        *[stride for cache in caches for stride in cache.stride()[:-1]], tables.stride(0),
        *l_strides, SPLIT=split, UPCAST=upcast, IEEE=q.dtype == torch.float32, **variant.flags,
        **fp8, **tile, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    return Parts(part, lse, args[0]) if split else None
