"""The GPU check's arguments and its JSON's shape, on a CPU (GPU figures come only from a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def test_a_dry_run_writes_every_figure_as_null_and_says_none_are_gpu_figures(
    tmp_path: Path,
) -> None:
    out = tmp_path / "check.json"
    assert gpu_check.main(["--out", str(out), "--dry-run"]) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == gpu_check.SCHEMA and data["gpu_figures"] is False
    assert "only from a GPU" in data["note"]
    assert set(data["decode"]) == set(gpu_check.DECODE_FIGURES)
    assert all(v is None for v in data["decode"].values())
    assert data["workload"] == gpu_check.WORKLOAD | {"batch": 64, "context": 4096}
    command = data["conformance"]["command"]
    assert command[:3] == ["-m", "conformance", "run"]
    assert command[command.index("--envelope") + 1] == "device"
    assert command[command.index("--backend") + 1] == gpu_check.CONFORMANCE_BACKEND
    assert command[command.index("--profile") + 1] == "quick"
    assert "--time-budget" not in command, "the check runs quick to completion"
    assert "--jobs" in command
    for run in ("cold", "warm"):  # an empty Triton cache, then the one it filled
        assert set(data["conformance"][run]) == set(gpu_check.RUN_FIGURES)
        assert all(v is None for v in data["conformance"][run].values())
    tests = data["tests"]["command"]
    assert tests[:2] == ["-m", "pytest"] and "tests/test_backend_kernels.py" in tests
    assert all(t in gpu_check.BACKEND_TESTS for t in tests if t.startswith("tests/"))


def test_the_check_runs_the_backend_tests_and_the_suite_compiled() -> None:
    """No interpreter in the children: kernels compile on the device; the CI test profile."""
    env = gpu_check._compiled_env(Path("/tmp/cache"))
    assert "TRITON_INTERPRET" not in env and env["TRITON_CACHE_DIR"] == "/tmp/cache"
    assert env["CI"] == "true" and env["OMP_NUM_THREADS"] == "1"
    assert 1 <= gpu_check.default_jobs() <= 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_without_cuda_the_check_refuses_and_says_why(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no CUDA device.*only from a GPU"):
        gpu_check.main(["--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_bad_arguments_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run"])  # --out is required
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "x.json"), "--budget", "10", "--dry-run"])
    assert "--budget must be more than 60" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):  # a folder that cannot be made: refused before the run
        gpu_check.main(["--out", str(tmp_path / "file" / "x.json"), "--dry-run"])
    assert "cannot write --out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "x.json"), "--jobs", "0", "--dry-run"])
    assert "--jobs must be 1 to 64" in capsys.readouterr().err


def test_the_shell_wrapper_runs_the_module(tmp_path: Path) -> None:
    out = tmp_path / "check.json"

    done = subprocess.run(
        [str(ROOT / "benchmarks" / "gpu_check.sh"), "--out", str(out), "--dry-run"],
        env={"PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["gpu_figures"] is False
