"""The envelope follows the backend: declared sets drawn exactly, setup errors, batch limits."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.cli import main
from conformance.errors import SetupError
from conformance.lockstep.configs import configs
from conformance.lockstep.driver import Lockstep
from conformance.lockstep.envelope import CPU, DEVICE
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.lockstep.plan import plan_for
from conformance.lockstep.workload import WorkloadConfig
from conformance.reports.report import json_report, text_report, write_junit
from conformance.run.control import RunControl
from conformance.run.runner import run_suite
from spec.attention import AttentionVariant
from spec.batch import BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry

DECODE_ONLY = Path(__file__).parent / "decode_only_backend" / "decode_backend.py"


def test_open_capabilities_draw_the_envelope_and_declared_sets_are_drawn_exactly() -> None:
    plan = plan_for(Capabilities("any"))
    assert plan.head_dims == CPU.head_dims and 128 in plan.head_dims and 96 in plan.head_dims
    assert plan.block_sizes == CPU.block_sizes and 48 in plan.block_sizes
    assert {3, 5, 7} <= set(plan.gqa_ratios) and not plan.notes
    caps = Capabilities("x", head_dims={64, 128}, block_sizes={16, 32}, gqa_ratios={4})
    plan = plan_for(caps)
    assert (plan.head_dims, plan.block_sizes, plan.gqa_ratios) == ((64, 128), (16, 32), (4,))
    assert "head dims: drawn exactly as declared: 64, 128" in plan.notes
    assert any(s.startswith("block sizes 4, 1, 3, 8, 48, 64 of the envelope") for s in plan.skipped)


def test_a_large_declared_set_is_a_range_intersected_with_the_envelope() -> None:
    plan = plan_for(Capabilities("x", head_dims=frozenset(range(1, 129))))
    assert plan.head_dims == (8, 16, 32, 64, 128, 80, 96, 112)
    assert "head dims 256 of the envelope: not declared by the backend" in plan.skipped


@pytest.mark.parametrize(
    ("caps", "message"),
    [
        (Capabilities("x", head_dims=frozenset()), "declared head dims are an empty set"),
        (Capabilities("x", gqa_ratios={3, 5}, max_gqa_ratio=2), "do not intersect"),
        (
            Capabilities("x", excludes=lambda g, h, v: "never"),
            "capabilities.excludes vetoes every shape",
        ),
    ],
)
def test_a_capability_set_that_leaves_nothing_is_a_setup_error(
    caps: Capabilities, message: str
) -> None:
    with pytest.raises(SetupError, match=message):
        plan_for(caps)


def _no_fp32_at_128(g: KVGeometry, heads: int, variant: AttentionVariant | None) -> str | None:
    return (
        "head dim 128 only in half precision"
        if g.head_dim == 128 and g.dtype == "float32"
        else None
    )


EXCLUDING = Capabilities("x", head_dims={64, 128}, excludes=_no_fp32_at_128)


@settings(max_examples=25)
@given(st.data())
def test_excluded_combinations_are_never_drawn_and_are_listed(data: st.DataObject) -> None:
    plan = plan_for(EXCLUDING)
    config = data.draw(configs(plan))
    assert not (config.geometry.head_dim == 128 and config.dtype == "float32")
    skipped = [s for s in plan.skipped if s.startswith("excluded by the backend")]
    assert skipped and "head dim 128 only in half precision" in skipped[0]


def test_the_device_envelope_draws_production_shapes_for_a_device_backend() -> None:
    """A backend on "cuda:0" (here computing on the CPU) gets the device envelope's plan."""

    class OnDevice(NumpyPagedBackend):
        @property
        def capabilities(self) -> Capabilities:
            return Capabilities(name="fake-gpu", device="cuda:0")

    plan = plan_for(OnDevice().capabilities)
    assert plan.envelope is DEVICE and plan.kv_heads == DEVICE.kv_heads == tuple(range(1, 9))
    production = [p for p in plan.passes() if p.kind == "production"]
    assert production[0].shape is not None
    assert production[0].shape.describe() == "head dim 128, 32/8 heads, block size 16"
    assert production[0].widths == (64,) and plan.passes()[1].widths == (64, 128, 256)
    assert DEVICE.long_prompts[1] >= 16384 and plan_for(Capabilities("cpu")).envelope is CPU
    if not torch.cuda.is_available():  # the reference runs on the backend's device: none here
        with pytest.raises(SetupError, match="cuda:0"):
            run_suite(OnDevice(), "fake-gpu", run_seed=1, database=None, max_examples=1)
    result = run_suite(
        NumpyPagedBackend(), "cpu", run_seed=1, database=None, max_examples=1, shrink=False,
        passes=("production",), control=RunControl(envelope="device"),
    )  # fmt: skip
    assert result.passed, text_report(result)
    assert result.envelope == "device" and result.stats.coverage.widest_step >= 64
    assert 128 in result.stats.coverage.head_dims


class _Strict(NumpyPagedBackend):
    """Declares limits and checks every call against them: a refused batch fails loudly."""

    def __init__(self, **limits: object) -> None:
        super().__init__()
        self._caps = Capabilities("strict", **limits)  # type: ignore[arg-type]
        self.calls: list[tuple[int, ...]] = []

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def attention(  # type: ignore[no-untyped-def]
        self, layer, query, batch: BatchMetadata, scale, **variant
    ):
        why = self._caps.batch_unsupported(batch)
        assert why is None, f"handed a batch the capabilities refuse: {why}"
        self.calls.append(tuple(batch.query_len(i) for i in range(batch.num_seqs)))
        return super().attention(layer, query, batch, scale, **variant)


@pytest.mark.parametrize(
    "limits",
    [
        {"mixed_batches": False, "max_num_seqs": 3},
        {"chunked_prefill": False, "decode": False},
        {"max_query_len": 4, "max_context_len": 40},
    ],
    ids=["unmixed, 3 at most", "no chunks, no decodes", "short queries and contexts"],
)
def test_steps_respect_the_batch_capabilities_and_report_what_was_skipped(
    limits: dict[str, object],
) -> None:
    backend = _Strict(**limits)
    result = run_suite(
        backend, "strict", run_seed=3, database=None, max_examples=6, shrink=False,
        passes=("short", "wide"),
    )  # fmt: skip
    assert result.passed, text_report(result)
    assert backend.calls, "attention was never called"
    text = text_report(result)
    for why in (*result.skipped, *result.stats.skips):
        assert why in text
    if limits.get("max_num_seqs"):
        assert max(len(call) for call in backend.calls) <= 3
        assert any("max_num_seqs" in s for s in result.skipped)
    if not limits.get("decode", True):
        assert any(s.startswith("decode attention not run") for s in result.stats.skips)


def test_the_decode_only_example_conforms_with_prefill_skipped_in_every_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = f"{DECODE_ONLY}:make_backend"
    junit, report = tmp_path / "c.xml", tmp_path / "c.json"
    args = ["run", "--backend", ref, "--seed", "4", "--no-database", "--max-examples", "8"]
    assert main([*args, "--junit", str(junit), "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "max_query_len is 1 (decode-only)" in out
    assert "prefill chunk attention not run: a query of N tokens (max_query_len 1)" in out
    skipped = json.loads(report.read_text())["skipped"]
    assert any("decode-only" in s for s in skipped) and any("times)" in s for s in skipped)
    cases = ElementTree.parse(junit).getroot().findall("testcase")
    assert {c.get("name") for c in cases} >= set(skipped)


def test_an_empty_intersection_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = tmp_path / "picky.py"
    backend.write_text(
        "from conformance.lockstep.numpy_backend import NumpyPagedBackend\n"
        "from spec.backend import Capabilities\n"
        "class Picky(NumpyPagedBackend):\n"
        "    @property\n"
        "    def capabilities(self):\n"
        "        return Capabilities('picky', gqa_ratios={6}, max_gqa_ratio=4)\n"
    )
    assert main(["run", "--backend", f"{backend}:Picky", "--no-database"]) == 2
    assert "the ratios [6] and capabilities.max_gqa_ratio 4 do not intersect" in (
        capsys.readouterr().err
    )


def test_reports_carry_the_envelope_passes_and_coverage(tmp_path: Path) -> None:
    result = run_suite(
        NumpyPagedBackend(), "numpy", run_seed=2, database=None, max_examples=4, shrink=False
    )
    assert result.passed, text_report(result)
    text = text_report(result)
    assert "envelope: cpu; passes (examples asked): short 4, wide 1, long 1, large pool 1" in text
    assert "largest KV element offset" in text and "(past 2^31: yes)" in text
    data = json_report(result)
    assert data["coverage"]["past_int32"] and data["coverage"]["widest_step"] >= 16
    assert [p["pass"] for p in data["passes"]][:4] == ["short", "wide", "long", "large pool"]
    write_junit(result, tmp_path / "j.xml")
    assert ElementTree.parse(tmp_path / "j.xml").getroot().get("tests") == str(
        1 + len(data["skipped"])
    )


def test_a_large_pool_lockstep_needs_read_blocks() -> None:
    class NoReadBlocks(NumpyPagedBackend):
        read_blocks = None  # type: ignore[assignment]

    config = WorkloadConfig(KVGeometry(1, 4, 4, 1, 8), 1, 0.3, 1, block_base=2**26)
    with pytest.raises(ValueError, match="read_blocks"):
        Lockstep(NoReadBlocks(), config)
    result = run_suite(
        NoReadBlocks(),
        "n",
        run_seed=1,
        database=None,
        max_examples=1,
        passes=("short", "large pool"),
    )
    assert any(s.startswith("large pool pass (KV offsets past 2^31") for s in result.skipped)
    with pytest.raises(SetupError, match=r"in any pass.*large pool pass .*no read_blocks"):
        run_suite(  # no pass left that can draw: a setup error, naming why
            NoReadBlocks(), "n", run_seed=1, database=None, max_examples=1, passes=("large pool",)
        )
