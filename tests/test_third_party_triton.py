"""An outside project's Triton kernels (``tests/third_party_triton/``) conform via an adapter.

``docs/plugging-in.md`` walks through this adapter and shows a full CLI run;
here the same backend runs a short lockstep pass in-process, and its declared
limits are checked against the GPU compiler: the ``excludes`` hook says head
dim 8 runs only in float32 because an fp16 ``tl.dot`` with an inner dimension
under 16 does not compile for sm_90, which the interpreter would never show.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conformance import load_backend, run_suite
from conformance.reports.report import text_report
from spec.kv_geometry import KVGeometry

ROOT = Path(__file__).resolve().parents[1]
REF = "tests/third_party_triton/adapter.py:make_backend"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRETED, reason="the CPU path needs TRITON_INTERPRET=1")
def test_the_adapter_conforms_decode_only_with_the_rest_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    backend = load_backend(REF)
    result = run_suite(backend, REF, run_seed=3, database=None, max_examples=4, passes=("short",))
    assert result.passed, result.difference
    skipped = "\n".join(result.skipped)
    assert "dtype bfloat16: not in the backend capabilities" in skipped
    assert "max_query_len is 1 (decode-only)" in skipped
    assert "excluded by the backend: head dim 8 in float16" in skipped


FAST_FP32 = "tests/third_party_triton/adapter.py:make_fast_fp32_backend"
DECLARED_FAST_FP32 = "tests/third_party_triton/adapter.py:make_declared_fast_fp32_backend"


@pytest.mark.skipif(not INTERPRETED, reason="the CPU path needs TRITON_INTERPRET=1")
def test_tf32_products_fail_undeclared_naming_tf32_and_pass_declared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Their float32 path at tl.dot's default precision: the honest interpreter rounds its
    operands to TF32 as an NVIDIA GPU does, so the CPU run fails it, naming TF32 products in
    the report's first lines; declared (products="tf32"), it is judged as such and passes."""
    monkeypatch.chdir(ROOT)
    run: dict[str, Any] = {"run_seed": 3, "database": None, "max_examples": 6, "passes": ("short",)}
    undeclared = run_suite(
        load_backend(FAST_FP32), FAST_FP32, dtypes=["float32"], shrink=False, **run
    )
    assert not undeclared.passed
    first_lines = "\n".join(text_report(undeclared).splitlines()[:4])
    assert "float32 products take TF32 operands" in first_lines, first_lines
    declared = run_suite(load_backend(DECLARED_FAST_FP32), DECLARED_FAST_FP32, **run)
    assert declared.passed, declared.difference
    assert "the backend declares 'tf32'" in text_report(declared)
    assert declared.stats.drawn.get("float32", 0) > 0


def test_the_excludes_hook_vetoes_small_head_dims_outside_fp32() -> None:
    caps = load_backend(REF).capabilities
    g = KVGeometry(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8)
    assert caps.unsupported(g, 2) == []
    half = KVGeometry(1, 4, 4, 1, 8, dtype="float16")
    assert caps.unsupported(half, 2) == ["head dim 8 in float16 (tl.dot needs K >= 16 on a GPU)"]
    assert caps.unsupported(KVGeometry(1, 4, 4, 1, 16, dtype="float16"), 2) == []


_PROBE = textwrap.dedent(
    """
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sys.path.insert(0, "tests/third_party_triton")
    import their_kernels as tk

    def signature(fn, dtype):
        sig = {}
        for p in fn.params:
            if p.is_constexpr:
                sig[p.name] = "constexpr"
            elif p.name in ("block_table_ptr", "seq_lens_ptr", "slots_ptr"):
                sig[p.name] = "*i32"
            elif p.name.endswith("_ptr"):
                sig[p.name] = "*" + dtype
            else:
                sig[p.name] = "fp32" if p.name == "sm_scale" else "i32"
        return sig

    def compiles(fn, dtype, **consts):
        try:
            triton.compile(ASTSource(fn, signature(fn, dtype), consts),
                           target=GPUTarget("cuda", 90, 32))
            return "ok"
        except Exception as err:
            return str(err).strip().splitlines()[-1]

    for dtype, hd in (("fp16", 8), ("fp32", 8), ("fp16", 16), ("bf16", 128), ("fp32", 256)):
        hp = 1 << (hd - 1).bit_length()
        print(f"{dtype}/{hd}:", compiles(tk._paged_decode_kernel, dtype, GROUP=4, GROUP_PAD=16,
                                  HEAD_DIM=hd, HEAD_PAD=hp, LOG2_PAGE=4, TILE=64,
                                  IEEE=dtype == "fp32"))
    print("store:", compiles(tk._store_kv_kernel, "bf16", ROW=1024, ROW_PAD=1024, TOKENS=4))
    """
)


def test_the_declared_limits_are_the_gpu_compilers() -> None:
    """Compiled for sm_90 with the interpreter off: fp16 head dim 8 fails, fp32 compiles."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert "K >= 16" in got.pop("fp16/8"), got  # what the excludes hook says, and why
    assert got == dict.fromkeys(["fp32/8", "fp16/16", "bf16/128", "fp32/256", "store"], "ok")


_LATE = {
    "helper_mod.py": "import triton\n\n@triton.jit\ndef twice(x):\n    return 2 * x\n",
    "kernel_mod.py": (
        "import triton\nimport triton.language as tl\nfrom helper_mod import twice\n\n"
        "@triton.jit\ndef kernel(x_ptr):\n    i = tl.arange(0, 4)\n"
        "    tl.store(x_ptr + i, twice(tl.load(x_ptr + i)))\n"
    ),
}


@pytest.mark.parametrize(
    ("before", "message"),
    [
        ("import kernel_mod", "active drivers"),  # every kernel defined before: GPU kernels
        ("import helper_mod", "Cannot call @triton.jit'd outside of the scope of a kernel"),
    ],
)
def test_triton_interpret_set_late_fails_as_the_page_says(
    tmp_path: Path, before: str, message: str
) -> None:
    """docs/plugging-in.md quotes these two errors (the first only where there is no GPU)."""
    torch = pytest.importorskip("torch")
    if "active drivers" in message and torch.cuda.is_available():
        pytest.skip("a GPU is present: kernels defined before the variable are its kernels")
    for name, text in _LATE.items():
        (tmp_path / name).write_text(text)
    script = (
        f"import os, torch\n{before}\nos.environ['TRITON_INTERPRET'] = '1'\n"
        "import kernel_mod\nkernel_mod.kernel[(1,)](torch.ones(4))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]


@pytest.mark.skipif(not INTERPRETED, reason="a claim about the CPU interpreter")
def test_bfloat16_is_wrong_under_tritons_interpreter_and_right_under_the_honest_one() -> None:
    """float16 is right to its precision; the same bfloat16 launch is off by orders under
    Triton's own interpreter, and right to bfloat16's precision under the suite's shim."""
    from conformance.interpreter import honest_interpreter, install, installed, uninstall

    depth = 0
    while installed():  # a run earlier in this process installed it: Triton's own, for now
        uninstall()
        depth += 1
    try:
        raw = _decode_errors()
    finally:
        for _ in range(depth):
            install()
    with honest_interpreter():
        honest = _decode_errors()
    assert raw["float16"] < 2e-3, raw
    assert raw["bfloat16"] > 1.0, raw
    assert honest["bfloat16"] < 2e-2, honest
    assert "bfloat16" not in load_backend(REF).capabilities.dtypes  # the adapter's choice


def _decode_errors() -> dict[str, float]:
    """The largest error of their decode kernel against float32 attention, per dtype."""
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "third_party_triton"))
    their_kernels = importlib.import_module("their_kernels")

    errors = {}
    for dtype in (torch.float16, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        k, v = (torch.randn(4, 16, 1, 32, generator=gen).to(dtype) for _ in range(2))
        q = torch.randn(1, 2, 32, generator=gen).to(dtype)
        out = torch.empty_like(q)
        table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
        their_kernels.paged_decode(out, q, k, v, table, torch.tensor([50], dtype=torch.int32), 0.2)
        keys = k[table[0].long()].reshape(-1, 32)[:50].float()
        values = v[table[0].long()].reshape(-1, 32)[:50].float()
        weights = (q[0].float() @ keys.T * 0.2).softmax(-1)
        errors[str(dtype).removeprefix("torch.")] = float(
            (out[0].float() - weights @ values).abs().max()
        )
    return errors


@pytest.mark.skipif(not INTERPRETED, reason="the bounds check needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("seed", [1, 2])
def test_check_bounds_judges_the_whole_run_not_its_first_example(seed: int) -> None:
    """Hypothesis discards examples the adapter's limits rule out (its first, at these seeds):
    "nothing was checked" is decided over the run, so the run checks and passes."""
    from conformance.run.control import RunControl

    result = run_suite(
        load_backend(REF),
        REF,
        run_seed=seed,
        database=None,
        max_examples=3,
        passes=("short",),
        control=RunControl(check_bounds="default", shrink=False),
    )
    assert result.passed, result.difference
    assert result.bounds is not None and result.bounds.launches > 0
