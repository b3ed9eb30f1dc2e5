"""Reports that cannot lie, for ``run`` and ``scheduler``: stale, killed, cut short, unwritable.

* A report of an earlier run is replaced, before the run starts, by one that
  says INCOMPLETE: a run killed with SIGKILL leaves that, never the old pass.
* SIGTERM stops a run as Ctrl-C does: status 130, every report written and
  marked interrupted, the child process gone.
* A run cut short by ``--time-budget`` says PARTIAL in every report and exits
  3 (0 with ``--budget-passes``).
* An unwritable report path is a setup error (2) before anything runs.
* Reports are written atomically: a failed write leaves the old file whole.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from misbehaving_backends import MARKER_VAR as BACKEND_MARKER
from misbehaving_schedulers import MARKER_VAR as SCHEDULER_MARKER

from conformance.cli import main
from conformance.reports.files import INCOMPLETE, write_atomic

ROOT = Path(__file__).resolve().parents[1]
HANGING = {
    "run": (
        ["run", "--backend", f"{ROOT}/tests/misbehaving_backends.py:HangsInAttention"],
        BACKEND_MARKER,
    ),
    "scheduler": (
        ["scheduler", "--scheduler", f"{ROOT}/tests/misbehaving_schedulers.py:HangsInStep"],
        SCHEDULER_MARKER,
    ),
}
STALE_JSON = '{"passed": true, "verdict": "PASSED", "complete": true}\n'
STALE_XML = '<?xml version="1.0"?>\n<testsuite name="conformance" tests="1" failures="0"/>\n'


def _stale(tmp_path: Path) -> tuple[Path, Path]:
    """A passing JSON and JUnit report of an earlier run, where this run writes its own."""
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    report.write_text(STALE_JSON)
    junit.write_text(STALE_XML)
    return report, junit


def _start_hanging(tmp_path: Path, command: str) -> tuple[subprocess.Popen[str], list[int]]:
    """The CLI on a hanging backend or scheduler, once it hangs mid-run: the process, and the
    hung child's pid (with the pid of a helper process it started, for a backend)."""
    argv, marker_var = HANGING[command]
    marker = tmp_path / "pids"
    env = {**os.environ, marker_var: str(marker), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "conformance", *argv, "--seed", "1", "--no-database"]
    argv += ["--max-examples", "2", "--call-timeout", "600"]
    argv += ["--report", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the run never hung"
        time.sleep(0.05)
    return proc, [int(pid) for pid in marker.read_text().split()]


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("command", ["run", "scheduler"])
def test_sigterm_stops_the_run_as_ctrl_c_does_and_replaces_a_stale_pass(
    command: str, signum: int, tmp_path: Path
) -> None:
    report, junit = _stale(tmp_path)
    proc, (hung, *_) = _start_hanging(tmp_path, command)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "INTERRUPTED (Ctrl-C or SIGTERM): no verdict" in out
    data = json.loads(report.read_text())
    assert data["interrupted"] is True and data["passed"] is False and data["complete"] is False
    assert ET.parse(junit).getroot().get("errors") == "1"
    assert _gone(hung), "the hung child process survived"


@pytest.mark.parametrize("command", ["run", "scheduler"])
def test_a_run_killed_outright_leaves_incomplete_reports_not_a_stale_pass(
    command: str, tmp_path: Path
) -> None:
    report, junit = _stale(tmp_path)
    proc, pids = _start_hanging(tmp_path, command)
    proc.kill()  # SIGKILL: no handler runs, no report is written after this
    proc.communicate(timeout=60)
    data = json.loads(report.read_text())
    assert data["passed"] is False and data["complete"] is False
    assert data["verdict"] == INCOMPLETE
    root = ET.parse(junit).getroot()
    assert root.get("errors") == "1" and root.find("testcase/error") is not None
    assert _gone(pids[0]), "the child outlived its parent"
    assert all(_gone(pid) for pid in pids[1:]), "a process the backend started outlived the run"


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--backend", "reference", "--max-examples", "100000"],
        ["scheduler", "--scheduler", "spec.scheduler:ContinuousScheduler"],
    ],
)
def test_a_run_cut_short_by_its_time_budget_is_partial_with_status_3(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, junit = _stale(tmp_path)
    argv = [*argv, "--seed", "1", "--no-database", "--time-budget", "0.5"]
    argv += ["--report", str(report), "--junit", str(junit)]
    assert main(argv) == 3
    out = capsys.readouterr().out
    data = json.loads(report.read_text())
    assert "PARTIAL: passed within the time budget" in out and "not a full run" in out
    assert data["verdict"].startswith("PARTIAL") and data["partial"] is True
    assert data["complete"] is False and data["stopped"] == "time budget"
    props = {p.get("name"): p.get("value") for p in ET.parse(junit).getroot().iter("property")}
    assert str(props["verdict"]).startswith("PARTIAL") and props["complete"] == "false"
    assert main([*argv, "--budget-passes"]) == 0
    assert json.loads(report.read_text())["verdict"].startswith("PARTIAL")


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--backend", "reference"],
        ["scheduler", "--scheduler", "spec.scheduler:ContinuousScheduler"],
    ],
)
def test_an_unwritable_report_path_exits_2_before_the_run_and_touches_no_report(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, _ = _stale(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad = blocker / "r.xml"  # under a file: no folder can be made there
    argv = [*argv, "--seed", "1", "--no-database", "--max-examples", "1"]
    assert main([*argv, "--report", str(report), "--junit", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"cannot write the report {bad}" in captured.err
    assert report.read_text() == STALE_JSON  # checked all paths before changing any
    assert main([*argv, "--report", str(tmp_path)]) == 2  # a folder
    assert "it is a folder" in capsys.readouterr().err


def test_an_atomic_write_that_fails_leaves_the_old_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_atomic(path, "old\n")
    with pytest.raises(TypeError):  # the write fails midway (not text)
        write_atomic(path, 12345)  # type: ignore[arg-type]
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
