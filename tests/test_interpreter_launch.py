"""Launch options under the honest interpreter: accepted as compiled Triton accepts them.

A kernel in the wild is launched with ``num_warps=``, ``num_stages=``, ... The
interpreter ignores what sizes hardware (every program runs in turn on the
CPU), honours ``default_dot_input_precision``, refuses an option compiled
Triton does not know with compiled Triton's message, and says NOT JUDGED,
naming the option, for one whose effect it cannot reproduce.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the interpreter needs TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from conformance import load_backend, run_suite  # noqa: E402
from conformance.interpreter import honest_interpreter  # noqa: E402
from conformance.interpreter.launch import UNHONOURED, launch_options  # noqa: E402
from conformance.interpreter.limits import InterpreterLimit  # noqa: E402
from conformance.reports.report import verdict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

HONOURED: dict[str, Any] = {
    "num_warps": 8,
    "num_ctas": 1,
    "num_stages": 3,
    "maxnreg": 128,
    "enable_fp_fusion": False,
    "launch_pdl": True,
    "debug": False,
    "sanitize_overflow": False,
    "enable_reflect_ftz": True,
    "sched4reg": False,
    "ptx_options": None,
    "default_dot_input_precision": "ieee",  # read by no tl.dot, compiled or interpreted
}
"""A value for each option that changes no result here (some default to None or a flag)."""


@triton.jit  # type: ignore[untyped-decorator]
def _dot(a_ptr, b_ptr, out_ptr, N: tl.constexpr, WIDE: tl.int64):  # type: ignore[no-untyped-def]
    r = tl.arange(0, N)
    a = tl.load(a_ptr + r[:, None] * N + r[None, :])
    b = tl.load(b_ptr + r[:, None] * N + r[None, :])
    tl.store(out_ptr + r[:, None] * N + r[None, :] + WIDE * 0, tl.dot(a, b))


@pytest.fixture
def honest() -> Iterator[None]:
    with honest_interpreter():
        yield


def _run(**options: Any) -> torch.Tensor:
    a = torch.full((16, 16), 1.0 + 2.0**-12)  # below TF32's last bit: dropped by a TF32 dot
    b = torch.eye(16)
    out = torch.zeros(16, 16)
    _dot[(1,)](a, b, out, N=16, WIDE=1, **options)
    return out


def test_every_option_triton_knows_is_one_the_interpreter_sorts(honest: None) -> None:
    """The installed Triton's options are each honoured, honoured as a dot precision, or named
    as not honourable: none falls through unexamined."""
    sorted_out = set(HONOURED) | set(UNHONOURED)
    extra = {
        "warp_size",
        "ptx_version",
        "supported_fp8_dtypes",
        "deprecated_fp8_dot_operand_dtypes",
        "allowed_dot_input_precisions",
        "max_num_imprecise_acc_default",
        "extern_libs",
        "backend_name",
        "arch",
        "min_shared_mem",
        "fpsan_homomorphic_casts",
    }
    assert launch_options() <= sorted_out | extra, launch_options() - sorted_out - extra


@pytest.mark.parametrize("name", sorted(HONOURED))
def test_an_option_that_sizes_hardware_changes_nothing(honest: None, name: str) -> None:
    """With a ``tl.int64`` parameter too: launch options are not bound to the signature."""
    assert torch.equal(_run(**{name: HONOURED[name]}), _run())


def test_a_float32_dot_is_tf32_whatever_the_default_precision_option_says(honest: None) -> None:
    """As compiled: ``tl.dot`` settles its precision before the option is read (the PTX of
    this launch stays ``mma...tf32``, ``tests/test_interpreter_ptx.py``)."""
    for options in ({}, {"default_dot_input_precision": "ieee"}):
        assert float(_run(**options)[0, 0]) == 1.0  # 1 + 2^-12 truncated to TF32


def test_an_unknown_option_is_refused_as_compiled_triton_refuses_it(honest: None) -> None:
    with pytest.raises(KeyError, match="Keyword argument num_wraps was specified but unrecog"):
        _run(num_wraps=4)


@pytest.mark.parametrize("name", sorted(UNHONOURED))
def test_an_option_the_interpreter_cannot_honour_says_so(honest: None, name: str) -> None:
    value = "x.ttgir" if name == "ir_override" else "fpsan" if "mode" in name else True
    with pytest.raises(InterpreterLimit, match=f"the launch option {name}="):
        _run(**{name: value})


def test_the_suite_judges_a_kernel_launched_with_options_and_names_one_it_cannot_honour(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Their kernels launched with every hardware option: judged, and passing. Launched with a
    cooperative grid: NOT JUDGED, with the option named, never a backend failure."""
    monkeypatch.chdir(ROOT)
    their: Any = type(load_backend("tests/third_party_triton/adapter.py:make_backend"))
    run: dict[str, Any] = {"run_seed": 3, "database": None, "max_examples": 3, "passes": ("short",)}
    tuned = their(launch=HONOURED)
    result = run_suite(tuned, "their kernels, every launch option", **run)
    assert result.passed, result.difference
    assert result.stats.steps > 0
    cooperative = their(launch={"launch_cooperative_grid": True})
    result = run_suite(cooperative, "their kernels, a cooperative grid", shrink=False, **run)
    named = "NOT JUDGED: interpreter limit: the launch option launch_cooperative_grid=True"
    assert verdict(result).startswith(named), verdict(result)
