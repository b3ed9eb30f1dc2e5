"""The kernel paths a report counts are the ones the backend was seen to run.

The Triton backend's launches are recorded through the method Triton launches
every kernel with (:mod:`conformance.observe.launches`) and read per kernel
(:mod:`conformance.observe.paths`); a backend without launches to read names
its path with ``attention_path()``; where neither says, the report calls its
counts the suite's plan. A declared split plan the kernel contradicts is a
setup error naming both; an ``attention_path()`` that raises or returns a
non-string is the backend's failure. The constructed passes reach the H200
plan's paths: a decode split in two or more parts in every feature pass, one
in nine or more in the split pass, and DeepSeek-V3's 128 query heads over
512 + 64 rows, whose every head tile the latent kernel runs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from devices import DEVICE

import backend_gpu  # noqa: F401  (TRITON_INTERPRET on a CPU-only machine, before triton)
from backend_gpu.kernels.attention import paged_attention
from backend_gpu.triton_backend import TritonBackend
from conformance.errors import SetupError
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.lockstep.workload import WorkloadConfig
from conformance.observe.launches import Launch, recording
from conformance.observe.paths import observe
from conformance.planted.backends import SinksWrongOnSplitKV
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from spec.capabilities import Capabilities, DecodeSplit
from spec.kv_geometry import KVGeometry


def _decode(keys: int, kv_heads: int = 1) -> list[Launch]:
    """The launches of one interpreted decode over ``keys`` keys (block size 16, head dim 16)."""
    blocks = -(-keys // 16)
    k = torch.randn(blocks + 1, 16, kv_heads, 16, device=DEVICE)
    q = torch.randn(1, kv_heads, 16, device=DEVICE)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([keys], dtype=torch.int32, device=DEVICE)
    table = torch.arange(blocks, dtype=torch.int32, device=DEVICE)[None]
    with recording() as launches:
        paged_attention(q, k, k.clone(), qsl, lens, table, 0.25)
    return launches


def test_a_launch_is_recorded_with_its_grid_and_constexprs_and_read() -> None:
    short, long = _decode(300), _decode(1100)
    assert [x.kernel for x in short] == ["_attention_kernel"]
    assert short[0].grid == (1, 1, 1) and short[0].arg("SPLIT") is False
    assert observe(short).parts == 1
    # the H200's plan splits from 1,024 keys: 1,100 keys in ceil(1100 / 512) = 3 parts, merged
    assert [x.kernel for x in long] == ["_attention_kernel", "_merge_kernel"]
    assert long[0].grid[2] == 3 and long[0].arg("SPLIT") is True
    assert observe(long).parts == 3 and observe(long).unread == ()
    with recording() as outside:
        pass
    assert outside == []  # nothing outside a block, and nothing from the blocks before


def test_nested_recordings_each_see_the_launch_once() -> None:
    with recording() as outer, recording() as inner:
        _decode(40)
    assert len(inner) == len(outer) == 1  # every open block sees every launch, once


@pytest.fixture(scope="module")
def features() -> RunResult:
    return run_suite(TritonBackend(), "triton", run_seed=1, database=None, passes=("feature",))


@pytest.mark.heavy
def test_every_feature_pass_splits_a_decode_as_the_kernel_really_does(features: RunResult) -> None:
    assert features.passed, features.difference and features.difference.describe()
    paths = features.stats.coverage.paths
    assert paths.known_by["plan"] == 0 and paths.known_by["launches"] > 0  # every call observed
    for feature in ("alibi", "sinks", "softcap", "window", "fp8_e4m3", "fp8_e5m2", "latent"):
        assert paths.pairs[(feature, "split-KV decode")] > 0, feature
        assert paths.parts[feature][1] >= 2, feature
    for variant in ("alibi", "sinks", "softcap", "window"):  # the latent merge, with each
        assert paths.pairs[(f"latent+{variant}", "split-KV decode")] > 0, variant
    # the report's split counts are the launches that split (one attention launch a call): the
    # decodes, and the short chunks after a long context that the H200's plan splits too
    observed = paths.splits["_attention_kernel"] + paths.splits["_latent_kernel"]
    assert sum(paths.split_calls.values()) == observed == paths.launches["_merge_kernel"] > 0
    assert paths.split_calls["split-KV decode"] == paths.calls["split-KV decode"] > 0
    text = "\n".join(features.stats.coverage.describe())
    assert "read from its kernel launches" in text and "the suite's plan" not in text


@pytest.mark.heavy
def test_the_split_pass_splits_one_decode_into_more_than_eight_parts() -> None:
    result = run_suite(TritonBackend(), "triton", run_seed=1, database=None, passes=("split",))
    assert result.passed, result.difference and result.difference.describe()
    paths = result.stats.coverage.paths
    assert paths.kernel_parts["_attention_kernel"][1] >= 9
    assert result.stats.longest >= 4097


@pytest.mark.heavy
def test_deepseek_v3s_shape_runs_every_head_tile_on_the_cpu() -> None:
    result = run_suite(TritonBackend(), "triton", run_seed=1, database=None, passes=("production",))
    assert result.passed, result.difference and result.difference.describe()
    cov = result.stats.coverage
    assert (512, 64) in cov.latent_layouts and 128 in cov.latent_heads
    assert cov.paths.head_tiles["_latent_kernel"][1] == 8  # 128 heads, 16 a program
    assert any("512+64" in line and "128" in line for line in cov.describe())


def test_a_backend_that_names_its_path_is_observed_through_attention_path() -> None:
    result = run_suite(
        SinksWrongOnSplitKV(), "x", run_seed=5, database=None, passes=("short",), max_examples=8
    )
    paths = result.stats.coverage.paths
    assert paths.known_by["attention_path"] > 0 and paths.known_by["plan"] == 0


class _SaysItSplitsEarly(NumpyPagedBackend):
    """Declares a split from 4 keys, but (a numpy kernel) never splits, and says so."""

    @property
    def capabilities(self) -> Capabilities:
        return replace(super().capabilities, decode_split=DecodeSplit(4, 2, 4))

    def attention_path(self) -> str:
        return "single-pass decode"


def test_a_declared_split_plan_the_kernel_contradicts_is_a_setup_error_naming_both() -> None:
    with pytest.raises(SetupError, match=r"splits a decode from 4 keys.*single pass"):
        run_suite(_SaysItSplitsEarly(), "x", run_seed=5, database=None, passes=("feature",))


class _PathRaises(NumpyPagedBackend):
    def attention_path(self) -> str:
        raise RuntimeError("no path today")


class _PathNotAString(NumpyPagedBackend):
    def attention_path(self) -> int:
        return 3


@pytest.mark.parametrize(
    ("backend", "said"),
    [(_PathRaises(), "no path today"), (_PathNotAString(), "attention_path() returned 3 (int)")],
)
def test_an_attention_path_that_raises_or_is_not_a_string_is_the_backends_failure(
    backend: NumpyPagedBackend, said: str
) -> None:
    config = WorkloadConfig(KVGeometry(1, 8, 4, 1, 8), 2, 0.3, 1)
    ls = Lockstep(backend, config)
    ls.add(0, [1, 2, 3])
    with pytest.raises(ConformanceFailure) as caught:
        ls.step([(0, [1, 2, 3])])
    assert said in caught.value.difference.describe()


class _NeverSplits(NumpyPagedBackend):
    """Declares no split plan and runs every decode in one pass, saying so."""

    def attention_path(self) -> str:
        return "single-pass decode"


def test_a_path_drawn_but_never_run_is_not_reached_and_says_what_ran_instead() -> None:
    result = run_suite(_NeverSplits(), "x", run_seed=5, database=None, passes=("feature",))
    assert result.passed, result.difference and result.difference.describe()
    paths = result.stats.coverage.paths
    pair = ("sinks", "split-KV decode")
    assert not paths.reached(pair) and paths.drawn[("sinks", *pair[1:], "single-pass decode")]
    assert "the kernel ran it as single-pass decode" in paths.why_not(pair)
    text = "\n".join(result.stats.coverage.describe())
    assert "not reached: sinks x split-KV decode (drawn so " in text
    assert "drawn as split-KV decode, run as single-pass decode: " in text
    assert "the suite's guess: capabilities.decode_split is not declared" in text
