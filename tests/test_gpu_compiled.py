"""Compiled Triton on a GPU computes what the interpreter assumes it computes.

The honest interpreter (:mod:`conformance.interpreter`) converts to and from
bfloat16 and fp8 by :mod:`conformance.interpreter.floats`, which says what
``triton.compile`` emits for sm_90. A conversion kernel runs on every bfloat16,
float16 and fp8 bit pattern and on a dense float32 sweep (every bfloat16 top
half over low halves on, beside and between rounding ties: subnormals,
overflow, infinities and NaN included) and must agree with the emulation bit
for bit: compiled on a GPU (the claim itself), under the honest interpreter on
a CPU (its wiring). A NaN must be NaN on both sides; its sign and payload are
not compared (the conversions give a canonical NaN of their own choosing).

On a GPU only (``gpu_only``, skipped with the reason elsewhere), one workload
(:mod:`kernel_workload`) runs through the project's kernels compiled here and
interpreted in a child process: KV writes (fp8 rounding ties included) and
block copies agree bit for bit, attention within twice the dtype's tolerance
(summation order and ``exp2`` differ; each side is within it of float64).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
import triton
import triton.language as tl
from backend_helpers import TOLERANCES, bits
from devices import DEVICE, INTERPRETED, ROOT, run_interpreted
from kernel_workload import EXACT, outputs

from conformance.interpreter import honest_interpreter
from conformance.interpreter.floats import bf16_decode, bf16_encode, fp8_decode, fp8_encode

Bits = npt.NDArray[np.unsignedinteger]

FP8 = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
"""Triton's name of each fp8 format, and its torch dtype."""
LOW_HALVES = (0x0000, 0x0001, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF)
"""Low 16 bits under every bfloat16 pattern: exact, just past it, a quarter, just below the
tie, the tie, just past it, three quarters, the top. An fp8 value or midpoint has at most 5
significant bits, so the sweep holds each one and both of its float32 neighbours too."""
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}


@triton.jit  # type: ignore[untyped-decorator]
def _convert(x_ptr, y_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m).to(y_ptr.dtype.element_ty), mask=m)


def _converted(x: Bits, source: torch.dtype, target: torch.dtype) -> torch.Tensor:
    """Bit patterns ``x`` read as ``source``, converted to ``target`` by the kernel: compiled
    on a GPU, under the honest interpreter on a CPU."""
    signed = torch.from_numpy(x.view(np.dtype(f"i{x.itemsize}")) if x.itemsize > 1 else x)
    src = signed.view(source).to(DEVICE)
    out = torch.empty(src.numel(), dtype=target, device=DEVICE)
    honest = honest_interpreter() if INTERPRETED else contextlib.nullcontext()
    with honest, np.errstate(invalid="ignore"):  # it widens signalling NaNs in numpy
        _convert[(triton.cdiv(src.numel(), 1024),)](src, out, src.numel(), BLOCK=1024)
    return out.cpu()


def _assert_same(
    x: Bits, got: torch.Tensor, want: Bits, want_values: npt.NDArray[np.float32], what: str
) -> None:
    """The kernel's results ``got`` are the emulated bits ``want`` (whose values are
    ``want_values``) wherever those are not NaN, and NaN wherever they are."""
    got_bits = bits(got).numpy().view(_UNSIGNED[got.element_size()])
    got_nan = torch.isnan(got.float()).numpy()
    want_nan = np.isnan(want_values)
    wrong = np.where(want_nan, ~got_nan, got_bits != want)
    if wrong.any():
        i = np.flatnonzero(wrong)
        shown = [(hex(int(x[j])), hex(int(got_bits[j])), hex(int(want[j]))) for j in i[:8]]
        raise AssertionError(
            f"{what}: {len(i)} of {len(x)} differ; first (input, kernel, emulated): {shown}"
        )


def _float32_sweep() -> npt.NDArray[np.uint32]:
    """Every bfloat16 pattern as the top half of float32s, with :data:`LOW_HALVES` below."""
    top = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    return (top[:, None] | np.array(LOW_HALVES, dtype=np.uint32)).ravel()


def _every_16_bit_pattern() -> npt.NDArray[np.uint16]:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def test_bfloat16_conversions_are_the_emulations() -> None:
    """Widening every bfloat16 exactly; narrowing the float32 sweep to nearest even."""
    x16 = _every_16_bit_pattern()
    wide = bf16_decode(x16)
    got = _converted(x16, torch.bfloat16, torch.float32)
    _assert_same(x16, got, wide.view(np.uint32), wide, "bfloat16 -> float32")
    x32 = _float32_sweep()
    narrow = bf16_encode(x32.view(np.float32))
    got = _converted(x32, torch.float32, torch.bfloat16)
    _assert_same(x32, got, narrow, bf16_decode(narrow), "float32 -> bfloat16")


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_conversions_are_the_emulations(fmt: str) -> None:
    """Every code widened exactly; the float32 sweep and every float16 and bfloat16 value
    narrowed to nearest even, saturating at the largest finite value."""
    codes = np.arange(256, dtype=np.uint16).astype(np.uint8)
    wide = fp8_decode(codes, fmt)
    got = _converted(codes, FP8[fmt], torch.float32)
    _assert_same(codes, got, wide.view(np.uint32), wide, f"{fmt} -> float32")
    x16 = _every_16_bit_pattern()
    sources: list[tuple[str, Bits, torch.dtype, npt.NDArray[np.float32]]] = [
        ("float32", _float32_sweep(), torch.float32, _float32_sweep().view(np.float32)),
        ("float16", x16, torch.float16, x16.view(np.float16).astype(np.float32)),
        ("bfloat16", x16, torch.bfloat16, bf16_decode(x16)),
    ]
    for name, x, source, values in sources:
        with np.errstate(invalid="ignore"):  # the sweep's signalling NaNs, widened
            want = fp8_encode(values, fmt)
        got = _converted(x, source, FP8[fmt])
        _assert_same(x, got, want, fp8_decode(want, fmt), f"{name} -> {fmt}")


@pytest.mark.gpu_only
def test_the_kernels_compiled_agree_with_the_kernels_interpreted(tmp_path: Path) -> None:
    """KV writes and block copies bit for bit; attention within the dtype's tolerances."""
    saved = tmp_path / "interpreted.pt"
    run_interpreted(ROOT / "tests" / "kernel_workload.py", str(saved), timeout=600)
    _assert_agree(outputs(DEVICE), torch.load(saved))


def _assert_agree(here: dict[str, torch.Tensor], there: dict[str, torch.Tensor]) -> None:
    """Every result of :mod:`kernel_workload` run here equals the one run there: exactly for
    :data:`kernel_workload.EXACT` results; attention within twice the dtype's tolerance (each
    side keeps that tolerance from the float64 reference)."""
    assert sorted(here) == sorted(there)
    for name, got in here.items():
        want = there[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if name.startswith(EXACT):
            assert torch.equal(bits(got), bits(want)), f"{name} differs compiled vs interpreted"
            continue
        atol, rtol = TOLERANCES[str(got.dtype).removeprefix("torch.")]
        g, w = got.double(), want.double()
        assert bool(torch.isfinite(g).all() and torch.isfinite(w).all()), f"{name}: not finite"
        worst = float(((g - w).abs() - 2 * (atol + rtol * w.abs())).max())
        assert worst <= 0, f"{name}: compiled vs interpreted off by {worst:.3g} past the tolerance"
