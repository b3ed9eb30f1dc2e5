"""``python -m conformance``: exit codes, reports, discovery errors, the example database."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.errors import SetupError
from conformance.lockstep.plan import plan_for
from conformance.lockstep.run_stats import RunStats, timed_progress
from conformance.planted.backends import WritesPaddingSlot
from conformance.reports.report import replay_script, reproduce_command
from conformance.run.discovery import installed_backends, load_backend
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from spec.backend import ReferenceBackend
from spec.capabilities import Capabilities

BROKEN = "conformance.planted.backends:WritesPaddingSlot"


def test_reference_conforms_and_writes_both_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, junit = tmp_path / "r.json", tmp_path / "new" / "dir" / "r.xml"  # dirs made
    argv = [
        "run",
        "--backend",
        "reference",
        "--seed",
        "3",
        "--max-examples",
        "20",
        "--no-database",
        "--report",
        str(report),
        "--junit",
        str(junit),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "rules exercised" in out and "invariants checked" in out
    data = json.loads(report.read_text())
    assert data["passed"] is True and data["seed"] == 3 and data["failure"] is None
    assert data["rules"]["fork"] > 0 and data["rules"]["prefix-cache hit"] > 0
    caps = data["capabilities"]  # every declared field, so a reader sees what was skipped
    assert caps["variants"] == ["alibi", "sinks", "softcap", "window"]
    assert caps["kv_dtypes"] == ["fp8_e4m3", "fp8_e5m2"] and caps["head_dims"] is None
    assert caps["excludes"] is False and caps["tensors"] == "numpy"
    suite = ET.parse(junit).getroot()
    assert suite.get("failures") == "0" and suite.find("testcase") is not None


def test_a_broken_backend_exits_1_with_a_located_difference_and_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    argv = [
        "run",
        "--backend",
        BROKEN,
        "--seed",
        "7",
        "--no-database",
        "--report",
        str(report),
        "--junit",
        str(junit),
    ]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "FIRST DIFFERENCE" in out and "block 13, offset 3" in out
    assert f"load_backend({BROKEN!r})" in out and "--seed 7" in out
    failure = json.loads(report.read_text())["failure"]
    assert failure["difference"]["what"] == "K" and "ls.step" in failure["replay_script"]
    case = ET.parse(junit).getroot().find("testcase")
    assert case is not None and case.find("failure") is not None


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("no_such_backend", "no installed backend named"),
        ("spec.backend:NoSuchFactory", "has no callable"),
        ("no_such_module_xyz:make", "importing no_such_module_xyz raised"),
        ("spec.backend:DTYPES", "has no callable"),
        ("spec.backend:Capabilities", "calling Capabilities() raised"),
        ("spec.kv_memory:KVMemory", "calling KVMemory() raised"),
        ("collections:OrderedDict", "lacks create_cache"),
        ("missing/file.py:make", "no file missing/file.py"),
    ],
)
def test_setup_errors_exit_2_and_say_what_to_fix(
    backend: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--backend", backend, "--no-database"]) == 2
    assert message in capsys.readouterr().err


def test_unknown_or_unsupported_dtype_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--backend", "reference", "--dtype", "float8"]) == 2
    assert "unknown dtype 'float8'" in capsys.readouterr().err
    with pytest.raises(SetupError, match="pass --dtype"):
        plan_for(Capabilities("x", dtypes=frozenset({"float32"})), ["bfloat16"])


def test_bad_arguments_exit_2() -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--backend", "reference", "--profile", "forever"])
    assert exited.value.code == 2


def test_list_shows_the_installed_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "torch", "triton"):
        assert name in out
    assert installed_backends()["reference"] == "spec.backend:ReferenceBackend"
    assert isinstance(load_backend("reference"), ReferenceBackend)


def test_dtype_flag_limits_what_runs() -> None:
    result = run_suite(
        ReferenceBackend(),
        "reference",
        run_seed=1,
        dtypes=["bfloat16"],
        database=None,
        max_examples=5,
    )
    assert result.passed and all(k.startswith("bfloat16") for k in result.stats.configs)


def test_a_saved_failure_replays_first_on_the_next_run(tmp_path: Path) -> None:
    first = run_suite(WritesPaddingSlot(), BROKEN, run_seed=7, database=tmp_path, shrink=False)
    assert first.difference is not None
    again = run_suite(WritesPaddingSlot(), BROKEN, run_seed=99, database=tmp_path, shrink=False)
    assert again.stats.first_failure_example == 1
    assert any(tmp_path.iterdir()), "the example database is a directory per backend"


def test_progress_is_reported_on_long_runs() -> None:
    lines: list[str] = []
    stats = RunStats(examples=3, steps=40)
    timed_progress(stats, lines.append, every_s=0.0)()
    assert lines == ["3 examples, 40 steps, 0 s"]


_RAISING_CAPS = """
from spec.backend import ReferenceBackend


class Broken(ReferenceBackend):
    @property
    def capabilities(self):
        raise RuntimeError("no device")


def make():
    return Broken()
"""


def test_capabilities_that_raise_are_a_setup_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "raising_caps.py"
    path.write_text(_RAISING_CAPS)
    assert main(["run", "--backend", f"{path}:make", "--no-database"]) == 2
    assert "reading .capabilities raised RuntimeError: no device" in capsys.readouterr().err


@pytest.mark.parametrize("count", ["-1", "0", "many"])
def test_max_examples_below_1_is_a_usage_error(
    count: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--backend", "reference", "--max-examples", count])
    assert exited.value.code == 2
    assert "--max-examples" in capsys.readouterr().err
    with pytest.raises(SetupError, match="at least 1"):
        run_suite(ReferenceBackend(), "reference", database=None, max_examples=0)


@pytest.mark.parametrize("flag", ["--report", "--junit"])
def test_an_unwritable_report_is_a_setup_error_before_the_run(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    target = blocker / "r.out"  # a file where a folder must be
    argv = ["run", "--backend", "reference", "--seed", "1", "--no-database", "--max-examples", "2"]
    assert main([*argv, flag, str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # found before the run: nothing ran
    assert f"cannot write the report {target}" in captured.err


def test_replay_of_a_file_backend_runs_from_any_directory() -> None:
    result = RunResult("tests/x_backend.py:make", "quick", 5, Capabilities("x"), (), RunStats())
    absolute = f"{Path('tests/x_backend.py').resolve()}:make"
    assert f"load_backend({absolute!r})" in replay_script(result)
    assert f"--backend {absolute} " in reproduce_command(result)
    named = RunResult(BROKEN, "quick", 5, Capabilities("x"), (), RunStats())
    assert f"load_backend({BROKEN!r})" in replay_script(named)


def _keeps_evicted_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant a bug in the spec itself: the pool evicts a cached block but keeps its hash."""
    from spec.block_pool import BlockPool

    allocate = BlockPool.allocate

    def keeps_hash(self: BlockPool) -> int:
        if not self._free and self._evictable:
            block, _ = self._evictable.popitem(last=False)  # reused, its hash not dropped
            self.num_evictions += 1
            self._ref_counts[block] = 1
            return block
        return allocate(self)

    monkeypatch.setattr(BlockPool, "allocate", keeps_hash)


def test_a_spec_side_bug_is_blamed_on_the_spec_not_the_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _keeps_evicted_hashes(monkeypatch)
    report = tmp_path / "r.json"
    argv = ["run", "--backend", "reference", "--in-process", "--seed", "2", "--no-database"]
    assert main([*argv, "--max-examples", "4", "--no-shrink", "--report", str(report)]) == 2
    err = capsys.readouterr().err
    assert "a bug in spec/ or in the suite, not the backend" in err
    assert "but has a prefix-cache hash" in err and "backend failed" not in err
    data = json.loads(report.read_text())
    assert data["verdict"].startswith("SETUP ERROR: a bug in spec/ or in the suite")
    assert data["passed"] is False
