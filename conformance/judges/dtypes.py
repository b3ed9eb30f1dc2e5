"""Rounding to a cache dtype.

The suite hands a backend only values its cache dtype represents exactly, so a
KV write followed by a read must return them bit for bit: KV is compared
exactly, whatever the dtype. Attention outputs involve arithmetic: how close
they must come is :mod:`conformance.judges.numerics`.

numpy has no bfloat16; :func:`round_to` rounds float32 to the nearest bfloat16
(ties to even) with integer arithmetic on the bits, which is what
``torch.Tensor.to(torch.bfloat16)`` does for finite values.

>>> round_to(np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8]), "bfloat16").tolist()   # ties to even
[1.0, 1.015625]
>>> round_to(np.array([0.1]), "float16").tolist()
[0.0999755859375]
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]


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
