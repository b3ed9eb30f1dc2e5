"""Planted bugs for the suite's own blind spots: one failure hiding another, a false verdict.

* :class:`RoundingHidesOverflow`: two bugs, each in its own pass. Outputs
  rounded toward zero fail the short examples; element offsets computed in
  int32 fail only the large pool. A run that stopped at its first failure
  would never report the second; the suite judges every pass, so the
  self-test requires both passes to fail.
* :class:`NaNPastEightKeys`: outputs NaN for any query with more than eight
  visible keys (a masked slot's V, never written and NaN on a GPU, times
  zero). A NaN output replays as NaN: the report must call it a difference,
  never "the backend is not deterministic" (NaN != NaN).
"""

from __future__ import annotations

import numpy as np

from conformance.lockstep.numpy_backend import F32, NumpyPagedBackend
from conformance.planted.backends import Int32Offsets, RoundsTowardZero


class RoundingHidesOverflow(RoundsTowardZero, Int32Offsets):
    """Outputs rounded toward zero (short examples) and int32 element offsets (the large pool)."""

    selftest_passes = ("short", "large pool")


class NaNPastEightKeys(NumpyPagedBackend):
    """NaN outputs for a query with more than eight visible keys; otherwise correct."""

    def _weighted_sum(self, scores: F32, v: F32) -> F32:
        out: F32 = self._softmax(scores) @ v
        many = np.isfinite(scores).sum(axis=-1) > 8
        out[many] = np.nan
        return out


PLANTED_HIDDEN = {
    "two bugs in two passes (rounding; int32 offsets in the large pool)": RoundingHidesOverflow,
    "NaN outputs past eight keys (0 x NaN)": NaNPastEightKeys,
}
"""The planted bugs of the self-test's every-pass and NaN-replay checks."""
