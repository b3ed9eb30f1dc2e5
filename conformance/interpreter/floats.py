"""Bit-exact float conversions as compiled Triton performs them on sm_90, in numpy.

Compiled Triton converts float32 to fp8 with ``cvt.rn.satfinite.e4m3x2.f32``
and ``cvt.rn.satfinite.e5m2x2.f32`` (what ``triton.compile`` emits for
``GPUTarget("cuda", 90, 32)``): round to nearest, ties to even, and a
magnitude past the largest finite value, infinity included, becomes that
value with its sign (both formats saturate; neither yields infinity). NaN
becomes the format's NaN. Float32 to bfloat16 is ``cvt.rn.bf16.f32``: round
to nearest even, overflow to infinity, NaN kept NaN. Decoding is exact.

Formats are named as Triton names them: ``fp8e4nv`` (e4m3fn: bias 7, no
infinity, NaN ``S.1111.111``) and ``fp8e5`` (e5m2: bias 15, IEEE-like).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]
U16 = npt.NDArray[np.uint16]


@dataclass(frozen=True)
class Fp8Format:
    """An 8-bit float: exponent and mantissa widths, bias, largest finite code, NaN code."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_code: int  # the largest finite positive code
    nan_code: int  # the NaN the conversion produces
    has_inf: bool


FP8_FORMATS = {
    "fp8e4nv": Fp8Format("fp8e4nv", 4, 3, 7, 0x7E, 0x7F, False),
    "fp8e5": Fp8Format("fp8e5", 5, 2, 15, 0x7B, 0x7F, True),
}


@cache
def fp8_table(name: str) -> F32:
    """The float32 value of each of the 256 codes of format ``name`` (NaN where NaN).

    >>> t = fp8_table("fp8e4nv"); float(t[0x7E]), float(t[0x01]), bool(np.isnan(t[0x7F]))
    (448.0, 0.001953125, True)
    >>> t = fp8_table("fp8e5"); float(t[0x7B]), float(t[0x7C]), bool(np.isnan(t[0x7D]))
    (57344.0, inf, True)
    """
    f = FP8_FORMATS[name]
    values = np.empty(256, dtype=np.float64)
    top = (1 << f.exponent_bits) - 1
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> f.mantissa_bits) & top
        frac = code & ((1 << f.mantissa_bits) - 1)
        if exp == 0:
            mag = frac * 2.0 ** (1 - f.bias - f.mantissa_bits)
        else:
            mag = (1 + frac / (1 << f.mantissa_bits)) * 2.0 ** (exp - f.bias)
        if (code & 0x7F) > f.max_code:
            mag = np.inf if f.has_inf and frac == 0 else np.nan
        values[code] = sign * mag
    table = values.astype(np.float32)
    table.flags.writeable = False
    return table


def fp8_decode(codes: npt.NDArray[np.uint8], name: str) -> F32:
    """The float32 values of fp8 codes (exact)."""
    return fp8_table(name)[codes.astype(np.intp)]


def fp8_encode(values: npt.NDArray[np.floating], name: str) -> U8:
    """Float values to fp8 codes: round to nearest even, saturate to the largest finite value.

    Input is taken as float32 (float16 and bfloat16 widen to it exactly).

    >>> x = np.array([1.0625, 500.0, 1e-3, np.inf, -1e9, np.nan], dtype=np.float32)
    >>> fp8_decode(fp8_encode(x, "fp8e4nv"), "fp8e4nv").tolist()
    [1.0, 448.0, 0.001953125, 448.0, -448.0, nan]
    """
    f = FP8_FORMATS[name]
    x = np.asarray(values, dtype=np.float32).astype(np.float64)
    positive = fp8_table(name)[: f.max_code + 1].astype(np.float64)  # ascending, code == index
    nan = np.isnan(x)
    mag = np.minimum(np.abs(np.where(nan, 0.0, x)), positive[-1])
    hi = np.searchsorted(positive, mag, side="left")  # positive[hi] >= mag
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = mag - positive[lo], positive[hi] - mag
    even_hi = (hi % 2) == 0
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even_hi)
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    sign = (np.signbit(x)).astype(np.uint8) << np.uint8(7)
    out = (code | sign).astype(np.uint8)
    return np.where(nan, np.uint8(f.nan_code), out).astype(np.uint8).reshape(np.shape(values))


def bf16_decode(bits: npt.NDArray[np.uint16]) -> F32:
    """The float32 values of bfloat16 bit patterns (exact: bfloat16 is float32's top half)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def bf16_encode(values: npt.NDArray[np.floating], *, toward_zero: bool = False) -> U16:
    """Float values to bfloat16 bits: to nearest even (``cvt.rn``) or toward zero (``cvt.rz``).

    Overflow rounds to infinity; NaN stays NaN (quieted).

    >>> bf16_decode(bf16_encode(np.array([1.00390625, 1.01171875, 3.4e38], np.float32))).tolist()
    [1.0, 1.015625, inf]
    """
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    if toward_zero:
        rounded = bits >> np.uint64(16)
    else:
        rounded = (
            bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))
        ) >> np.uint64(16)
    quiet = (bits >> np.uint64(16)) | np.uint64(0x0040)
    return np.where(nan, quiet, rounded).astype(np.uint16)
