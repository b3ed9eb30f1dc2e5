"""No backend can end a run silently: exits, hangs, crashes, nondeterminism, input writes, views.

Each misbehaving backend of ``tests/misbehaving_backends.py`` runs through
``python -m conformance run`` (its child process) and must end with status 1,
the problem named in the text report, and the JSON and JUnit reports written.
Runs are short: two examples, and a two-second call timeout for the hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from misbehaving_backends import MARKER_VAR

from conformance.cli import main
from conformance.run.control import RunControl
from conformance.run.discovery import load_backend
from conformance.run.runner import run_suite

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ROOT / "tests" / "misbehaving_backends.py"


def _ref(factory: str) -> str:
    return f"{BACKENDS}:{factory}"


def _cli(tmp_path: Path, factory: str, *extra: str) -> tuple[int, dict[str, Any], ET.Element]:
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    argv = ["run", "--backend", _ref(factory), "--seed", "1", "--no-database"]
    argv += ["--max-examples", "2", "--report", str(report), "--junit", str(junit), *extra]
    status = main(argv)
    return status, json.loads(report.read_text()), ET.parse(junit).getroot()


@pytest.mark.parametrize(
    ("factory", "kind", "named"),
    [
        ("ExitsInAttention", "exception", "backend.attention called sys.exit(0)"),
        ("RaisesKeyboardInterrupt", "exception", "raised KeyboardInterrupt itself"),
        ("HangsInAttention", "hang", "backend.attention (layer 0) at step 1 did not return"),
        ("AbortsInAttention", "crash", "killed by signal SIGABRT (Aborted) during backend."),
        ("SegfaultsInWriteKV", "crash", "killed by signal SIGSEGV (Segmentation fault) during"),
        ("ExitsHardInCopy", "crash", "exited with status 3 during backend.copy_blocks at step 1"),
        ("WrongOnceInAttention", "output", "the backend is not deterministic"),
        ("WritesIntoQuery", "input", "tried to write into its input `query`"),
        ("WritesIntoKeyNatively", "input", "changed its input `key` during the call"),
        ("ReturnsLiveViews", "alias", "returned a live view of the cache, not a copy"),
    ],
)
def test_a_misbehaving_backend_fails_the_run_with_every_report(
    factory: str, kind: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, data, junit = _cli(tmp_path, factory, "--call-timeout", "1")
    out = capsys.readouterr().out
    assert status == 1, out
    assert named in out and "FAILED" in out
    assert data["passed"] is False and data["failure"]["kind"] == kind
    assert data["failure"]["replay_script"].count("ls = Lockstep(") == 1
    # every pass is judged: a later pass may fail too (one failing test case each)
    assert junit.get("failures") == str(max(1, data["distinct_failures"]))


def test_a_crash_report_shows_the_stack_and_replays_the_workload_so_far(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, data, _ = _cli(tmp_path, "SegfaultsInWriteKV")
    out = capsys.readouterr().out
    assert status == 1
    assert "WHAT THE BACKEND PROCESS PRINTED LAST" in out and "Fatal Python error" in out
    assert "misbehaving_backends.py" in out  # the innermost frame: the backend's line
    assert "FAILING WORKLOAD, not shrunk: the backend process crashed" in out
    assert "ls.step(" in data["failure"]["replay_script"]  # the step that crashed
    assert data["failure"]["shrunk"] is False and data["failure"]["diagnostics"]


def test_nondeterminism_reports_both_outcomes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, data, _ = _cli(tmp_path, "WrongOnceInAttention")
    out = capsys.readouterr().out
    assert "THE BACKEND IS NOT DETERMINISTIC: the same workload gave two outcomes" in out
    outcomes = data["failure"]["outcomes"]
    assert "output differs" in outcomes["first"]
    assert outcomes["replay"] == "no difference: the same workload passed"


def test_a_factory_that_exits_is_a_setup_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "exits.py"
    path.write_text("import sys\n\ndef make():\n    sys.exit(0)\n")
    assert main(["run", "--backend", f"{path}:make", "--no-database"]) == 2
    assert "calling make() raised SystemExit" in capsys.readouterr().err


def test_a_crash_while_loading_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "aborts.py"
    path.write_text(
        "import os, resource\n\ndef make():\n"
        "    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n    os.abort()\n"
    )
    report = tmp_path / "r.json"
    argv = ["run", "--backend", f"{path}:make", "--no-database", "--report", str(report)]
    assert main(argv) == 1
    assert "SIGABRT (Aborted) during loading the backend" in capsys.readouterr().out
    assert json.loads(report.read_text())["failure"]["kind"] == "crash"


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether process ``pid`` has ended (a zombie counts: it runs nothing)."""
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


def _start_hanging_run(tmp_path: Path, timeout: str) -> tuple[subprocess.Popen[str], list[int]]:
    """The CLI on the hanging backend, once its call hangs: the process and the backend's pids."""
    marker = tmp_path / "pids"
    env = {**os.environ, MARKER_VAR: str(marker), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "conformance", "run", "--backend", _ref("HangsInAttention")]
    argv += ["--seed", "1", "--no-database", "--max-examples", "2", "--call-timeout", timeout]
    argv += ["--report", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the backend never hung"
        time.sleep(0.05)
    return proc, [int(p) for p in marker.read_text().split()]


def test_a_hang_kills_the_backend_and_everything_it_started(tmp_path: Path) -> None:
    proc, (child, helper) = _start_hanging_run(tmp_path, timeout="1")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert "FAILED: a backend call hung" in out
    assert _gone(child) and _gone(helper), "the hung backend or its helper process survived"


def test_ctrl_c_stops_the_run_with_status_130_and_the_reports(tmp_path: Path) -> None:
    proc, (child, helper) = _start_hanging_run(tmp_path, timeout="600")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "INTERRUPTED (Ctrl-C or SIGTERM)" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["interrupted"] is True and data["passed"] is False
    assert ET.parse(tmp_path / "r.xml").getroot().get("errors") == "1"
    assert _gone(child) and _gone(helper)


# -- in process: the same guard, and the watchdog instead of a parent ----------------------


@pytest.mark.parametrize(
    ("factory", "named"),
    [
        ("ExitsInAttention", "called sys.exit(0)"),
        ("RaisesKeyboardInterrupt", "raised KeyboardInterrupt itself"),
        ("WritesIntoQuery", "tried to write into its input `query`"),
        ("WritesIntoKeyNatively", "changed its input `key`"),
        ("ReturnsLiveViews", "live view of the cache"),
        ("HangsInAttention", "did not return within 1 s"),
    ],
)
def test_in_process_runs_report_the_same_misbehaviour(factory: str, named: str) -> None:
    backend = load_backend(_ref(factory))
    control = RunControl(call_timeout_s=1.0)
    result = run_suite(backend, factory, run_seed=1, database=None, control=control, shrink=False)
    assert result.difference is not None and not result.passed
    assert named in result.difference.describe()


def test_a_real_ctrl_c_in_process_stops_the_run() -> None:
    backend = load_backend(_ref("HangsInAttention"))
    main_thread = threading.main_thread().ident
    assert main_thread is not None
    timer = threading.Timer(1.0, signal.pthread_kill, args=(main_thread, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_suite(backend, "hangs", run_seed=1, database=None, max_examples=2)
    finally:
        timer.cancel()


def test_a_crash_while_shrinking_keeps_the_failure_found_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The child tells the parent of a failure before it shrinks it: when the backend then
    crashes on a smaller workload, the report leads with that failure, unshrunk, and lists the
    crash after it (a GPU kernel's illegal access or out-of-memory while shrinking)."""
    status, data, _ = _cli(tmp_path, "WrongThenExitsWhileShrinking")
    out = capsys.readouterr().out
    assert status == 1
    assert data["failure"]["kind"] == "output"
    assert "exited with status 3" in data["failure"]["shrink_note"]
    assert "while shrinking it" in data["failure"]["shrink_note"]
    kinds = [f["kind"] for f in data["failures"]]
    assert kinds == ["output", "crash"], kinds
    assert "ls.step(" in data["failure"]["replay_script"]
    assert "first difference: output" in out or "first difference: " in out
