"""Every tool's command line refuses a bad value with an argparse error (exit 2), never a traceback.

Each case runs the tool's ``main`` in process: argparse exits with status 2
and names the flag and the value before any work starts.
"""

from __future__ import annotations

import argparse
import doctest
from collections.abc import Callable, Sequence

import pytest

import paged_spec._cli
from paged_spec import capacity, engine_demo, simulate

Main = Callable[[Sequence[str] | None], int]
TOOLS: dict[str, Main] = {
    "capacity": capacity.main,
    "simulate": simulate.main,
    "engine_demo": engine_demo.main,
}
CASES = [
    ("capacity", ["--layers", "0"], "--layers"),
    ("capacity", ["--block-size", "0"], "--block-size"),
    ("capacity", ["--kv-heads", "-1"], "--kv-heads"),
    ("capacity", ["--head-dim", "x"], "--head-dim"),
    ("capacity", ["--context", "0"], "--context"),
    ("capacity", ["--utilization", "2"], "--utilization"),
    ("capacity", ["--utilization", "nan"], "--utilization"),
    ("capacity", ["--utilization", "0"], "--utilization"),
    ("capacity", ["--device-gb", "inf"], "--device-gb"),
    ("capacity", ["--device-gb", "-80"], "--device-gb"),
    ("capacity", ["--state-mib", "nan"], "--state-mib"),
    ("capacity", ["--pool-mib", "-1"], "--pool-mib"),
    ("capacity", ["--weights-gb", "-1"], "--weights-gb"),
    ("simulate", ["--block-size", "0"], "--block-size"),
    ("simulate", ["--num-requests", "0"], "--num-requests"),
    ("simulate", ["--rates", "fast"], "--rates"),
    ("simulate", ["--rates", "4,0"], "--rates"),
    ("simulate", ["--rates", "nan"], "--rates"),
    ("simulate", ["--kv-pool-gib", "nan"], "--kv-pool-gib"),
    ("simulate", ["--max-model-len", "1"], "--max-model-len"),
    ("simulate", ["--max-num-seqs", "0"], "--max-num-seqs"),
    ("simulate", ["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    ("simulate", ["--jobs", "0"], "--jobs"),
    ("engine_demo", ["--requests", "0"], "--requests"),
    ("engine_demo", ["--num-blocks", "0"], "--num-blocks"),
    ("engine_demo", ["--block-size", "0"], "--block-size"),
]


@pytest.mark.parametrize(("tool", "argv", "flag"), CASES, ids=[" ".join(c[1]) for c in CASES])
def test_bad_argument_is_an_argparse_error(
    tool: str, argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        TOOLS[tool](argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and argv[1] in err and "Traceback" not in err, err


def test_weights_that_do_not_fit_the_device_are_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert capacity.main(["--model", "hybrid-27b", "--device-gb", "50"]) == 2
    assert "less than the 54 GB of weights" in capsys.readouterr().err


def test_engine_demo_pool_too_small_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        engine_demo.main(["--backend", "reference", "--requests", "2", "--num-blocks", "1"])
    assert exc.value.code == 2
    assert "--num-blocks 1" in capsys.readouterr().err


def test_argument_types() -> None:
    assert doctest.testmod(paged_spec._cli).failed == 0
    for bad in ("1.5", "", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            paged_spec._cli.positive_int(bad)
    assert paged_spec._cli.fraction("1") == 1.0
    with pytest.raises(argparse.ArgumentTypeError):
        paged_spec._cli.positive_floats("1,,2")
