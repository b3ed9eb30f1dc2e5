"""Judging attention outputs the way kernel authors judge them: beside a same-precision reference.

A fixed tolerance per dtype cannot tell an honest fp16 kernel from one that
accumulates ``P @ V`` in fp16 or rounds its output toward zero: both stay
inside any tolerance loose enough for the honest one. So, as FlashAttention's
tests do, every step compares two errors against the float64 reference (the
spec):

* the backend's: ``|actual - exact|``;
* that of a **same-precision reference**, what an honest kernel of the
  backend's precision computes: inputs and K/V in the activation dtype (an
  fp8 cache dequantized and rounded to it, as a kernel reads it), float32
  products and sums, the unnormalised probabilities rounded to the dtype
  before ``P @ V`` (fp16 and bf16), the output rounded to the dtype
  (:func:`same_precision`).

Errors are measured in **ulps**: each output's error divided by the spacing of
the dtype's numbers at its expected value (at least at :data:`MAGNITUDE_FLOOR`
of the step's largest, so that values near zero, whose relative error says
nothing, do not dominate; for float32, at the largest). Three checks, with
the constants below measured on the project's correct backends:

1. **Each step and layer**: the backend's largest error, in ulps, is at most
   ``RATIO`` times the reference's largest plus ``FLOOR_ULPS``
   (:func:`output_errors`).
2. **Each example, precision**: the backend's mean error in ulps is at most
   ``MEAN_RATIO`` times the reference's mean plus ``MEAN_FLOOR_ULPS``: an
   averaged error is stable where a maximum is not, so it sees a kernel that
   is a little worse everywhere (fp16 accumulation).
3. **Each example, bias**: the mean error in ulps, signed and in the
   direction of ``|expected|``, is within ``BIAS_LIMIT_ULPS`` of the span
   from no lean to the same-precision reference's (zero for an honest
   rounding; a kernel that declares TF32 products may lean as its reference
   does, toward zero, or less). An honest kernel's rounding errors average
   out; truncation toward zero, at most one ulp per output and so inside
   check 1, averages half an ulp.

>>> exact = np.array([0.3, -0.7, 1.1])
>>> ulp(exact, "float16").tolist()            # spacing of fp16 numbers at each value
[0.000244140625, 0.00048828125, 0.0009765625]
>>> errs = output_errors(exact, round_to(exact, "float16"), exact + 1e-3, "float16")
>>> round(errs.max_ulps, 1), round(errs.reference_ulps, 2), round(errs.allowed_ulps, 2)
(4.1, 0.4, 1.8)
>>> errs.passed, round(errs.excess, 2)        # 4.1 ulps where 1.8 are allowed
(False, 2.28)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from conformance.interpreter.arithmetic import tf32
from conformance.judges.dtypes import F64, round_to
from spec.precision import Precision
from spec.quant import round_fp8

MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}
"""Explicit mantissa bits of each activation dtype."""
MIN_NORMAL_EXPONENT = {"float32": -126, "float16": -14, "bfloat16": -126}

RATIO = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}
"""Check 1: the allowed multiple of the same-precision reference's largest error.

2 for fp16 and bf16, as FlashAttention's tests use. Measured (quick profile,
thousands of steps): a kernel that rounds ``P`` like the reference (online
softmax over 32-key tiles) reached 1.28 times the reference's largest error,
at most 0.6 of the allowance; the project's numpy, torch and Triton backends,
which keep ``P`` in float32, at most 0.25 of it. 4 for float32, where no final
rounding dominates: two honest orders of summation differed by up to 16 times
on one step, which the floor absorbs.
"""
FLOOR_ULPS = {"float32": 512.0, "float16": 1.0, "bfloat16": 1.0}
"""Check 1's floor, in ulps.

One ulp in fp16 and bf16: the backend's and the reference's roundings of one
output may each be half an ulp, in opposite directions. 512 in float32 (at
the step's largest output, about 6e-5 of it): with large logits (scores up
to about 50) the order in which a float32 dot product is summed moves every
weight by up to 1e-5 relative; honest backends erred by up to 134 ulps. A
TF32 dot, or fp16 accumulation in a float32 kernel, errs by thousands.
"""
MEAN_RATIO = {"float32": 2.0, "float16": 1.25, "bfloat16": 1.25}
"""Check 2: the allowed multiple of the reference's mean error in ulps, per example.

Measured: a kernel that rounds ``P`` averages 0.92 to 1.0 times the
reference's mean error, the project's backends 0.47 to 0.91 (fp16, bf16);
fp16 accumulation of ``P @ V`` 1.5 to 1.8. In float32 honest backends
averaged up to 2.2 times a reference that happened to sum accurately, all
of it far under the floor.
"""
MEAN_FLOOR_ULPS = {"float32": 64.0, "float16": 0.05, "bfloat16": 0.05}
BIAS_LIMIT_ULPS = {"float32": 1.0, "float16": 0.2, "bfloat16": 0.2}
"""Check 3: the most an example's mean error may lean, in ulps.

fp16 and bf16: honest kernels leaned at most 0.011 ulp, truncation 0.46. In
float32 there is no final rounding to lean: errors are accumulation, often
past the clip of 4 ulps, and honest examples leaned up to 0.094; the limit
only catches a gross lean there.
"""
MIN_SAMPLES = 512
"""Outputs an example needs before checks 2 and 3 judge it: below that, a mean is noise."""
MAGNITUDE_FLOOR = {"float32": 1.0, "float16": 2.0**-6, "bfloat16": 2.0**-6}
"""Outputs below this fraction of the step's largest are judged in the ulps of that fraction.

fp16 and bf16 outputs are rounded one by one, so each is judged in its own
ulps down to 1/64 of the largest. A float32 kernel's error is absolute, not
relative: it comes from rounding the scores (``exp`` turns an error in ``s``
into the same relative error in every weight), whatever the output's size,
so float32 outputs are all judged in the ulps of the largest.
"""
FAST_SLACK_ULPS = {"float32": 256.0, "float16": 2.0, "bfloat16": 2.0}
"""Added to check 1's floor for a step the fast reference judged (zero for the spec's steps).

The fast reference's same-precision outputs are the spec's within 64 float32
ulps plus one dtype ulp where a rounding of ``P`` flipped (numpy's and
torch's float32 ``exp`` differ in the last bit;
``tests/test_fast_reference.py``). The allowance is ``RATIO`` times the
reference's error, so ``RATIO`` times that difference is added: a backend
judged by the fast reference is never held tighter than the spec would hold
it. In fp16 and bf16 one dtype ulp (64 float32 ulps are far below it) times
2; in float32, judged at the step's largest output, 64 ulps times 4.
"""
PROBABILITY_SIGMAS = 6.0
"""Check 1's allowance for where a kernel rounds its probabilities, in standard deviations.

An fp16 or bf16 kernel rounds each unnormalised probability to its dtype before
``P @ V``, relative to whatever maximum it holds then (an online softmax: the
running maximum of the keys seen so far), so its rounding errors are not the
same-precision reference's, which rounds relative to the row's maximum. Each
such rounding is off by at most half an ulp of the probability (a relative
``2^-(mantissa + 1)``), or half the dtype's smallest subnormal spacing, and
output ``d`` gains ``sum_k err_k * v_kd / L``: its standard deviation
``sigma_d`` follows from the step's own probabilities and values
(:func:`probability_spread`). A step that fails check 1 is judged again with
each output's error less ``PROBABILITY_SIGMAS * sigma_d`` first: six
deviations, which a sum of such bounded errors passes with odds of about one
in 10^9 per output. Measured (a float16 online-softmax kernel over a window
of 256 keys at large logits, 8 outputs): errors of up to 1.15 sigma, the
reference's up to 0.97, where check 1 alone allowed 0.9 sigma at the smallest
output. A kernel that rounds P to fp8, or sums ``P @ V`` in fp16, errs by
many times more.
"""
_BIAS_CLIP_ULPS = 4.0
"""Per-output errors are clipped to this many ulps for the bias, so one outlier cannot lean it."""

LARGE_LOGITS = "large logits (scale 16/sqrt(D): scores spread about 16)"
USUAL_SCALE = "usual scale (1/sqrt(D))"


_EXPONENT_BITS = np.int64(0x7FF0_0000_0000_0000)


def ulp(x: F64, dtype: str) -> F64:
    """The spacing of ``dtype`` numbers at ``|x|`` (subnormal spacing below the smallest normal).

    The power of two at or below ``|x|`` is ``x``'s float64 exponent bits alone.
    """
    bits = np.asarray(x, dtype=np.float64).view(np.int64) & _EXPONENT_BITS
    power = np.maximum(bits.view(np.float64), 2.0 ** MIN_NORMAL_EXPONENT[dtype])
    out: F64 = power * 2.0 ** -MANTISSA_BITS[dtype]
    return out


def same_precision(
    dtype: str, quantized_kv: bool, products: str = "exact", kv_dtype: str | None = None
) -> Precision:
    """The arithmetic of an honest kernel with ``dtype`` activations (the output is rounded after),
    rounding its products as it declares (:data:`spec.capabilities.PRODUCTS`; ``kv_dtype`` names
    the fp8 format a kernel declaring ``"fp8"`` casts to).

    >>> same_precision("float32", quantized_kv=False).round_p is None      # fp32 keeps P
    True
    >>> same_precision("float32", False, products="tf32").round_dot(np.array([1 + 2**-12]))
    array([1.])
    """

    def to_dtype(x: F64) -> F64:
        return round_to(x, dtype)

    def to_tf32(x: F64) -> F64:
        out: F64 = tf32(x.astype(np.float32)).astype(np.float64)
        return out

    def to_fp8(x: F64) -> F64:
        assert kv_dtype is not None
        return round_fp8(x, kv_dtype)

    fp8 = products == "fp8" and kv_dtype is not None
    return Precision(
        compute="float32",
        round_kv=to_dtype if quantized_kv else None,
        round_p=to_fp8 if fp8 else None if dtype == "float32" else to_dtype,
        round_dot=to_tf32 if products == "tf32" and dtype == "float32" else None,
        round_q=to_fp8 if fp8 else None,
        round_qk_products=to_dtype if products == "activation" and dtype != "float32" else None,
        p_normalised=products == "normalised" and dtype != "float32",
    )


def probability_rounding(dtype: str) -> tuple[float, float] | None:
    """``(relative, absolute)``: how far rounding a probability to ``dtype`` may move it (half an
    ulp, half the smallest subnormal spacing); ``None`` for float32, whose kernels keep P.

    >>> probability_rounding("float16")
    (0.00048828125, 2.9802322387695312e-08)
    """
    if dtype == "float32":
        return None
    half_ulp = 2.0 ** -(MANTISSA_BITS[dtype] + 1)
    return half_ulp, 2.0 ** (MIN_NORMAL_EXPONENT[dtype] - MANTISSA_BITS[dtype] - 1)


def probability_spread(dtype: str) -> Precision:
    """The arithmetic that gives :data:`PROBABILITY_SIGMAS`'s ``sigma`` of each output (float64)."""
    bound = probability_rounding(dtype)
    assert bound is not None, "float32 kernels keep P: there is no rounding to allow for"
    return Precision(p_error=bound)


def _in_ulps(exact: F64, actual: F64, scale: F64) -> F64:
    """``|actual - exact|`` in units of ``scale``; NaN counts as infinitely far."""
    with np.errstate(invalid="ignore", over="ignore"):
        out: F64 = np.abs(actual - exact) / scale
    return np.where(np.isnan(out), np.inf, out)


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def ulp_scale(exact: F64, dtype: str) -> tuple[F64, float]:
    """The ulp each output's error is measured in, and the magnitude floor under it."""
    floor = magnitude_floor(exact, dtype)
    return ulp(np.maximum(np.abs(exact), floor), dtype), floor


def magnitude_floor(exact: F64, dtype: str) -> float:
    """The magnitude below which outputs are judged in the ulps of the floor itself."""
    floor = MAGNITUDE_FLOOR[dtype] * float(np.abs(exact).max(initial=0.0))
    return max(floor, float(ulp(np.array(0.0), dtype)))  # an all-zero output: the smallest step


@dataclass(frozen=True)
class OutputErrors:
    """One step and layer's outputs against the float64 reference, beside the same-precision one.

    ``*_ulps`` are errors in ulps (see the module docstring); the others are
    absolute. ``max_rel_error`` counts only outputs whose expected magnitude
    is above ``floor``: relative errors of values near zero say nothing. The
    distribution (p99, mean signed, relative) is computed only for a step
    that fails, where a person reads it.
    """

    dtype: str
    max_ulps: float
    reference_ulps: float
    mean_ulps: float
    reference_mean_ulps: float
    ratio: float
    floor_ulps: float
    max_error: float
    reference_error: float
    floor: float
    count: int
    p99_error: float | None = None  # the distribution: computed for a failing step only
    mean_signed_error: float | None = None
    max_rel_error: float | None = None
    scale_regime: str = USUAL_SCALE
    attention_path: str | None = None
    oracle: str = "the spec's numpy float64 reference"  # which reference judged the step
    probability_sigmas: float = 0.0  # each error judged less this many sigma of P's rounding
    products: str = "exact"  # the products the backend declared: the reference rounds them so

    @property
    def allowed_ulps(self) -> float:
        return self.ratio * self.reference_ulps + self.floor_ulps

    @property
    def excess(self) -> float:
        """The backend's largest error as a multiple of the allowed one (above 1 fails)."""
        return self.max_ulps / self.allowed_ulps

    @property
    def passed(self) -> bool:
        return bool(self.max_ulps <= self.allowed_ulps)

    def describe(self) -> list[str]:
        """Lines for a failure report: by how much, against what, and the distribution."""
        lines = [
            f"  error {self.max_ulps:.3g} ulp is {self.excess:.2f} x the allowed "
            f"{self.allowed_ulps:.3g} ulp = {self.ratio:g} x the same-precision reference's "
            f"{self.reference_ulps:.3g} ulp + {self.floor_ulps:g} ulp ({self.dtype})",
            f"  absolute errors over {self.count} outputs: max {self.max_error:.3g} "
            f"(same-precision reference: {self.reference_error:.3g}), p99 "
            f"{_g(self.p99_error)}, mean signed {_g(self.mean_signed_error)}; max relative "
            f"error {_g(self.max_rel_error)} where |expected| > {self.floor:.3g}",
            f"  scale regime: {self.scale_regime}",
            f"  judged by: {self.oracle}",
        ]
        if self.products != "exact":
            lines.append(
                f"  products: the backend declares {self.products!r}; the same-precision "
                "reference rounds its products so"
            )
        if self.probability_sigmas:
            lines.append(
                f"  each output's error taken less {self.probability_sigmas:g} standard "
                "deviations of what rounding its probabilities to the dtype can add"
            )
        if self.attention_path:
            lines.append(f"  attention path: {self.attention_path}")
        return lines

    def ulps(self, exact: F64, actual: F64, spread: F64 | None = None) -> F64:
        """Each output's error in the ulps this judgement uses (less ``probability_sigmas`` of
        ``spread``, when it was judged with one)."""
        unit = ulp(np.maximum(np.abs(exact), self.floor), self.dtype)
        out = _in_ulps(exact, actual, unit)
        if spread is None or not self.probability_sigmas:
            return out
        return np.maximum(out - self.probability_sigmas * spread / unit, 0.0)


def output_errors(
    exact: F64,
    same: F64,
    actual: F64,
    dtype: str,
    scale_regime: str = USUAL_SCALE,
    attention_path: str | None = None,
    scale: tuple[F64, float] | None = None,
    oracle: str | None = None,
    spread: F64 | None = None,
    products: str = "exact",
) -> OutputErrors:
    """Judge ``actual`` against ``exact``, allowing a multiple of ``same``'s own error (check 1).

    ``scale`` is :func:`ulp_scale` of ``exact``, when the caller has it already.
    ``oracle`` names the reference that computed ``exact`` and ``same`` when it
    is not the spec: the fast one, whose floor gains :data:`FAST_SLACK_ULPS`.
    ``spread``: each output's ``sigma`` of probability rounding (:func:`probability_spread`);
    the backend's errors are then judged less :data:`PROBABILITY_SIGMAS` of it.
    """
    unit, floor = ulp_scale(exact, dtype) if scale is None else scale
    ulps, ref_ulps = _in_ulps(exact, actual, unit), _in_ulps(exact, same, unit)
    if spread is not None:
        ulps = np.maximum(ulps - PROBABILITY_SIGMAS * spread / unit, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        max_error = float(np.abs(actual - exact).max(initial=0.0))
    errors = OutputErrors(
        dtype=dtype,
        max_ulps=float(ulps.max(initial=0.0)),
        reference_ulps=float(ref_ulps.max(initial=0.0)),
        mean_ulps=float(ulps.mean()) if ulps.size else 0.0,
        reference_mean_ulps=float(ref_ulps.mean()) if ref_ulps.size else 0.0,
        ratio=RATIO[dtype],
        floor_ulps=FLOOR_ULPS[dtype] + (0.0 if oracle is None else FAST_SLACK_ULPS[dtype]),
        max_error=max_error if np.isfinite(max_error) else float("inf"),
        reference_error=float(np.abs(same - exact).max(initial=0.0)),
        floor=floor,
        count=int(exact.size),
        scale_regime=scale_regime,
        attention_path=attention_path,
        probability_sigmas=0.0 if spread is None else PROBABILITY_SIGMAS,
        products=products,
    )
    if oracle is not None:
        errors = replace(errors, oracle=oracle)
    return errors if errors.passed else _with_distribution(errors, exact, actual)


def _with_distribution(errors: OutputErrors, exact: F64, actual: F64) -> OutputErrors:
    """``errors`` with the distribution a failure report shows (infinite where any is NaN)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        err = actual - exact
        above = np.abs(exact) > errors.floor
        rel = np.abs(err[above]) / np.abs(exact[above])
    if not np.isfinite(err).all():
        inf = float("inf")
        return replace(errors, p99_error=inf, mean_signed_error=inf, max_rel_error=inf)
    return replace(
        errors,
        p99_error=float(np.percentile(np.abs(err), 99)) if err.size else 0.0,
        mean_signed_error=float(err.mean()) if err.size else 0.0,
        max_rel_error=float(rel.max(initial=0.0)),
    )


@dataclass(frozen=True)
class ExampleErrors:
    """An example's output errors, in ulps, averaged (checks 2 and 3).

    ``mean_outward_ulps`` is the mean error in the direction of ``|expected|``:
    negative leans toward zero.
    """

    dtype: str
    mean_ulps: float
    reference_mean_ulps: float
    mean_signed_ulps: float
    mean_outward_ulps: float
    count: int
    reference_signed_ulps: float = 0.0  # the same-precision reference's own lean, signed
    reference_outward_ulps: float = 0.0  # and in the direction of |expected|

    @property
    def allowed_mean_ulps(self) -> float:
        return MEAN_RATIO[self.dtype] * self.reference_mean_ulps + MEAN_FLOOR_ULPS[self.dtype]

    @property
    def precise(self) -> bool:
        return self.count < MIN_SAMPLES or self.mean_ulps <= self.allowed_mean_ulps

    @property
    def lean(self) -> float:
        """How far the backend's mean error leans beyond the reference's own lean, in ulps.

        The declared precision is what a kernel may do, not what it must: a lean between
        none (exact arithmetic) and the reference's own is no lean at all. A kernel that
        rounds its products to TF32 on one path and not on another leans less there.

        >>> e = ExampleErrors("float32", 1.0, 1.0, -0.1, -0.1, 600, -3.0, -3.0)
        >>> e.lean, replace(e, mean_signed_ulps=-4.5, mean_outward_ulps=-4.5).lean
        (0.0, 1.5)
        >>> replace(e, mean_signed_ulps=+2.0, mean_outward_ulps=+2.0).lean
        2.0
        """
        return max(
            _beyond(self.mean_signed_ulps, self.reference_signed_ulps),
            _beyond(self.mean_outward_ulps, self.reference_outward_ulps),
        )

    @property
    def unbiased(self) -> bool:
        return self.count < MIN_SAMPLES or self.lean <= BIAS_LIMIT_ULPS[self.dtype]

    @property
    def passed(self) -> bool:
        return self.precise and self.unbiased

    def describe(self) -> str:
        what = []
        if not self.precise:
            what.append(
                f"the outputs are less precise than a kernel of their precision: mean error "
                f"{self.mean_ulps:.3g} ulp, {self.mean_ulps / self.allowed_mean_ulps:.2f} x "
                f"the allowed {self.allowed_mean_ulps:.3g} = {MEAN_RATIO[self.dtype]:g} x the "
                f"same-precision reference's {self.reference_mean_ulps:.3g} ulp "
                f"+ {MEAN_FLOOR_ULPS[self.dtype]:g}"
            )
        if not self.unbiased:
            reference = (
                f"{self.reference_signed_ulps:+.3f} and {self.reference_outward_ulps:+.3f}"
                if self.reference_signed_ulps or self.reference_outward_ulps
                else "0"
            )
            what.append(
                f"the outputs lean: mean error {self.mean_signed_ulps:+.3f} ulp signed, "
                f"{self.mean_outward_ulps:+.3f} ulp in the direction of |expected| (negative: "
                f"toward zero); the same-precision reference leans {reference}, the limit is "
                f"{BIAS_LIMIT_ULPS[self.dtype]} ulp beyond it"
            )
        return "; ".join(what) + f" (over the {self.count} {self.dtype} outputs of this example)"


def _beyond(lean: float, reference: float) -> float:
    """How far ``lean`` lies outside the span from 0 to ``reference``."""
    return max(min(0.0, reference) - lean, lean - max(0.0, reference), 0.0)


class ExampleMeter:
    """Accumulates an example's output errors for :class:`ExampleErrors`.

    >>> meter = ExampleMeter("float16")
    >>> exact = np.linspace(0.1, 0.9, 600)
    >>> meter.add(exact, round_to(exact, "float16"), round_to(exact, "float16"))
    >>> meter.result().passed
    True
    >>> toward_zero = round_to(exact, "float16") - 0.5 * ulp(exact, "float16")
    >>> meter.add(exact, toward_zero, round_to(exact, "float16"))
    >>> errors = meter.result()
    >>> errors.unbiased, round(errors.mean_outward_ulps, 2)
    (False, -0.24)
    """

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        # backend ulps, reference ulps, signed and outward ulps; the reference's signed, outward
        self._sums = np.zeros(6)
        self._count = 0

    def add(self, exact: F64, actual: F64, same: F64, unit: F64 | None = None) -> None:
        """One step's outputs; ``unit`` is :func:`ulp_scale`'s, when the caller has it."""
        scale = ulp_scale(exact, self.dtype)[0] if unit is None else unit
        with np.errstate(invalid="ignore", over="ignore"):
            signed = (actual - exact) / scale
            ref_signed = (same - exact) / scale
        ok = np.isfinite(signed) & np.isfinite(ref_signed)
        clipped = np.clip(signed[ok], -_BIAS_CLIP_ULPS, _BIAS_CLIP_ULPS)
        ref_clipped = np.clip(ref_signed[ok], -_BIAS_CLIP_ULPS, _BIAS_CLIP_ULPS)
        direction = np.sign(exact[ok])
        self._sums += (
            float(np.abs(signed[ok]).sum()),
            float(np.abs(ref_signed[ok]).sum()),
            float(clipped.sum()),
            float((clipped * direction).sum()),
            float(ref_clipped.sum()),
            float((ref_clipped * direction).sum()),
        )
        self._count += int(ok.sum())

    def result(self) -> ExampleErrors:
        b, r, signed, outward, r_signed, r_outward = (
            float(m) for m in self._sums / max(self._count, 1)
        )
        return ExampleErrors(self.dtype, b, r, signed, outward, self._count, r_signed, r_outward)


class Margins:
    """How close a run came to each check's limit: the largest share of the allowance used.

    Per dtype: check 1's largest ``excess`` over every step, check 2's largest
    mean error over every example (as a share of its allowance), and check 3's
    largest lean in ulps. Under 1 (under the limit for the lean) passes; a
    report shows them so that a kernel author sees how much room is left.

    >>> m = Margins()
    >>> m.note_step(output_errors(np.ones(4), np.ones(4), np.ones(4) + 2**-11, "float16"))
    >>> m.describe()
    ['float16: steps 0.50 of the allowed error, examples - of the allowed mean, lean - ulp']
    """

    def __init__(self) -> None:
        self.step: dict[str, float] = {}
        self.mean: dict[str, float] = {}
        self.lean: dict[str, float] = {}

    def note_step(self, errors: OutputErrors) -> None:
        d = errors.dtype
        self.step[d] = max(self.step.get(d, 0.0), errors.excess)

    def note_example(self, errors: ExampleErrors) -> None:
        if errors.count < MIN_SAMPLES:
            return
        d = errors.dtype
        share = errors.mean_ulps / errors.allowed_mean_ulps
        self.mean[d] = max(self.mean.get(d, 0.0), share)
        self.lean[d] = max(self.lean.get(d, 0.0), errors.lean)

    def add(self, other: Margins) -> None:
        """The most of each allowance used by this run or ``other`` (a shard of the same run)."""
        for mine, theirs in (
            (self.step, other.step),
            (self.mean, other.mean),
            (self.lean, other.lean),
        ):
            for d, value in theirs.items():
                mine[d] = max(mine.get(d, 0.0), value)

    def describe(self) -> list[str]:
        def fmt(table: dict[str, float], d: str, digits: int) -> str:
            return f"{table[d]:.{digits}f}" if d in table else "-"

        return [
            f"{d}: steps {fmt(self.step, d, 2)} of the allowed error, examples "
            f"{fmt(self.mean, d, 2)} of the allowed mean, lean {fmt(self.lean, d, 3)} ulp"
            for d in sorted(self.step)
        ]
