"""The honest interpreter: its casts equal torch's (saturated as sm_90 saturates), its bf16
arithmetic equals torch's, an int64-annotated offset past 2^31 indexes right, and what it
cannot correct is said as such.

Every check runs a tiny ``@triton.jit`` kernel under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import devices  # noqa: F401  (turns the interpreter on without CUDA, before the kernels below)
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.interpreter import InterpreterLimit, honest_interpreter, limit_in

pytestmark = pytest.mark.needs_interpreter

# the largest finite value of each format: compiled Triton saturates there (cvt.rn.satfinite)
TARGETS = {
    "fp8e4nv": (torch.float8_e4m3fn, 448.0),
    "fp8e5": (torch.float8_e5m2, 57344.0),
    "bf16": (torch.bfloat16, None),
}


@triton.jit  # type: ignore[untyped-decorator]
def _cast(x_ptr, y_ptr, n, OUT: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m)
    if OUT == 0:
        tl.store(y_ptr + o, x.to(tl.float8e4nv), mask=m)
    elif OUT == 1:
        tl.store(y_ptr + o, x.to(tl.float8e5), mask=m)
    elif OUT == 2:
        tl.store(y_ptr + o, x.to(tl.bfloat16), mask=m)
    else:
        tl.store(y_ptr + o, x.to(tl.float32), mask=m)


def _kernel_cast(x: torch.Tensor, target: str) -> torch.Tensor:
    dtype = TARGETS[target][0] if target in TARGETS else torch.float32
    out = torch.empty(x.numel(), dtype=dtype)
    code = {"fp8e4nv": 0, "fp8e5": 1, "bf16": 2}.get(target, 3)
    with honest_interpreter():
        _cast[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), OUT=code, BLOCK=256)
    return out


def _torch_cast(x: torch.Tensor, target: str) -> torch.Tensor:
    dtype, limit = TARGETS[target]
    return (x if limit is None else x.clamp(-limit, limit)).to(dtype)


def _assert_same(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    g, w = got.float(), want.float()
    nan = torch.isnan(w)
    assert torch.equal(torch.isnan(g), nan), x[torch.isnan(g) != nan]
    bad = ~nan & (
        got.view(torch.uint8 if got.element_size() == 1 else torch.int16)
        != want.view(torch.uint8 if got.element_size() == 1 else torch.int16)
    )
    assert not bad.any(), list(zip(x[bad].tolist(), g[bad].tolist(), w[bad].tolist(), strict=True))[
        :8
    ]


def _classes(target: str) -> torch.Tensor:
    """Inputs of every class: normal, subnormal, overflow, NaN, infinity, zeros, exact ties."""
    dtype = TARGETS[target][0]
    codes = torch.arange(2 ** (8 * torch.finfo(dtype).bits // 8), dtype=torch.int32)
    if dtype is torch.bfloat16:
        codes = torch.arange(0, 2**16, 7, dtype=torch.int32)
        grid = codes.to(torch.int16).view(torch.bfloat16).float()
    else:
        grid = codes.to(torch.uint8).view(dtype).float()
    grid = torch.unique(grid[torch.isfinite(grid)])  # every representable value (a sample for bf16)
    ties = (grid[:-1] + grid[1:]) / 2  # exact midpoints in float32: round to even decides
    near = torch.cat([ties.nextafter(grid[1:]), ties.nextafter(grid[:-1])])
    fi = torch.finfo(torch.float32)
    special = torch.tensor(
        [0.0, -0.0, fi.tiny, -fi.tiny, 1e-45, -1e-45, fi.max, -fi.max, 1e6, -1e6, 464.0, 480.0,
         61440.0, 65504.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1.0625, 500.0],
        dtype=torch.float32,
    )  # fmt: skip
    return torch.cat([grid, ties, near, special, grid * 1.5, grid / 3]).contiguous()


@pytest.mark.parametrize("target", ["fp8e4nv", "fp8e5", "bf16"])
def test_casts_equal_torch_on_every_class(target: str) -> None:
    x = _classes(target)
    _assert_same(_kernel_cast(x, target), _torch_cast(x, target), x)


@pytest.mark.parametrize("target", ["fp8e4nv", "fp8e5"])
def test_fp8_widens_exactly_on_every_code(target: str) -> None:
    @triton.jit  # type: ignore[untyped-decorator]
    def widen(x_ptr, y_ptr, E5: tl.constexpr):  # type: ignore[no-untyped-def]
        o = tl.arange(0, 256)
        bits = tl.load(x_ptr + o)
        v = bits.to(tl.float8e5, bitcast=True) if E5 else bits.to(tl.float8e4nv, bitcast=True)
        tl.store(y_ptr + o, v.to(tl.float32))

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32)
    with honest_interpreter():
        widen[(1,)](codes, out, E5=target == "fp8e5")
    want = codes.view(TARGETS[target][0]).float()
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    assert torch.equal(out[~torch.isnan(want)], want[~torch.isnan(want)])


@settings(max_examples=25)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_casts_equal_torch_on_any_float32_bit_pattern(bits: list[int]) -> None:
    x = torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32).copy())
    for target in TARGETS:
        _assert_same(_kernel_cast(x, target), _torch_cast(x, target), x)


@triton.jit
def _bf16_ops(a_ptr, b_ptr, z_ptr):  # type: ignore[no-untyped-def]
    o = tl.arange(0, 16)
    a = tl.load(a_ptr + o)
    b = tl.load(b_ptr + o)
    s = (a + b) / b - a  # no multiply-add: compiled Triton would fuse it into one fma
    s = tl.where(a > b, s, -(a * b))
    s = tl.maximum(s, b)
    tl.store(z_ptr + o, s)
    tl.store(z_ptr + 16 + o, tl.abs(-a) * a)
    tl.store(z_ptr + 32 + o, tl.zeros([16], tl.bfloat16) + tl.max(a, 0))
    d = tl.dot(tl.reshape(a, (4, 4)), tl.reshape(b, (4, 4)))
    tl.store(z_ptr + 48 + o, tl.reshape(d, (16,)).to(tl.bfloat16))


@settings(max_examples=15)
@given(st.integers(0, 2**31 - 1))
def test_bf16_arithmetic_equals_torch(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(16, generator=g) * 3).bfloat16()
    b = (torch.randn(16, generator=g) * 3).bfloat16()
    z = torch.empty(64, dtype=torch.bfloat16)
    with honest_interpreter():
        _bf16_ops[(1,)](a, b, z)
    # Triton divides bf16 in float32 (so the rest runs in float32 too); + and * stay bf16,
    # rounded to nearest even at each operation, as torch rounds them
    s = (a + b).float() / b.float() - a.float()
    s = torch.maximum(torch.where(a > b, s, -(a * b).float()), b.float()).bfloat16()
    d = (a.float().reshape(4, 4) @ b.float().reshape(4, 4)).reshape(16)
    assert torch.equal(z[:16], s)
    assert torch.equal(z[16:32], torch.abs(-a) * a)
    assert torch.equal(z[32:48], a.max().expand(16))
    assert torch.allclose(z[48:].float(), d.bfloat16().float(), rtol=0, atol=0)


@triton.jit  # type: ignore[untyped-decorator]
def _gather_row(src_ptr, out_ptr, row: tl.int64, stride):  # type: ignore[no-untyped-def]
    o = tl.arange(0, 16)
    tl.store(out_ptr + o, tl.load(src_ptr + row * stride + o))


def test_int64_parameter_indexes_past_2_31() -> None:
    stride, row = 2**12, 2**20  # row * stride == 2**32: wraps to 0 in int32
    big = torch.empty(row * stride + 16, dtype=torch.uint8)  # lazily allocated: no resident cost
    big[:16] = 7
    big[row * stride :] = torch.arange(16, dtype=torch.uint8)
    out = torch.zeros(16, dtype=torch.uint8)
    with honest_interpreter():
        _gather_row[(1,)](big, out, row, stride)
    assert out.tolist() == list(range(16))
    with _plain_interpreter():
        _gather_row[(1,)](big, out, row, stride)  # Triton's own interpreter: row * stride wraps
    assert out.tolist() == [7] * 16


@contextlib.contextmanager
def _plain_interpreter() -> Iterator[None]:
    """Triton's interpreter as shipped, even where a suite run earlier installed the shim."""
    from conformance.interpreter import install, installed, uninstall

    depth = 0
    while installed():
        uninstall()
        depth += 1
    try:
        yield
    finally:
        for _ in range(depth):
            install()


def test_what_cannot_be_corrected_is_named() -> None:
    @triton.jit
    def to_e4b15(x_ptr, y_ptr):  # type: ignore[no-untyped-def]
        tl.store(y_ptr, tl.load(x_ptr).to(tl.float8e4b15).to(tl.int8, bitcast=True))

    x, y = torch.ones(1), torch.zeros(1, dtype=torch.int8)
    with honest_interpreter(), pytest.raises(Exception) as caught:
        to_e4b15[(1,)](x, y)
    assert limit_in(caught.value) is not None
    assert "fp8e4b15" in (limit_in(caught.value) or "")
    assert isinstance(InterpreterLimit("x"), RuntimeError)


_COMPILE_FOR_SM_90 = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def narrow(x_ptr, a_ptr, b_ptr, c_ptr):
    x = tl.load(x_ptr)
    tl.store(a_ptr, x.to(tl.float8e4nv))
    tl.store(b_ptr, x.to(tl.float8e5))
    tl.store(c_ptr, x.to(tl.bfloat16))

sig = {"x_ptr": "*fp32", "a_ptr": "*fp8e4nv", "b_ptr": "*fp8e5", "c_ptr": "*bf16"}
print(triton.compile(ASTSource(narrow, sig, {}), target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


def test_the_corrections_are_what_triton_compiles_for_sm_90(tmp_path: Path) -> None:
    """``triton.compile`` for sm_90 (no GPU needed) rounds to nearest even and saturates.

    It compiles in a fresh process: once a process has run interpreted kernels, Triton's
    code generator no longer sees the language it patched, whatever this shim does.
    """
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}  # its own cache: no shared state
    env.pop("TRITON_INTERPRET", None)
    script = tmp_path / "compile_sm_90.py"
    script.write_text(_COMPILE_FOR_SM_90)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cvt.rn.satfinite.e4m3x2.f32" in done.stdout
    assert "cvt.rn.satfinite.e5m2x2.f32" in done.stdout
    assert "cvt.rn.bf16.f32" in done.stdout


def test_a_run_that_meets_an_interpreter_limit_is_not_judged() -> None:
    """A backend exception carrying an interpreter limit: the verdict names the limit."""
    from conformance.judges.compare import Difference
    from conformance.lockstep.run_stats import RunStats
    from conformance.reports.report import verdict
    from conformance.run.result import RunResult
    from spec.backend import Capabilities

    result = RunResult("x", "quick", 1, Capabilities("x"), (), RunStats(examples=1))
    detail = (
        f"backend.attention raised InterpreterError: {InterpreterLimit('a conversion to fp8e4b15')}"
    )
    result.difference = Difference("exception", 0, detail)
    assert verdict(result).startswith("NOT JUDGED: interpreter limit: a conversion to fp8e4b15")
    result.difference = Difference("exception", 0, "backend.attention raised ValueError: bad")
    assert verdict(result) == "FAILED"


def test_the_suite_installs_it_once_when_interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.interpreter import install, install_when_interpreting, installed, uninstall

    depth = 0
    while installed():
        uninstall()
        depth += 1
    try:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not install_when_interpreting()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert install_when_interpreting() and install_when_interpreting()
        uninstall()  # one install, however many calls
        assert not installed()
    finally:
        for _ in range(depth):
            install()


@triton.jit
def _int32_sum(x_ptr, y_ptr, big):  # type: ignore[no-untyped-def]
    o = tl.arange(0, 16)
    tl.store(y_ptr + o, tl.load(x_ptr + o) + big)


def test_overflow_checks_are_not_computed_unless_debug_and_values_are_unchanged() -> None:
    """The checks compiled Triton emits only in debug mode: skipped, the sums the same (wrapped)."""
    from triton.runtime import interpreter

    x = torch.full((16,), 2**31 - 8, dtype=torch.int32) + torch.arange(16, dtype=torch.int32)
    plain, honest = torch.zeros_like(x), torch.zeros_like(x)
    with _plain_interpreter():
        assert interpreter.interpreter_builder.options.sanitize_overflow
        _int32_sum[(1,)](x, plain, 4)
        with honest_interpreter():
            assert not interpreter.interpreter_builder.options.sanitize_overflow
            _int32_sum[(1,)](x, honest, 4)
        assert interpreter.interpreter_builder.options.sanitize_overflow  # restored
    assert torch.equal(plain, honest)
    assert honest.tolist() == [((v + 4 + 2**31) % 2**32) - 2**31 for v in x.tolist()]
