"""Planted bugs in the attention variants and fp8 KV: each the numpy backend with one step broken.

Each is a mistake a real kernel can make in a few characters, and each needs a
workload the suite draws on purpose (:mod:`conformance.lockstep.variants`): a window
shorter than the context, a soft-cap below the score range, sinks near the
scores, steep ALiBi slopes, fp8 scales small enough that values saturate.
Each is registered in :data:`conformance.planted.backends.PLANTED`, so the self-test runs it.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from conformance.lockstep.numpy_backend import F32, Ints, NumpyPagedBackend
from spec.quant import FP8_FORMATS


class WindowOffByOne(NumpyPagedBackend):
    """The window keeps ``p - w <= k``: one key too many (``w + 1`` where the spec says ``w``)."""

    def _in_window(self, positions: Ints, num_keys: int, window: int) -> NDArray[np.bool_]:
        mask: NDArray[np.bool_] = np.arange(num_keys)[None, :] >= positions[:, None] - window
        return mask


class SoftcapUnscaled(NumpyPagedBackend):
    """The soft-cap is applied to ``q . k`` before the softmax scale, not to the scaled scores."""

    def _scores(self, q: F32, k: F32, scale: float, softcap: float | None) -> F32:
        if softcap is None:
            return super()._scores(q, k, scale, softcap)
        raw: F32 = q @ k.T
        out: F32 = self._softcap(raw, softcap) * np.float32(scale)
        return out


class SoftcapAfterExp(NumpyPagedBackend):
    """The soft-cap squashes the exponentiated weights ``exp(s - m)`` instead of the scores."""

    _cap: float | None = None

    def _scores(self, q: F32, k: F32, scale: float, softcap: float | None) -> F32:
        self._cap = softcap  # remembered for the softmax below; the scores stay uncapped
        return super()._scores(q, k, scale, None)

    def _softmax(self, scores: F32) -> F32:
        if self._cap is None:
            return super()._softmax(scores)
        cap = np.float32(self._cap)
        weights = cap * np.tanh(np.exp(scores - scores.max(axis=-1, keepdims=True)) / cap)
        out: F32 = weights / weights.sum(axis=-1, keepdims=True)
        return out


class SinkNotInDenominator(NumpyPagedBackend):
    """The sink is counted in the running max but its ``exp`` never joins the sum."""

    def _sink_softmax(self, scores: F32, sink: float) -> F32:
        top = np.maximum(scores.max(axis=-1, keepdims=True), np.float32(sink))
        weights = np.exp(scores - top)
        out: F32 = weights / weights.sum(axis=-1, keepdims=True)
        return out


class AlibiSignFlipped(NumpyPagedBackend):
    """ALiBi adds ``slope * (p - k)``: distant keys gain weight instead of losing it."""

    def _alibi(self, scores: F32, positions: Ints, slope: float) -> F32:
        return super()._alibi(scores, positions, -slope)


class Fp8ScaleTwice(NumpyPagedBackend):
    """Attention dequantizes ``stored * scale * scale`` (the scale folded in twice)."""

    def _dequantize(self, stored: F32, scale: float) -> F32:
        return super()._dequantize(super()._dequantize(stored, scale), scale)


class Fp8ScaleIgnored(NumpyPagedBackend):
    """Attention reads the stored fp8 values as they are: the scale is never applied."""

    def _dequantize(self, stored: F32, scale: float) -> F32:
        return stored


class Fp8NoSaturation(NumpyPagedBackend):
    """The KV write casts to fp8 without clipping: an overflow becomes NaN (e4m3) or inf (e5m2)."""

    def _saturate(self, x: F32, kv_dtype: str) -> F32:
        return x


class CausalOffByOne(NumpyPagedBackend):
    """The causal mask keeps ``k <= p + 1``: a prefill query sees the next token too."""

    def _visible(self, positions: Ints, num_keys: int, seq_len: int) -> NDArray[np.bool_]:
        mask: NDArray[np.bool_] = np.arange(num_keys)[None, :] <= positions[:, None] + 1
        return mask


class KVScalesSwapped(NumpyPagedBackend):
    """Attention dequantizes K with the V scale and V with the K scale (both written right)."""

    def _kv_scale(self, layer: int, which: int) -> float:
        return super()._kv_scale(layer, 1 - which)


class Fp8Truncates(NumpyPagedBackend):
    """The KV write rounds the quotient toward zero (a truncating cast), not to nearest.

    Not an allowance: a compiled division errs by at most 2 ulp, so a correct
    kernel strays from the nearest fp8 value only at a tie; truncation does on
    every quotient past the halfway point.
    """

    def _fp8_round(self, x: F32, kv_dtype: str) -> F32:
        values = _fp8_magnitudes(kv_dtype)  # ascending
        mag = np.abs(x)
        below = values[np.maximum(np.searchsorted(values, mag, side="right") - 1, 0)]
        out: F32 = np.where(np.isnan(x), x, np.copysign(below, x)).astype(np.float32)
        return out


def _fp8_magnitudes(kv_dtype: str) -> F32:
    """Every finite non-negative value of the fp8 format, ascending."""
    f = FP8_FORMATS[kv_dtype]
    steps = 2**f.mantissa_bits
    subnormal = [k * 2.0 ** (f.min_exponent - f.mantissa_bits) for k in range(steps)]
    top = int(np.log2(f.max_finite))
    normal = [
        (1 + k / steps) * 2.0**e for e in range(f.min_exponent, top + 1) for k in range(steps)
    ]
    return np.array(sorted(v for v in subnormal + normal if v <= f.max_finite), dtype=np.float32)


class AlibiFromKeyZero(NumpyPagedBackend):
    """ALiBi adds ``slope * k`` (measured from key 0), not ``slope * (k - p)``.

    A constant per query row, which softmax cancels: exact until a sink joins
    the row, whose logit carries no bias.
    """

    def _alibi(self, scores: F32, positions: Ints, slope: float) -> F32:
        return super()._alibi(scores, np.zeros_like(positions), slope)
