"""fp8 KV inside the kernels: stored as bytes, encoded and decoded with integer arithmetic.

A quantized cache is kept as ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``
tensors (what an engine allocates), but every kernel sees it as ``uint8``
bytes and converts with the integer helpers below, the same code compiled and
interpreted. Why not Triton's own ``.to(tl.float8e4nv)``: under the CPU
interpreter it truncates instead of rounding to nearest, it decodes the NaN
byte ``0x7F`` as 480 (e4m3) or 114688 (e5m2) and e5m2 subnormals to float16 as
zero, so an interpreted run would test different arithmetic from a compiled
one. The bit manipulation is exact on both and costs a few integer operations
per element of memory-bound kernels.

The format constants come from :data:`spec.quant.FP8_FORMATS` (one place):
kernels take them as the constexprs ``FP8_MANT`` (mantissa bits; 0 means the
cache is not quantized), ``FP8_MIN_EXP`` and ``FP8_MAX``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_gpu.dtypes import FP8_TORCH
from spec.quant import FP8_FORMATS

FP8_NAMES = {dtype: name for name, dtype in FP8_TORCH.items()}


def fp8_constexprs(cache_dtype: torch.dtype) -> dict[str, object]:
    """``FP8_MANT``, ``FP8_MIN_EXP``, ``FP8_MAX`` for a cache of ``cache_dtype`` (0: not fp8)."""
    name = FP8_NAMES.get(cache_dtype)
    if name is None:
        return {"FP8_MANT": 0, "FP8_MIN_EXP": 0, "FP8_MAX": 0.0}
    f = FP8_FORMATS[name]
    return {"FP8_MANT": f.mantissa_bits, "FP8_MIN_EXP": f.min_exponent, "FP8_MAX": f.max_finite}


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache viewed as its ``uint8`` bytes (what the kernels load); others unchanged."""
    return cache.view(torch.uint8) if cache.dtype in FP8_NAMES else cache


@triton.jit  # type: ignore[untyped-decorator]
def fp8_quantize(  # type: ignore[no-untyped-def]
    x, scale, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr
):
    """``x / scale`` -> fp8 byte (:func:`spec.quant.quantize`): the division in float32 with
    IEEE rounding, then to nearest (ties to even), saturating, NaN -> 0x7F.

    ``div_rn`` is ``div.rn.f32`` on every Triton (3.6 compiles ``tl.fdiv(ieee_rounding=True)``
    to the approximate ``div.full.f32``; tests/test_interpreter_ptx.py reads it in the PTX).
    ``|x|`` is ``sig * 2**(e - 23)`` with a 24-bit ``sig``. The fp8 quantum at
    exponent ``e`` is ``2**(max(e, FP8_MIN_EXP) - FP8_MANT)`` (subnormals share
    the smallest normal's), so ``n = sig >> k`` counts quanta, rounded on the
    ``k`` bits shifted out. The byte is then ``(max(e, MIN_EXP) - MIN_EXP) <<
    MANT`` plus ``n``: a rounding carry (``n = 2 ** (MANT + 1)``) moves into the
    exponent by itself, and a subnormal's ``n`` is its mantissa.
    """
    x = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)  # saturate (infinities too)
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 31) & 1
    e = ((u >> 23) & 0xFF) - 127
    sig = tl.where(e > -127, (u & 0x7FFFFF) | 0x800000, 0)  # float32 subnormals round to 0
    k = tl.minimum(23 - FP8_MANT + tl.maximum(FP8_MIN_EXP - e, 0), 25)  # >= 25: all shifted out
    n = sig >> k
    rem = sig & ((1 << k) - 1)
    half = 1 << (k - 1)
    n += ((rem > half) | ((rem == half) & ((n & 1) == 1))).to(tl.int32)
    code = ((tl.maximum(e, FP8_MIN_EXP) - FP8_MIN_EXP) << FP8_MANT) + n
    code = tl.where(x != x, 0x7F, code | (sign << 7))
    return code.to(tl.uint8)


@triton.jit  # type: ignore[untyped-decorator]
def fp8_decode(code, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr):  # type: ignore[no-untyped-def]
    """fp8 byte -> its exact float32 value.

    A normal byte is rebuilt as float32 bits (exponent rebiased, mantissa
    shifted up); a subnormal is ``mantissa * 2 ** (MIN_EXP - MANT)``. e4m3fn has no
    infinity and one NaN per sign (all bits set); e5m2's top exponent is
    infinity or NaN, as in IEEE formats.
    """
    c = code.to(tl.int32)
    mag = c & 0x7F
    e = mag >> FP8_MANT
    m = mag & ((1 << FP8_MANT) - 1)
    normal = (((e + 126 + FP8_MIN_EXP) << 23) | (m << (23 - FP8_MANT))).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * (2.0 ** (FP8_MIN_EXP - FP8_MANT)), normal)
    if FP8_MANT == 3:
        v = tl.where(mag == 0x7F, float("nan"), v)
    else:
        top = (1 << (7 - FP8_MANT)) - 1
        v = tl.where(e == top, tl.where(m == 0, float("inf"), float("nan")), v)
    return tl.where(c >= 128, -v, v)
