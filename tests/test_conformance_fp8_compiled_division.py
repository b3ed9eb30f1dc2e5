"""A correct compiled fp8 KV write that divides as GPUs do passes the suite, on the CPU too.

vLLM's ``triton_reshape_and_cache_flash`` quantizes with a plain ``x / scale``
and a cast: compiled for sm_90, ``div.full.f32`` (2 ulp) and
``cvt.rn.satfinite``. The suite failed every such kernel on the GPU (a
drawn rounding tie landed on the other neighbour) and passed it on the CPU
(the interpreter divided exactly). Now the honest interpreter divides as the
GPU does, so the CPU run lands on the other side of some ties too, and the
spec accepts either neighbour of a tie: the kernel passes, and the report
counts the neighbours it accepted. The same write by the wrong scale still fails.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the CPU path needs TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from backend_gpu.triton_backend import TritonBackend  # noqa: E402
from conformance import run_suite  # noqa: E402
from conformance.lockstep.kv_check import ACCEPTED_NEIGHBOURS  # noqa: E402
from conformance.reports.report import text_report  # noqa: E402
from spec.backend import FloatArray  # noqa: E402
from spec.capabilities import Capabilities  # noqa: E402
from spec.kv_geometry import DTYPES  # noqa: E402


@triton.jit  # type: ignore[untyped-decorator]
def _store_fp8(x_ptr, cache_ptr, slot_ptr, scale, ROW: tl.constexpr, WRONG: tl.constexpr):  # type: ignore[no-untyped-def]
    """One token per program, quantized as vLLM's write does: ``(x / scale).to(fp8)``
    (``WRONG``: by twice the scale, a bug no division error excuses)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        col = tl.arange(0, ROW)
        x = tl.load(x_ptr + t * ROW + col).to(tl.float32)
        q = x / (scale * 2.0) if WRONG else x / scale  # div.full.f32 compiled: within 2 ulp
        tl.store(cache_ptr + slot * ROW + col, q.to(cache_ptr.dtype.element_ty))  # cvt.rn.satfinite


class DividesLikeVllm(TritonBackend):
    """The Triton backend with its fp8 KV write replaced by one that divides with a plain ``/``."""

    wrong_scale = False

    @property
    def capabilities(self) -> Capabilities:
        # head dims of 16 or more, powers of two: one row of a token is one tl.arange
        caps = super().capabilities
        return Capabilities(
            name="divides-like-vllm",
            device=caps.device,
            dtypes=frozenset(DTYPES),
            kv_dtypes=caps.kv_dtypes,
            head_dims=frozenset({16, 32, 64, 128}),
            num_kv_heads=frozenset({1, 2}),
            variants=caps.variants,
        )

    def write_kv(
        self,
        layer: int,
        key: FloatArray | torch.Tensor,
        value: FloatArray | torch.Tensor,
        slot_mapping: Sequence[int] | torch.Tensor,
    ) -> None:
        if self._mem().geometry.kv_dtype is None:  # not the write under test
            super().write_kv(layer, key, value, slot_mapping)
            return
        k, v, slots, k_cache, v_cache = self._kv_inputs(layer, key, value, slot_mapping)
        k_scale, v_scale = self._mem().scales(layer)
        n = slots.shape[0]
        for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            row = cache.shape[2] * cache.shape[3]
            x32 = x[:n].to(torch.float32).contiguous()
            flat = cache.view(-1, row)
            if n:
                _store_fp8[(n,)](x32, flat, slots, scale, ROW=row, WRONG=self.wrong_scale)


class DividesByTwiceTheScale(DividesLikeVllm):
    wrong_scale = True


def test_a_kernel_that_divides_as_gpus_do_passes_with_the_ties_it_moved_counted() -> None:
    result = run_suite(  # the fp8 feature passes: every token of theirs holds a tie
        DividesLikeVllm(), "divides-like-vllm", run_seed=5, database=None, max_examples=1,
        passes=("feature",),
    )  # fmt: skip
    assert result.passed, result.difference
    assert result.stats.checks[ACCEPTED_NEIGHBOURS] > 0, "the emulated division moved no tie"
    assert "fp8 values accepted as the other side of a rounding tie" in text_report(result)


def test_the_same_write_with_the_wrong_scale_fails() -> None:
    result = run_suite(
        DividesByTwiceTheScale(), "wrong scale", run_seed=5, database=None, max_examples=2,
        passes=("short",), shrink=False,
    )  # fmt: skip
    assert not result.passed
    assert result.difference is not None and result.difference.what in ("K", "V")
