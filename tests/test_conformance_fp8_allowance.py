"""The fp8 allowance: a compiled division may land on either side of a rounding tie.

Compiled Triton divides with ``div.full.f32`` (2 ulp, PTX ISA), so where the
exact quotient lies within 2 ulp of an fp8 rounding boundary either neighbour
is a correct stored value (:func:`spec.quant.quantize_range`). The spec's
memory then holds what the backend stored (:meth:`spec.kv_memory.KVMemory.accept`),
and everything else stays a difference: truncation is still caught.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numpy.typing import NDArray
from variant_workloads import VARIANT_WORKLOADS

from conformance.judges.fp8_ties import TieNeighbours
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.kv_check import ACCEPTED_NEIGHBOURS
from conformance.lockstep.numpy_backend import F32, NumpyPagedBackend
from conformance.lockstep.variants import drawn_scales
from conformance.lockstep.workload import SCALE_MANTISSA, TIES
from conformance.planted.variants import Fp8Truncates
from spec.errors import ArgumentValueError
from spec.kv_memory import KVMemory
from spec.quant import DIVISION_ULPS, FP8_FORMATS, quantize, quantize_range, round_fp8

FORMATS = sorted(FP8_FORMATS)
SCALES = st.builds(
    lambda m, e: m * 2.0**e,
    st.sampled_from([1.0, SCALE_MANTISSA, 0.6, 0.9921875]),
    st.integers(-12, 2),
)
VALUES = st.floats(-1e4, 1e4, allow_nan=False, width=32)


def _reciprocal(x: F32, scale: float, fmt: str) -> F32:
    """What a kernel that multiplies by the float32 reciprocal stores (vLLM's old write)."""
    product = np.asarray(x, np.float32) * (np.float32(1.0) / np.float32(scale))
    out: F32 = round_fp8(product, fmt).astype(np.float32)
    return out


@given(x=st.lists(VALUES, min_size=1, max_size=16), scale=SCALES, fmt=st.sampled_from(FORMATS))
def test_the_range_holds_the_nominal_value_and_the_reciprocal_and_is_one_step_wide(
    x: list[float], scale: float, fmt: str
) -> None:
    values = np.array(x, dtype=np.float32)
    low, high = quantize_range(values, scale, fmt)
    nominal = quantize(values, scale, fmt)
    assert ((low <= nominal) & (nominal <= high)).all()
    recip = _reciprocal(values, scale, fmt)
    assert ((recip == low) | (recip == high)).all(), "a reciprocal multiply is within 2 ulp"
    # low and high are neighbours: nothing of the format lies strictly between them
    between = round_fp8((low + high) / 2, fmt)
    assert ((between == low) | (between == high)).all()


@given(scale=SCALES, fmt=st.sampled_from(FORMATS), offset=st.integers(-8, 8))
def test_only_quotients_within_two_ulp_of_a_tie_have_two_values(
    scale: float, fmt: str, offset: int
) -> None:
    """A quotient ``offset`` float32 ulps from a tie has two correct values if |offset| < 2, one
    if |offset| > 2; at exactly 2 the quotient off by 2 ulp lands on the tie itself, which
    rounds to its even neighbour: two values only where that is the other one."""
    tie = np.float32(TIES[fmt][0])
    quotient = np.float32(tie + offset * np.spacing(tie))
    x = np.array([np.float64(quotient) * np.float32(scale)])
    exact = np.float64(np.float32(x[0])) / np.float64(np.float32(scale))
    ulps = (exact - np.float64(tie)) / np.float64(np.spacing(tie))
    low, high = quantize_range(x, scale, fmt)
    if abs(ulps) != DIVISION_ULPS:
        assert (low[0] != high[0]) == (abs(ulps) < DIVISION_ULPS)
    else:
        nominal = round_fp8(np.array([exact]), fmt)[0]
        at_tie = round_fp8(np.array([np.float64(tie)]), fmt)[0]
        assert (low[0] != high[0]) == (at_tie != nominal)


def test_nan_and_saturation_have_one_value() -> None:
    low, high = quantize_range(np.array([np.nan, 1e9, -1e9, 0.0]), 1.0, "fp8_e4m3")
    assert np.isnan(low[0]) and np.isnan(high[0])
    assert low[1:].tolist() == high[1:].tolist() == [448.0, -448.0, 0.0]


@given(
    fmt=st.sampled_from(FORMATS),
    scale=SCALES,
    rows=st.lists(st.lists(VALUES, min_size=2, max_size=2), min_size=1, max_size=6),
    copy=st.booleans(),
    lazy=st.booleans(),
)
def test_memory_accepts_the_other_value_and_nothing_else(
    fmt: str, scale: float, rows: list[list[float]], copy: bool, lazy: bool
) -> None:
    """Write (with a tie in every row), maybe copy the block, accept the reciprocal's values:
    the memory holds them, ``others`` holds the nominal ones; a value off by one more step is
    refused and nothing changes."""
    memory = KVMemory(1, 4, 8, 1, 3, kv_dtype=fmt, kv_scales=((scale, scale),), lazy=lazy)
    m = TieNeighbours(memory)
    tie = TIES[fmt][0] * scale
    k = np.array([[[a, b, tie]] for a, b in rows])
    slots = list(range(len(rows)))
    memory.write(0, k, k, slots)
    m.note_write(0, k, k, slots)
    if copy:
        memory.copy_blocks([(0, 2)])
        m.note_copies([(0, 2)])
        slots = [16 + s for s in slots]
    nominal = memory.read_blocks(0, [slots[0] // 8])[0].reshape(8, 1, 3)[: len(rows)]
    theirs = _reciprocal(k.astype(np.float32), scale, fmt).astype(np.float64)
    low, high = quantize_range(k, scale, fmt)
    assert ((theirs == low) | (theirs == high)).all()

    wrong = theirs.copy()
    wrong[0, 0, 0] = round_fp8(np.array([theirs[0, 0, 0] * 1.5 + 1.0]), fmt)[0]
    if wrong[0, 0, 0] not in (low[0, 0, 0], high[0, 0, 0]):
        with pytest.raises(ArgumentValueError, match=f"slot {slots[0]} holds values"):
            m.accept(0, 0, slots, wrong)
        assert np.array_equal(memory.read_blocks(0, [slots[0] // 8])[0][0, : len(rows)], nominal)

    changed = m.accept(0, 0, slots, theirs)
    assert changed == int((theirs != nominal).sum())
    block = slots[0] // 8
    held = memory.read_blocks(0, [block])[0][0, : len(rows)]
    other = m.others(0, [block])[0][0, : len(rows)]
    assert np.array_equal(held, theirs)
    assert np.array_equal(np.where(theirs != nominal, nominal, other), other)
    assert m.accept(0, 0, slots, theirs) == 0  # accepting again changes nothing


class QuantizesByReciprocal(NumpyPagedBackend):
    """A correct kernel: its KV write multiplies by the float32 reciprocal of the scale, as a
    compiled division's error allows (and lands on the other side of some ties)."""

    def _store(self, rows: NDArray[np.floating], layer: int, which: int) -> NDArray[np.floating]:
        g = self._geo()
        if g.kv_dtype is None:
            return super()._store(rows, layer, which)
        inverse = np.float32(1.0) / np.float32(g.kv_scales[layer][which])
        product = np.asarray(rows, dtype=np.float32) * inverse
        return self._fp8_round(self._saturate(product, g.kv_dtype), g.kv_dtype)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_a_reciprocal_quantizer_passes_on_the_other_side_of_the_drawn_ties(kv_dtype: str) -> None:
    """The drawn scales (7/8 of a power of two) put every tie value's reciprocal product on the
    other side: the suite accepts each, judges attention against it, and counts them."""
    workload, config, _ = VARIANT_WORKLOADS["Fp8Truncates"]
    g = replace(
        config.geometry, kv_dtype=kv_dtype, kv_scales=(drawn_scales(kv_dtype, 1.75, 0.875),)
    )
    ls = Lockstep(QuantizesByReciprocal(), replace(config, geometry=g))
    workload(ls)
    ls.finish()
    assert ls.checks[ACCEPTED_NEIGHBOURS] > 0
    assert ls.checks["attention outputs judged against the same-precision reference"] > 0
    k_spec, _ = ls.memory.read_blocks(0, list(range(g.num_blocks)))
    k_backend, _ = ls.backend.read_cache(0)
    assert np.array_equal(k_spec, np.asarray(k_backend, dtype=np.float64), equal_nan=True)


def test_truncation_is_still_caught_where_no_tie_excuses_it() -> None:
    workload, config, _ = VARIANT_WORKLOADS["Fp8Truncates"]
    with pytest.raises(ConformanceFailure) as caught:
        workload(Lockstep(Fp8Truncates(), config))
    diff = caught.value.difference
    assert diff.what in {"K", "V"}
    expected, actual = np.array(diff.expected), np.array(diff.actual)
    assert (np.abs(actual) < np.abs(expected)).all(), "each shown element truncated toward zero"
