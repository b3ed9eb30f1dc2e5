"""What the honest interpreter emulates is what compiled Triton emits, on every Triton a user has.

Each emulation of :mod:`conformance.interpreter.arithmetic` assumes an
instruction of compiled Triton for sm_90. This test reads them in the PTX
``triton.compile`` emits (no GPU needed), under the pinned Triton and under
Triton 3.6 (what torch 2.11's CUDA builds bring; its wheel is fetched from
PyPI once and cached), and checks that the interpreter, under the same
Triton, computes what the instruction computes: a ``div.full.f32`` the
reciprocal's way, a ``div.rn.f32`` exactly, a TF32 ``mma`` on truncated
operands. It also reads the project's own kernels: the fp8 KV write divides
with ``div.rn.f32`` (``tl.math.div_rn``: Triton 3.6 compiles
``tl.fdiv(ieee_rounding=True)`` to the approximate ``div.full.f32``), and
float32 attention never multiplies in TF32.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
OLDER_TRITON = "3.6.0"
CACHE = Path(os.environ.get("PAGED_SPEC_CACHE", Path.home() / ".cache" / "paged-spec"))

_KERNELS = textwrap.dedent(
    """
    import json, os, re, sys
    import triton, triton.language as tl

    @triton.jit
    def plain_div(x_ptr, s, o_ptr):
        r = tl.arange(0, 16); tl.store(o_ptr + r, tl.load(x_ptr + r) / s)
    @triton.jit
    def fdiv_ieee(x_ptr, s, o_ptr):
        r = tl.arange(0, 16); x = tl.load(x_ptr + r)
        tl.store(o_ptr + r, tl.fdiv(x, s, ieee_rounding=True))
    @triton.jit
    def div_rn(x_ptr, s, o_ptr):
        r = tl.arange(0, 16); tl.store(o_ptr + r, tl.math.div_rn(tl.load(x_ptr + r), s))
    @triton.jit
    def exp2(x_ptr, s, o_ptr):
        r = tl.arange(0, 16); tl.store(o_ptr + r, tl.exp2(tl.load(x_ptr + r)))
    @triton.jit
    def exp(x_ptr, s, o_ptr):
        r = tl.arange(0, 16); tl.store(o_ptr + r, tl.exp(tl.load(x_ptr + r)))
    @triton.jit
    def sqrt(x_ptr, s, o_ptr):
        r = tl.arange(0, 16); tl.store(o_ptr + r, tl.sqrt(tl.load(x_ptr + r)))
    @triton.jit
    def dot(a_ptr, b_ptr, o_ptr, IEEE: tl.constexpr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
        c = tl.dot(a, b, input_precision="ieee") if IEEE else tl.dot(a, b)
        tl.store(o_ptr + r[:, None] * 16 + r[None, :], c)

    SCALAR = {"x_ptr": "*fp32", "s": "fp32", "o_ptr": "*fp32"}
    DOT = {"a_ptr": "*fp32", "b_ptr": "*fp32", "o_ptr": "*fp32", "IEEE": "constexpr"}
    """
)

_COMPILE = _KERNELS + textwrap.dedent(
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sys.path.insert(0, "tests/third_party_triton")
    import backend_gpu
    from backend_gpu.kernels import attention, kv_write
    import their_kernels

    OPS = re.compile(r"\\s*((?:div|ex2|sqrt|mma|wgmma)\\.[\\w.]+)")

    def ops(fn, sig, consts, **options):
        target = GPUTarget("cuda", 90, 32)
        ptx = triton.compile(ASTSource(fn, sig, consts), target=target, options=options)
        return sorted({m.group(1) for m in map(OPS.match, ptx.asm["ptx"].splitlines()) if m})

    def sig_of(fn, known, consts):
        return {p.name: "constexpr" if p.is_constexpr else known.get(p.name, "i32")
                for p in fn.params}

    out = {name: ops(fn, SCALAR, {}) for name, fn in
           [("plain_div", plain_div), ("fdiv_ieee", fdiv_ieee), ("div_rn", div_rn),
            ("exp2", exp2), ("exp", exp), ("sqrt", sqrt)]}
    out["dot"] = ops(dot, DOT, {"IEEE": False})
    out["dot_ieee"] = ops(dot, DOT, {"IEEE": True})
    out["dot_default_option_ieee"] = ops(dot, DOT, {"IEEE": False},
                                         default_dot_input_precision="ieee")
    fp8 = dict(FP8_MANT=3, FP8_MIN_EXP=-6, FP8_MAX=448.0)
    write = {"key_ptr": "*fp32", "value_ptr": "*fp32", "k_cache_ptr": "*u8",
             "v_cache_ptr": "*u8", "slot_ptr": "*i64", "k_scale": "fp32", "v_scale": "fp32"}
    consts = dict(NUM_KV_HEADS=2, HEAD_DIM=64, ROW_PAD=128, BLOCK_T=8, **fp8)
    out["kv_write_fp8"] = ops(kv_write._kv_write_kernel,
                              sig_of(kv_write._kv_write_kernel, write, consts), consts)
    f32 = {n: "*fp32" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "lse_ptr", "sinks_ptr",
                                "alibi_ptr")}
    f32.update({n: "*i32" for n in ("query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr")})
    f32.update({n: "fp32" for n in ("score_mul", "cap_log2", "v_scale")})
    consts = dict(GROUP=4, GROUP_PAD=4, HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16, BLOCK_Q=4,
                  BLOCK_M=16, BLOCK_N=64, SPLIT=False, UPCAST=True, IEEE=True, USE_SOFTCAP=False,
                  USE_ALIBI=False, USE_WINDOW=False, USE_SINKS=False, FP8_MANT=0, FP8_MIN_EXP=0)
    out["attention_fp32"] = ops(attention._attention_kernel,
                                sig_of(attention._attention_kernel, f32, consts), consts,
                                num_warps=4, num_stages=2)
    theirs = {n: "*fp32" for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    theirs.update({"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "sm_scale": "fp32"})
    for ieee in (True, False):
        consts = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=64, HEAD_PAD=64, LOG2_PAGE=4, TILE=64,
                      IEEE=ieee)
        fn = their_kernels._paged_decode_kernel
        out[f"their_decode_fp32_ieee_{ieee}"] = ops(fn, sig_of(fn, theirs, consts), consts)
    print(json.dumps({"version": triton.__version__, "ops": out}))
    """
)

_INTERPRET = _KERNELS + textwrap.dedent(
    """
    import torch
    from conformance.interpreter import install
    install()
    x = torch.full((16,), 0.044189453125)
    out = {}
    for name, fn in [("plain_div", plain_div), ("fdiv_ieee", fdiv_ieee), ("div_rn", div_rn)]:
        o = torch.zeros(16)
        fn[(1,)](x, 0.0589192733168602, o)
        out[name] = o[0].item()
    a, b = torch.full((16, 16), 1.0 + 2.0 ** -12), torch.eye(16)
    for ieee in (False, True):
        o = torch.zeros(16, 16)
        dot[(1,)](a, b, o, IEEE=ieee)
        out["dot_ieee" if ieee else "dot"] = o[0, 0].item()
    tiny = torch.full((16,), -130.0)
    o = torch.zeros(16)
    exp2[(1,)](tiny, 0.0, o)
    out["exp2_subnormal"] = o[0].item()
    print(json.dumps({"version": triton.__version__, "values": out}))
    """
)

RECIPROCAL, EXACT = 0.75, 0.7499999403953552  # 0.044189453125 / 0.0589192733168602 in float32
TF32_ONE, IEEE_ONE = 1.0, 1.0 + 2.0**-12  # (1 + 2^-12) @ I with TF32 and with full operands


def _older_triton() -> Path:
    """Triton 3.6's package, unpacked under the cache (fetched from PyPI once)."""
    target = CACHE / f"triton-{OLDER_TRITON}"
    if (target / "triton" / "__init__.py").exists():
        return target
    wheels = CACHE / f"wheels.{os.getpid()}"  # one per process: pytest workers race here
    wheels.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", f"triton=={OLDER_TRITON}", "--no-deps",
         "--only-binary", ":all:", "-d", str(wheels), "-q"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if got.returncode != 0:
        why = f"could not fetch triton=={OLDER_TRITON} from PyPI:\n{got.stderr[-2000:]}"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI reaches PyPI: a failure here is a failure
        pytest.skip(f"{why}\n(an offline machine: run this test where PyPI is reachable)")
    wheel = next(wheels.glob(f"triton-{OLDER_TRITON}-*.whl"))
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            z.extract(info, partial)
            mode = (info.external_attr >> 16) & 0o777
            if mode:  # ptxas and friends keep their execute bits
                (partial / info.filename).chmod(mode)
    try:
        partial.rename(target)
    except OSError:  # another worker unpacked it first
        shutil.rmtree(partial)
    shutil.rmtree(wheels)
    return target


def _probe(script: str, interpret: bool, triton_path: Path | None, where: Path) -> dict[str, Any]:
    """Run ``script`` (from a file: ``@triton.jit`` reads its source) under one Triton."""
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"}
    paths = ([str(triton_path)] if triton_path else []) + [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    file = where / ("interpret.py" if interpret else "compile.py")
    file.write_text(script)
    result = subprocess.run(
        [sys.executable, str(file)], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    if result.returncode != 0:
        pytest.fail(f"the probe failed:\n{result.stderr[-4000:]}")
    found: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


@pytest.fixture(scope="module", params=["pinned", OLDER_TRITON])
def triton_under_test(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The PTX facts and the interpreted values, under one Triton."""
    path = None if request.param == "pinned" else _older_triton()
    where = tmp_path_factory.mktemp(f"ptx-{request.param}")
    compiled = _probe(_COMPILE, False, path, where)
    interpreted = _probe(_INTERPRET, True, path, where)
    assert compiled["version"] == interpreted["version"]
    if path is not None:
        assert compiled["version"] == OLDER_TRITON
    return compiled, interpreted


def test_each_division_is_emulated_as_it_compiles(
    triton_under_test: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    compiled, interpreted = triton_under_test
    ops, values = compiled["ops"], interpreted["values"]
    assert ops["plain_div"] == ["div.full.f32"]
    assert ops["div_rn"] == ["div.rn.f32"]
    for name in ("plain_div", "fdiv_ieee", "div_rn"):
        (instruction,) = ops[name]
        want = {"div.full.f32": RECIPROCAL, "div.rn.f32": EXACT}[instruction]
        assert values[name] == want, (compiled["version"], name, instruction)


def test_ieee_fdiv_is_exact_only_on_the_newer_triton(
    triton_under_test: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """The version difference the fp8 KV write must not depend on."""
    compiled, _ = triton_under_test
    expected = "div.full.f32" if compiled["version"] == OLDER_TRITON else "div.rn.f32"
    assert compiled["ops"]["fdiv_ieee"] == [expected]


def test_math_and_dots_compile_to_what_the_interpreter_assumes(
    triton_under_test: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    compiled, interpreted = triton_under_test
    ops, values = compiled["ops"], interpreted["values"]
    assert ops["exp2"] == ["ex2.approx.ftz.f32"] and values["exp2_subnormal"] == 0.0
    assert ops["exp"] == ["ex2.approx.f32"]
    assert ops["sqrt"] == ["sqrt.approx.ftz.f32"]
    tf32 = [op for op in ops["dot"] if op.startswith("mma") and ".tf32.tf32." in op]
    assert tf32 and values["dot"] == TF32_ONE
    assert not any("mma" in op for op in ops["dot_ieee"]) and values["dot_ieee"] == IEEE_ONE
    assert ops["dot_default_option_ieee"] == ops["dot"], "the launch option changes no dot"


def test_the_projects_kernels_divide_exactly_and_never_multiply_in_tf32(
    triton_under_test: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    ops = triton_under_test[0]["ops"]
    assert "div.rn.f32" in ops["kv_write_fp8"] and "div.full.f32" not in ops["kv_write_fp8"]
    assert not any(".tf32" in op for op in ops["attention_fp32"])
    assert not any(".tf32" in op for op in ops["their_decode_fp32_ieee_True"])
    assert any(".tf32.tf32." in op for op in ops["their_decode_fp32_ieee_False"])
