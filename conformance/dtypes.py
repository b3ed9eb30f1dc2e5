"""Rounding to a cache dtype, and how close an attention output must come to the reference.

The suite hands a backend only values its cache dtype represents exactly, so a
KV write followed by a read must return them bit for bit: KV is compared
exactly, whatever the dtype. Attention outputs involve arithmetic, so they are
compared against the float64 reference within a per-dtype tolerance.

numpy has no bfloat16; :func:`round_to` rounds float32 to the nearest bfloat16
(ties to even) with integer arithmetic on the bits, which is what
``torch.Tensor.to(torch.bfloat16)`` does for finite values.

>>> round_to(np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8]), "bfloat16").tolist()   # ties to even
[1.0, 1.015625]
>>> round_to(np.array([0.1]), "float16").tolist()
[0.0999755859375]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|``, elementwise."""

    atol: float
    rtol: float


TOLERANCES = {
    # fp32: far under 1e-3 when computed in fp32; 1e-3 still admits a TF32 dot (~3e-4 relative).
    "float32": Tolerance(atol=1e-3, rtol=1e-3),
    # fp16: FlashInfer's 1e-3, widened for probabilities rounded to fp16 before the P @ V product.
    "float16": Tolerance(atol=5e-3, rtol=5e-3),
    # bf16: vLLM's unified-attention test tolerance.
    "bfloat16": Tolerance(atol=1.5e-2, rtol=1e-2),
}
"""Attention-output tolerance per cache dtype (KV itself is always compared exactly)."""


def round_to(x: NDArray[np.floating], dtype: str) -> F64:
    """``x`` rounded to the nearest value of ``dtype``, returned as float64."""
    x32 = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x32.astype(np.float64)
    if dtype == "float16":
        return x32.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        bits = x32.view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(
            0xFFFF0000
        )
        return rounded.view(np.float32).astype(np.float64)
    raise ValueError(f"unknown dtype {dtype!r}")
