"""Reports that cannot lie, for ``run`` and ``scheduler``: stale, killed, cut short, unwritable.

* A report of an earlier run is replaced, before the run starts, by one that
  says INCOMPLETE: a run killed with SIGKILL leaves that, never the old pass.
* SIGTERM stops a run as Ctrl-C does: status 130, every report written and
  marked interrupted, the child process gone.
* A run cut short by ``--time-budget`` says PARTIAL in every report and exits
  3 (0 with ``--budget-passes``).
* An unwritable report path is a setup error (2) before anything runs.
* Reports are written atomically: a failed write leaves the old file whole.
* No output path can damage the machine: a character device or a FIFO (made with
  mknod and mkfifo in a temporary folder, never a real device) is written through
  and is still one afterwards, for every output option (run, scheduler and
  vectors check reports; vectors export, the simulator, the sandbox, traces,
  benchmarks); a link is followed to its target; a socket, a block device or a
  folder is refused; ``os.replace`` never lands on anything but a regular file.
* A setup error (a factory that raises, a missing scheduler or vector folder) leaves a
  report that says SETUP ERROR and why, not the INCOMPLETE placeholder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
from misbehaving_backends import MARKER_VAR as BACKEND_MARKER
from misbehaving_schedulers import MARKER_VAR as SCHEDULER_MARKER
from vectors_fixtures import Exported, exported, manifests

from benchmarks.gpu_check import main as gpu_check_main
from conformance.cli import main
from conformance.errors import SetupError
from conformance.output_files import INCOMPLETE, check_output, write_output
from paged_spec.sandbox import main as sandbox_main
from paged_spec.sim.traffic import LENGTH_PRESETS, poisson_trace, save_trace
from paged_spec.simulate import main as simulate_main

__all__ = ["exported"]  # the session fixture, imported for pytest

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
    write_output(path, "old\n")
    with pytest.raises(TypeError):  # the write fails (not text)
        write_output(path, 12345)  # type: ignore[arg-type]
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left
    write_output(path, "new\n")
    assert path.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


# -- outputs that cannot damage anything: devices, FIFOs, sockets, links -------------------


def _char_device(path: Path) -> Path:
    """A character device node in a temporary folder: 1:3, the device /dev/null is (writes
    are discarded); never a real device path. Needs root (CAP_MKNOD), as CI has."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD) to make a character device node in tmp")
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


class _Reader(threading.Thread):
    """Reads a FIFO until a writer has written and closed it (opened now, so a writer finds
    a reader; without blocking: before any writer, a read returns end of file at once)."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.data = b""

    def run(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:  # a writer is there, nothing written yet
                chunk = None
            if chunk:
                self.data += chunk
            elif chunk == b"" and self.data:  # written, then closed
                return
            else:
                time.sleep(0.01)

    def text(self) -> str:
        self.join(timeout=60)
        os.close(self.fd)
        return self.data.decode()


def _still(path: Path, kind: Callable[[int], bool]) -> bool:
    return kind(os.lstat(path).st_mode)


@pytest.fixture
def replaced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``os.replace`` target of the test, checked: a regular file or nothing there."""
    done: list[str] = []
    original = os.replace

    def spy(src: str | Path, dst: str | Path) -> None:
        if os.path.lexists(dst):
            assert stat.S_ISREG(os.lstat(dst).st_mode), f"os.replace onto {dst}, not a file"
        done.append(str(dst))
        original(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    return done


def test_each_kind_of_path_is_written_by_its_rule(tmp_path: Path, replaced: list[str]) -> None:
    regular, missing = tmp_path / "r.json", tmp_path / "new" / "r.json"
    regular.write_text("old\n")
    for path in (regular, missing):
        write_output(path, "new\n")
        assert path.read_text() == "new\n" and stat.S_ISREG(os.lstat(path).st_mode)
    link = tmp_path / "link.json"
    link.symlink_to(regular)
    write_output(link, "through the link\n")  # the target is replaced, the link kept
    assert link.is_symlink() and regular.read_text() == "through the link\n"
    device = _char_device(tmp_path / "fakenull")
    write_output(device, "discarded\n")
    (tmp_path / "to-device").symlink_to(device)
    write_output(tmp_path / "to-device", "discarded too\n")
    assert _still(device, stat.S_ISCHR)
    fifo = _fifo(tmp_path / "fifo")
    reader = _Reader(fifo)
    reader.start()
    write_output(fifo, "streamed\n")
    assert reader.text() == "streamed\n" and _still(fifo, stat.S_ISFIFO)
    with pytest.raises(SetupError, match="FIFO that no process is reading"):
        write_output(fifo, "nobody reads\n")
    assert replaced == [str(regular), str(missing), str(regular)]


def test_sockets_block_devices_and_folders_are_refused(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        block = tmp_path / "block"
        try:  # a node for loop device 7:0 in tmp: only looked at, never opened
            os.mknod(block, 0o600 | stat.S_IFBLK, os.makedev(7, 0))
        except PermissionError:
            block = None  # type: ignore[assignment]
        for path, says in [
            (tmp_path / "sock", "a socket"),
            (block, "a block device"),
            (tmp_path, "a folder"),
        ]:
            if path is None:
                continue
            with pytest.raises(SetupError, match=says):
                check_output(path)
            with pytest.raises(SetupError, match=says):
                write_output(path, "x")
        assert stat.S_ISSOCK(os.lstat(tmp_path / "sock").st_mode)
        assert block is None or stat.S_ISBLK(os.lstat(block).st_mode)
    finally:
        sock.close()


def test_run_writes_through_a_device_and_a_fifo_and_replaces_neither(
    tmp_path: Path, replaced: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    device, fifo = _char_device(tmp_path / "fakenull"), _fifo(tmp_path / "fifo")
    reader = _Reader(fifo)
    reader.start()
    argv = ["run", "--backend", "reference", "--max-examples", "1", "--seed", "1"]
    argv += ["--no-database", "--in-process", "--report", str(device), "--junit", str(fifo)]
    assert main(argv) == 0, capsys.readouterr().err
    assert ET.fromstring(reader.text()).get("failures") == "0"
    assert _still(device, stat.S_ISCHR) and _still(fifo, stat.S_ISFIFO)
    assert replaced == []


def test_scheduler_and_vectors_check_write_through_too(
    tmp_path: Path, replaced: list[str], exported: Exported
) -> None:
    device, fifo = _char_device(tmp_path / "fakenull"), _fifo(tmp_path / "fifo")
    one = manifests(exported.out)[0].parent
    for argv in (
        ["scheduler", "--scheduler", "spec.scheduler:ContinuousScheduler", "--seed", "1"],
        ["vectors", "check", str(one), "--backend", "reference"],
    ):
        reader = _Reader(fifo)
        reader.start()
        extra = ["--max-examples", "1", "--no-database"] if argv[0] == "scheduler" else []
        assert main([*argv, *extra, "--report", str(fifo), "--junit", str(device)]) == 0
        assert json.loads(reader.text())["passed"] is True
    assert _still(device, stat.S_ISCHR) and _still(fifo, stat.S_ISFIFO)
    assert replaced == []


def test_a_report_through_a_link_replaces_its_target_not_the_link(tmp_path: Path) -> None:
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text(STALE_JSON)
    link.symlink_to(target)
    argv = ["run", "--backend", "no_such:make", "--report", str(link)]
    assert main(argv) == 2  # a setup error: its report goes where the link points
    assert link.is_symlink() and json.loads(target.read_text())["verdict"].startswith("SETUP ERROR")


def test_folder_outputs_refuse_a_device_and_a_fifo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    device, fifo = _char_device(tmp_path / "fakenull"), _fifo(tmp_path / "fifo")
    for node in (device, fifo):
        assert main(["vectors", "export", "--out", str(node), "--examples", "1"]) == 2
        assert "not a folder" in capsys.readouterr().err
        assert simulate_main(["--out", str(node), "--num-requests", "4", "--quiet"]) == 2
        assert "not a folder" in capsys.readouterr().err
        with pytest.raises(SystemExit) as exit_:
            sandbox_main(["--out", str(node)])
        assert exit_.value.code == 2 and "not a folder" in capsys.readouterr().err
    assert _still(device, stat.S_ISCHR) and _still(fifo, stat.S_ISFIFO)


def test_files_inside_output_folders_follow_the_rule(
    tmp_path: Path, replaced: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A device where the simulator, the sandbox, a trace or a benchmark writes a file: written
    through, still a device (the capacity tool writes only to standard output)."""
    out = tmp_path / "sim"
    out.mkdir()
    device = _char_device(out / "results.json")
    argv = ["--num-requests", "6", "--rates", "4", "--no-plots", "--quiet", "--jobs", "1"]
    assert simulate_main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    first = _char_device(pictures / "sandbox-1-grow.svg")
    assert sandbox_main(["--out", str(pictures)]) == 0
    save_trace(device, poisson_trace(LENGTH_PRESETS["alpaca"], rate=1.0, num_requests=2))
    assert gpu_check_main(["--dry-run", "--out", str(device)]) == 0
    assert _still(device, stat.S_ISCHR) and _still(first, stat.S_ISCHR)
    assert all(stat.S_ISREG(os.lstat(p).st_mode) for p in map(Path, replaced))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "--backend", "FACTORY"], "calling make() raised RuntimeError: no GPU here"),
        (["scheduler", "--scheduler", "/no/such/scheduler.py:make"], "no file"),
        (["vectors", "check", "/no/such/vectors", "--backend", "reference"], "no such directory"),
    ],
)
def test_a_setup_error_leaves_a_setup_error_report_not_the_placeholder(
    argv: list[str], says: str, tmp_path: Path
) -> None:
    factory = tmp_path / "raising.py"
    factory.write_text('def make():\n    raise RuntimeError("no GPU here")\n')
    argv = [f"{factory}:make" if a == "FACTORY" else a for a in argv]
    report, junit = _stale(tmp_path)
    assert main([*argv, "--report", str(report), "--junit", str(junit)]) == 2
    data = json.loads(report.read_text())
    assert data["verdict"].startswith("SETUP ERROR: ") and says in data["setup_error"]
    assert data["passed"] is False and data["verdict"] != INCOMPLETE
    error = ET.parse(junit).getroot().find("testcase/error")
    assert error is not None and str(error.get("message")).startswith("SETUP ERROR: ")
