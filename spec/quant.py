"""Quantized KV: fp8 storage with one scale per layer for K and one for V.

Serving engines halve KV memory again by storing K and V as 8-bit floats. A
value ``x`` is stored as ``fp8(x / scale)`` and read back as ``stored * scale``,
with one float32 scale per layer for K and one for V (per-tensor scaling, the
common serving default). Two formats:

* ``fp8_e4m3`` (torch's ``float8_e4m3fn``): 4 exponent bits, 3 mantissa bits,
  finite maximum 448, no infinity;
* ``fp8_e5m2``: 5 exponent bits, 2 mantissa bits, finite maximum 57,344.

Quantizing is defined exactly, so that a backend's stored bytes can be compared
with the spec's: the division is done in float32, then the quotient is rounded
to the nearest fp8 value (ties to even), and anything beyond the finite maximum
*saturates* to it (an overflow must not become NaN or infinity). NaN stays NaN;
the sign of zero is kept.

One allowance, because GPUs divide approximately: compiled Triton turns a plain
``x / s`` into ``div.full.f32``, whose error the PTX ISA bounds at
:data:`DIVISION_ULPS` (2) units in the last place, and a multiply by the float32
reciprocal stays within the same bound. Where the exact quotient lies that close
to a rounding boundary (a tie between two fp8 values, say), a correct kernel may
land on either side, so either neighbour is a correct stored value
(:func:`quantize_range`); everywhere else only the nearest one is. A kernel that
truncates, ignores the scale or wraps on overflow is still wrong on most values.

>>> round_fp8(np.array([1.0, 1.0625, 1.1875, 300.0, 500.0, -1e9]), "fp8_e4m3").tolist()
[1.0, 1.0, 1.25, 288.0, 448.0, -448.0]
>>> round_fp8(np.array([2.0**-9, 2.0**-10, 70000.0]), "fp8_e5m2").tolist()  # subnormal, saturate
[0.001953125, 0.0009765625, 57344.0]
>>> stored = quantize(np.array([0.75, 0.8, 20.0]), scale=1 / 32, fmt="fp8_e4m3")
>>> stored.tolist(), dequantize(stored, 1 / 32).tolist()    # 25.6 rounds to 26; 640 saturates
([24.0, 26.0, 448.0], [0.75, 0.8125, 14.0])

1.8125 is the tie between 1.75 and 1.875: either may be stored; 1.8 only rounds one way.

>>> low, high = quantize_range(np.array([1.8125, 1.8]) * 0.875, 0.875, "fp8_e4m3")
>>> list(zip(low.tolist(), high.tolist()))
[(1.75, 1.875), (1.75, 1.75)]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from spec.errors import ArgumentTypeError, ArgumentValueError
from spec.validate import check_choice, check_scale

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class Fp8Format:
    """An 8-bit float format: mantissa bits, smallest normal exponent, largest finite value."""

    name: str  # "fp8_e4m3" or "fp8_e5m2"
    mantissa_bits: int  # stored fraction bits
    min_exponent: int  # of the smallest normal number, 2 ** min_exponent
    max_finite: float  # largest finite value: larger inputs saturate


FP8_FORMATS = {
    "fp8_e4m3": Fp8Format("fp8_e4m3", mantissa_bits=3, min_exponent=-6, max_finite=448.0),
    "fp8_e5m2": Fp8Format("fp8_e5m2", mantissa_bits=2, min_exponent=-14, max_finite=57344.0),
}
"""The quantized KV dtypes the contract knows, by name."""


def round_fp8(x: NDArray[np.floating], fmt: str) -> F64:
    """``x`` rounded to the nearest ``fmt`` value (ties to even), saturating at the finite maximum.

    Returned as float64 (every fp8 value is exact there). The quantum of a
    normal number with exponent ``e`` is ``2 ** (e - mantissa_bits)``; below
    the smallest normal, subnormals share the smallest normal's quantum.
    """
    f = FP8_FORMATS[check_choice("fmt", fmt, FP8_FORMATS)]
    x64 = _reals("x", x).astype(np.float64)
    with np.errstate(invalid="ignore"):
        clipped = np.clip(x64, -f.max_finite, f.max_finite)  # NaN passes through
    _, exponent = np.frexp(clipped)  # clipped = m * 2**exponent with 0.5 <= |m| < 1
    e = np.maximum(exponent - 1, f.min_exponent)
    quantum = np.ldexp(1.0, e - f.mantissa_bits)
    rounded: F64 = np.rint(clipped / quantum) * quantum  # np.rint rounds half to even
    with np.errstate(invalid="ignore"):
        rounded = np.clip(rounded, -f.max_finite, f.max_finite)
    return np.copysign(rounded, clipped)  # keep the sign of a value that rounds to zero


def _reals(name: str, x: object) -> NDArray[np.generic]:
    """``x`` as an array of real numbers (ints or floats, not bools or strings), or
    :class:`~spec.errors.ArgumentTypeError` naming ``name``."""
    ok = isinstance(x, np.ndarray | np.generic | list | tuple | int | float)
    a = np.asarray(x) if ok else None
    if a is None or a.dtype.kind not in "iuf":
        kind = type(x).__name__ if a is None else f"an array of {a.dtype}"
        raise ArgumentTypeError(f"{name} must be real numbers (an array of floats), got {kind}")
    return a


def check_fp8_scale(name: str, value: object) -> float:
    """An fp8 scale: finite and positive, and still so in float32, the dtype scales are used in.

    A scale that float32 rounds to 0 or to infinity (``1e-50``, ``1e39``) would
    make every quotient infinite or NaN, so it is refused rather than defined.

    >>> check_fp8_scale("k_scale", 1e-50)
    Traceback (most recent call last):
    ...
    spec.errors.ArgumentValueError: k_scale must be positive and finite in float32, got 1e-50
    """
    v = check_scale(name, value)
    with np.errstate(over="ignore"):
        as_f32 = float(np.float32(v))
    if not (0.0 < as_f32 < float("inf")):
        raise ArgumentValueError(f"{name} must be positive and finite in float32, got {v!r}")
    return v


def quantize(x: NDArray[np.floating], scale: float, fmt: str) -> F64:
    """What an fp8 cache stores for ``x``: ``round_fp8(float32(x) / float32(scale))``."""
    s = np.float32(check_fp8_scale("scale", scale))
    quotient = _reals("x", x).astype(np.float32) / s
    return round_fp8(quotient, fmt)


DIVISION_ULPS = 2
"""How far a compiled kernel's float32 quotient ``x / s`` may be from the exact one, in units in
the last place of the quotient: ``div.full.f32`` (what Triton emits for a plain ``/`` on NVIDIA
GPUs; the PTX ISA bounds its error at 2 ulp over the full range of inputs). ``x * (1 / s)`` in
float32 is within it too (two roundings of half an ulp each)."""


def quantize_range(x: NDArray[np.floating], scale: float, fmt: str) -> tuple[F64, F64]:
    """The lowest and the highest fp8 value a correct cache may store for ``x``.

    Both are :func:`quantize` of ``x`` except where the exact quotient
    ``float32(x) / float32(scale)`` lies within :data:`DIVISION_ULPS` of a
    rounding boundary: there a quotient computed as GPUs compute it may round
    to either neighbour, and the two differ by one fp8 step. The nominal value
    :func:`quantize` gives always lies between them.
    """
    s = np.float32(check_fp8_scale("scale", scale))
    exact = _reals("x", x).astype(np.float32).astype(np.float64) / np.float64(s)
    with np.errstate(over="ignore", invalid="ignore"):
        ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    ulp = np.where(np.isfinite(ulp), ulp, 0.0)  # a quotient past float32: saturates either way
    low = round_fp8(exact - DIVISION_ULPS * ulp, fmt)
    high = round_fp8(exact + DIVISION_ULPS * ulp, fmt)
    return low, high


def dequantize(stored: NDArray[np.floating], scale: float) -> F64:
    """What attention reads from an fp8 cache: ``stored * scale`` (exact in float64)."""
    s = float(np.float32(check_fp8_scale("scale", scale)))
    out: F64 = np.asarray(stored, dtype=np.float64) * s
    return out
