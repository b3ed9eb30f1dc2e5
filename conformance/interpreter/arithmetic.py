"""Float arithmetic as compiled Triton performs it on NVIDIA GPUs, where numpy's differs.

Read in the PTX that ``triton.compile`` emits for ``GPUTarget("cuda", 90, 32)``
(Triton 3.6 and 3.9 alike; ``tests/test_interpreter_ptx.py`` checks each
instruction named here), with the error bounds of the PTX ISA:

* a plain float ``x / y`` (and ``tl.fdiv`` without IEEE rounding; Triton 3.6
  even with it) is ``div.full.f32``: at most 2 ulp from the exact quotient,
  in practice a multiply by an approximate reciprocal. Emulated as
  ``x * (1 / y)`` in float32 (two roundings: within the bound, and on the
  other side of a rounding tie as often as a GPU). float16 and bfloat16
  operands are divided in float32 and rounded back, as compiled.
  ``tl.math.div_rn`` is ``div.rn.f32``: exact, as numpy divides.
* ``tl.fdiv(approx=True)`` is ``div.approx.f32``: ``x * (1 / y)``, and zero
  (NaN for an infinite ``x``) when ``|y| > 2^126``.
* ``tl.exp2`` is ``ex2.approx.ftz.f32``: within 2 ulp of the exact power
  (emulated exact), with subnormal inputs and results flushed to zero.
* ``tl.exp`` is ``mul.f32`` by ``log2(e)`` rounded to float32, then
  ``ex2.approx.f32``: the rounded product costs up to ``|x|`` x 1.2 ulp
  (``exp(88)`` is 30 ulp off); emulated by that product, exactly.
* ``tl.sqrt`` is ``sqrt.approx.ftz.f32`` (within 1 ulp; emulated exact,
  subnormals flushed); ``tl.sqrt_rn`` is exact.
* ``tl.dot`` on float32 with the default ``input_precision`` ("tf32") is
  ``mma.sync ... .tf32.tf32``: the tensor cores read each float32 operand's
  top 19 bits, so every input is truncated to TF32 (a 10-bit mantissa,
  toward zero) and the products are summed in float32. ``"tf32x3"`` splits
  each operand into two TF32 parts and is emulated as float32; ``"ieee"`` is
  float32 throughout.

Not emulated, with the bound written down: ``fma`` contraction of ``a * b + c``
(compiled Triton fuses them by default; one rounding fewer, at most half an
ulp of the product) and the order of float32 sums. Both are within the
output tolerances of :mod:`conformance.judges.numerics`, and neither touches
a KV write, which is compared exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]

DIV_ULPS = 2
"""``div.full.f32`` and ``div.approx.f32``: at most this many ulp from the exact quotient (PTX ISA);
the same bound :data:`spec.quant.DIVISION_ULPS` allows in an fp8 KV write."""
TF32_DROPPED_BITS = 13
"""float32 mantissa bits a TF32 tensor-core operand ignores (23 - 10)."""
LOG2E_F32 = np.float32(1.4426950408889634)
"""``log2(e)`` as float32 (``0x3FB8AA3B``), the factor compiled ``tl.exp`` multiplies by."""
_TINY = np.float32(2.0**-126)  # the smallest normal float32
_HUGE = np.float32(2.0**126)


def _flush(x: F32) -> F32:
    """Subnormal values to zero of the same sign (``.ftz``)."""
    out: F32 = np.where(np.abs(x) < _TINY, np.copysign(np.float32(0.0), x), x).astype(np.float32)
    return out


def in_float32(fn: Any) -> Any:
    """``fn`` on float32 values, its result rounded back to the operands' float dtype (float16
    and float32 here; bfloat16 arrives decoded); float64 and other data pass to numpy's own."""

    def run(*args: Any) -> Any:
        dtype = np.result_type(*args)
        if dtype not in (np.float16, np.float32):
            return None
        with np.errstate(all="ignore"):
            out = fn(*(np.asarray(a, dtype=np.float32) for a in args))
        return np.asarray(out, dtype=np.float32).astype(dtype)

    return run


def div_full(x: F32, y: F32) -> F32:
    """``div.full.f32``: ``x * (1 / y)`` for normal ``|y| <= 2^126``; exact beyond (the full-range
    instruction scales such operands; exact is within its bound).

    >>> x, y = np.float32([0.044189453125, 1.0]), np.float32([0.0589192733168602, 3.0])
    >>> div_full(x, y).tolist(), (x / y).tolist()         # the first: 0.75 against 0.74999994
    ([0.75, 0.3333333432674408], [0.7499999403953552, 0.3333333432674408])
    """
    scaled = (np.abs(y) >= _TINY) & (np.abs(y) <= _HUGE)
    out: F32 = np.where(scaled, x * (np.float32(1.0) / y), x / y).astype(np.float32)
    return out


def div_approx(x: F32, y: F32) -> F32:
    """``div.approx.f32``: ``x * (1 / y)``; for ``|y| > 2^126`` zero of the quotient's sign, or NaN
    when ``x`` is infinite (PTX ISA)."""
    quotient = x * (np.float32(1.0) / y)
    huge = np.isfinite(y) & (np.abs(y) > _HUGE)
    zero = np.where(np.isinf(x), np.float32(np.nan), np.float32(0.0) * np.sign(x) * np.sign(y))
    out: F32 = np.where(huge, zero, quotient).astype(np.float32)
    return out


def ex2_approx_ftz(x: F32) -> F32:
    """``ex2.approx.ftz.f32``: ``2^x``, subnormal inputs read as zero and results flushed to zero.

    >>> ex2_approx_ftz(np.float32([3.0, -127.0, -1e-40])).tolist()
    [8.0, 0.0, 1.0]
    """
    return _flush(np.exp2(_flush(x).astype(np.float64)).astype(np.float32))


def exp_via_ex2(x: F32) -> F32:
    """Compiled ``tl.exp``: ``ex2.approx.f32(x * log2(e))`` with the product rounded to float32.

    >>> x = np.float32([1.0, 88.0])
    >>> exact = np.exp(x.astype(np.float64))
    >>> [round(float(u)) for u in (exp_via_ex2(x) - exact) / np.spacing(exact.astype(np.float32))]
    [0, -30]
    """
    product = (x * LOG2E_F32).astype(np.float32)
    return np.exp2(product.astype(np.float64)).astype(np.float32)


def sqrt_approx_ftz(x: F32) -> F32:
    """``sqrt.approx.ftz.f32``, emulated as the exact root of the flushed input, flushed."""
    return _flush(np.sqrt(_flush(x).astype(np.float64)).astype(np.float32))


def tf32(x: F32) -> F32:
    """float32 values as a TF32 tensor-core operand reads them: the low 13 mantissa bits dropped
    (toward zero). Infinities stay; a quiet NaN stays NaN.

    >>> tf32(np.float32([1.0 + 2**-10, 1.0 + 2**-11 + 2**-12, -3.1415927])).tolist()
    [1.0009765625, 1.0, -3.140625]
    """
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    mask = np.uint32((0xFFFFFFFF << TF32_DROPPED_BITS) & 0xFFFFFFFF)
    out: F32 = (bits & mask).view(np.float32)
    return out
