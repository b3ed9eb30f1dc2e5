"""One layer's attention variant and fp8 scales, checked, as both attention kernels take them.

:class:`spec.attention.AttentionVariant` defines the variants. The kernels score in log2
units, so per-head sinks and ALiBi slopes go to the device multiplied by ``log2(e)``, and
each variant is a constexpr switch, so that plain attention compiles to what it was. The
per-tensor fp8 scales are folded, not multiplied into every element: ``k_scale`` into the
score multiplier, ``v_scale`` into the output (the same dequantization, by linearity).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_gpu.kernels._checks import check_device, check_tensor
from spec.errors import InvalidRequestError
from spec.validate import check_int, check_scale

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Variant:
    """The checked variant: ``sinks`` and ``alibi`` float32 ``[H]`` device tensors, log2 units."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    alibi: torch.Tensor | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    def kernel_args(
        self, scale: float, fp8: bool, dummy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, float, float, float, int]:
        """``(sinks, alibi, score_mul, cap_log2, v_scale, window)``, as the kernels take them
        (``dummy`` for absent tensors): scores ``scale * k_scale * q.k`` in log2 units, or
        with a soft-cap ``c``, ``q.k * scale * k_scale / c`` under ``c * log2(e) * tanh``."""
        k_scale = self.k_scale if fp8 else 1.0
        if self.softcap is None:
            score_mul, cap_log2 = scale * k_scale * LOG2E, 0.0
        else:
            score_mul, cap_log2 = scale * k_scale / self.softcap, self.softcap * LOG2E
        sinks = dummy if self.sinks is None else self.sinks
        alibi = dummy if self.alibi is None else self.alibi
        return sinks, alibi, score_mul, cap_log2, self.v_scale, self.window or 0

    @property
    def flags(self) -> dict[str, bool]:
        """The kernels' constexpr switches."""
        return {
            "USE_SOFTCAP": self.softcap is not None,
            "USE_ALIBI": self.alibi is not None,
            "USE_WINDOW": self.window is not None,
            "USE_SINKS": self.sinks is not None,
        }


def check_variant(
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    q: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Variant:
    """The variant arguments, checked, with per-head tensors converted to log2 units."""
    per_head = []
    for name, x in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if x is not None:
            x = check_tensor(name, x, 1, (torch.float32,))
            if x.shape[0] != q.shape[1]:
                raise InvalidRequestError(
                    f"{name} has {x.shape[0]} entries, but there are {q.shape[1]} query heads"
                )
            check_device(q.device, (name, x))
            x = x.contiguous() * LOG2E
        per_head.append(x)
    return Variant(
        window=None if window is None else check_int("window", window, low=1),
        softcap=None if softcap is None else check_scale("softcap", softcap),
        sinks=per_head[0],
        alibi=per_head[1],
        k_scale=check_scale("k_scale", k_scale),
        v_scale=check_scale("v_scale", v_scale),
    )
