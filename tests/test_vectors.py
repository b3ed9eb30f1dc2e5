"""Test vectors: exported by the quick profile, they validate, replay and catch the planted bugs."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from vectors_fixtures import EXAMPLES, SEED, Exported, exported, manifests

from conformance.cli import main
from conformance.errors import SetupError
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.planted.backends import PLANTED
from conformance.run.discovery import load_backend
from conformance.run.runner import run_suite
from conformance.vectors.check import check_vectors
from conformance.vectors.export import export_vectors
from conformance.vectors.format import VectorError, load_array, save_array
from spec.backend import ReferenceBackend
from spec.capabilities import Capabilities

__all__ = ["exported"]  # the session fixture, imported for pytest

SCHEMA = (
    Path(__file__).resolve().parent.parent
    / "conformance"
    / "vectors"
    / "schema"
    / "vectors.schema.json"
)


def test_the_export_covers_every_pass(exported: Exported) -> None:
    names = {name.split(" (")[0] for name, _ in exported.passes}
    assert names == {"short", "wide", "long", "large pool", "production", "feature", "groups"}
    assert exported.examples >= len(exported.passes)
    assert exported.printed.startswith(f"exported {exported.examples} vectors (")
    assert f"vectors check {exported.out} --backend NAME" in exported.printed


def test_vectors_and_the_live_suite_judge_the_same_outputs(exported: Exported) -> None:
    """The vectors hold the live run's calls: the same steps, outputs and examples judged."""
    live = run_suite(
        ReferenceBackend(), "reference", run_seed=SEED, max_examples=EXAMPLES, database=None
    )
    replayed = check_vectors(ReferenceBackend(), "reference", exported.out)
    for check in (
        "attention outputs judged against the same-precision reference",
        "examples judged for mean error and bias (in ulps)",
    ):
        assert replayed.stats.checks[check] == live.stats.checks[check] > 0
    assert replayed.stats.steps == live.stats.steps
    # the widest steps and the largest offset (shapes differ: an example that ran no
    # attention has no GQA ratio in its vector)
    # (the KV cache groups line counts the spec memory's releases: a replay has no memory)
    # (kernel paths and their pairs with features are the live run's, not a replay's)
    live_lines = [x for x in live.stats.coverage.describe() if not x.startswith("KV cache groups")]
    pairs = next(i for i, x in enumerate(live_lines) if x.startswith("kernel paths of "))
    assert replayed.stats.coverage.describe()[3:] == live_lines[3:pairs]


def test_the_schema_validates_every_exported_manifest(exported: Exported) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for path in manifests(exported.out):
        errors = list(validator.iter_errors(json.loads(path.read_text())))
        assert not errors, f"{path}: {errors[0].message} at {list(errors[0].path)}"


def test_the_schema_rejects_a_manifest_that_breaks_it(exported: Exported) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    manifest = json.loads(manifests(exported.out)[0].read_text())
    manifest["operations"][1]["layer"] = -1
    assert list(validator.iter_errors(manifest))


def test_every_array_is_the_documented_npy_subset(exported: Exported) -> None:
    for path in sorted(exported.out.glob("*/arrays/*.npy")):
        ours = load_array(path)
        assert ours.dtype in (np.float32, np.float64)
        np.testing.assert_array_equal(ours, np.load(path, allow_pickle=False))


@pytest.mark.parametrize("backend", ["reference", "numpy"])
def test_correct_cpu_backends_pass(exported: Exported, backend: str) -> None:
    made = (
        ReferenceBackend() if backend == "reference" else NumpyPagedBackend(latent=None)
    )  # every layout
    result = check_vectors(made, backend, exported.out)
    assert result.passed, result.difference and result.difference.describe()
    assert result.stats.examples == exported.examples and not result.skipped
    assert result.stats.checks["K and V slots compared exactly"] > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_and_triton_pass(exported: Exported, backend: str) -> None:
    pytest.importorskip(backend)
    assert main(["vectors", "check", str(exported.out), "--backend", backend]) == 0


MEMORY_SIDE = sorted(
    label for label, cls in PLANTED.items() if hasattr(cls, "planted_block_manager")
)
"""Planted bugs in the lockstep's block manager, not the backend: vectors hold the backend's
calls only (the tables and slots already decided), so no replay of them can see such a bug."""


POISON_ONLY = sorted(label for label, cls in PLANTED.items() if cls.__name__ == "MasksByZeroWeight")
"""Bugs only non-finite memory shows: vectors hold finite values, so 0 x V is 0 in a replay."""


def test_only_the_planted_block_managers_and_poison_are_left_to_the_live_suite() -> None:
    names = {PLANTED[label].__name__ for label in MEMORY_SIDE}
    assert names == {"LookaheadOneToken", "DraftBlocksHashed"}
    assert len(POISON_ONLY) == 1


def test_a_poison_only_bug_passes_the_vectors_and_fails_the_live_suite(exported: Exported) -> None:
    """Why it is left out: the vectors cannot show it, and the live suite does."""
    (label,) = POISON_ONLY
    assert check_vectors(PLANTED[label](), label, exported.out).passed
    live = run_suite(PLANTED[label](), label, run_seed=SEED, database=None, shrink=False)
    assert not live.passed


@pytest.mark.parametrize("label", sorted(set(PLANTED) - set(MEMORY_SIDE) - set(POISON_ONLY)))
def test_every_planted_bug_fails(exported: Exported, label: str) -> None:
    result = check_vectors(PLANTED[label](), label, exported.out)
    assert result.difference is not None, f"vectors missed: {label}"
    assert "vector " in result.difference.detail and "operation " in result.difference.detail


def test_a_failure_reports_like_run(
    exported: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    ref = "conformance.planted.backends:SlotOffByOne"
    argv = ["vectors", "check", str(exported.out), "--backend", ref]
    assert main([*argv, "--report", str(report), "--junit", str(junit)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "FIRST DIFFERENCE" in out and "vector 0000, operation" in out
    assert f"reproduce the run: python -m conformance vectors check {exported.out}" in out
    data = json.loads(report.read_text())
    assert data["passed"] is False and data["failure"]["difference"]["what"] in ("K", "V")
    assert "<failure" in junit.read_text()


def test_the_replay_script_raises_at_the_same_difference(exported: Exported) -> None:
    result = check_vectors(PLANTED["wrong scale"](), "x", exported.out)
    assert result.difference is not None
    script = "\n".join(result.workload)
    with pytest.raises(AssertionError) as caught:
        exec(script, {"backend": PLANTED["wrong scale"]()})
    assert str(caught.value) == result.difference.describe()


class _Float32Only(NumpyPagedBackend):
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities("float32 only", dtypes=frozenset({"float32"}))


def test_vectors_a_backend_cannot_run_are_skipped_and_listed(exported: Exported) -> None:
    result = check_vectors(_Float32Only(), "f32", exported.out)
    assert result.passed and result.skipped
    assert all(why.startswith("vector ") for why in result.skipped)
    assert any("dtype" in why for why in result.skipped)
    assert any("attention variant" in why or "KV dtype" in why for why in result.skipped)


class _TwoAtATime(NumpyPagedBackend):
    @property
    def capabilities(self) -> Capabilities:
        caps = super().capabilities
        return replace(caps, name="two at a time", max_num_seqs=2, mixed_batches=False)


def test_attention_is_split_into_the_calls_a_backend_accepts(exported: Exported) -> None:
    result = check_vectors(_TwoAtATime(), "two", exported.out)
    assert result.passed, result.difference and result.difference.describe()
    assert 0 < result.stats.coverage.widest_step <= 2
    assert result.stats.coverage.widest_mixed == (0, 0)


def test_a_decode_only_kernel_has_its_kv_checked_and_its_prefills_skipped(
    exported: Exported,
) -> None:
    ref = "tests/decode_only_backend/decode_backend.py:make_backend"
    result = check_vectors(load_backend(ref), ref, exported.out)
    assert result.passed, result.difference and result.difference.describe()
    assert any("prefill chunk attention not run" in why for why in result.stats.skips)
    assert result.stats.checks["attention outputs judged against the same-precision reference"]


# -- bad arguments and corrupt vectors: exit 2 with a message naming the problem -----------


def _copy(exported: Exported, tmp_path: Path) -> Path:
    out = tmp_path / "v"
    shutil.copytree(exported.out / "0000", out / "0000")
    return out


def _check_error(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


def test_check_of_a_missing_or_empty_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["vectors", "check", str(tmp_path / "nope"), "--backend", "reference"]
    _check_error(argv, capsys, "no such directory")
    _check_error(
        ["vectors", "check", str(tmp_path), "--backend", "reference"], capsys, "no vectors"
    )


def test_check_of_corrupt_vectors(
    exported: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _copy(exported, tmp_path)
    path = root / "0000" / "manifest.json"
    argv = ["vectors", "check", str(root), "--backend", "reference"]
    good = path.read_text()
    path.write_text(good[:100])
    _check_error(argv, capsys, "not valid JSON", str(path))
    manifest = json.loads(good)
    path.write_text(json.dumps({**manifest, "version": 99}))
    _check_error(argv, capsys, "format version 99")
    tolerance = {**manifest["tolerance"], "ratio": 100.0}
    path.write_text(json.dumps({**manifest, "tolerance": tolerance}))
    _check_error(argv, capsys, "tolerance.ratio")
    broken = json.loads(good)
    broken["geometry"]["num_layers"] = 0
    path.write_text(json.dumps(broken))
    _check_error(argv, capsys, "num_layers")
    broken = json.loads(good)
    attention = next(op for op in broken["operations"] if op["op"] == "attention")
    attention["batch"]["seq_lens"] = [0] * len(attention["batch"]["seq_lens"])
    path.write_text(json.dumps(broken))
    _check_error(argv, capsys, "operations[", "seq_lens[0]: 0 is less than 1")
    path.write_text(good)
    array = root / "0000" / manifest["operations"][1]["kv"]
    array.write_bytes(array.read_bytes()[:-4])
    _check_error(argv, capsys, "data bytes", str(array))


def test_check_with_an_unknown_backend(
    exported: Exported, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["vectors", "check", str(exported.out), "--backend", "no_such_backend"]
    _check_error(argv, capsys, "no installed backend named 'no_such_backend'")


def test_export_refuses_a_directory_in_use_and_bad_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x").write_text("")
    _check_error(["vectors", "export", "--out", str(tmp_path)], capsys, "not an empty directory")
    with pytest.raises(SystemExit) as exit_:
        main(["vectors", "export", "--out", str(tmp_path / "n"), "--examples", "0"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        main(["vectors"])
    with pytest.raises(SetupError, match="at least 1"):
        export_vectors(tmp_path / "m", examples=0)


def test_load_array_refuses_what_the_format_does_not_allow(tmp_path: Path) -> None:
    path = tmp_path / "a.npy"
    np.save(path, np.arange(3, dtype=np.int64))
    with pytest.raises(VectorError, match="'<i8'"):
        load_array(path)
    np.save(path, np.asfortranarray(np.ones((2, 3))))
    with pytest.raises(VectorError, match="'fortran_order': True"):
        load_array(path)
    path.write_bytes(b"not numpy")
    with pytest.raises(VectorError, match="magic"):
        load_array(path)
    header = b"[1, 2]" + b" " * 57 + b"\n"  # a header that parses, but is not numpy's dictionary
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
    with pytest.raises(VectorError, match=r"header is not the dictionary .* numpy writes"):
        load_array(path)
    with pytest.raises(TypeError, match="float32 or float64"):
        save_array(path, np.ones(2, dtype=np.int32))
