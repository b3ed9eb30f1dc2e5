"""An out-of-tree backend plugged in each of the three ways: CLI, environment variable, subclass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.run.discovery import ENV_VAR, load_backend
from conformance.testing import BackendConformance
from spec.backend import Backend

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "tests" / "third_party_backend" / "my_backend.py"
FILE_REF = f"{EXAMPLE.relative_to(ROOT)}:make_backend"


class TestMyBackendBySubclassing(BackendConformance):
    """Way 3: the base class, as a third party would use it in its own test suite."""

    backend_ref = FILE_REF
    conformance_seed = 5
    conformance_examples = 20  # the profile's 60 are `make conformance`'s; 20 keep make test fast

    @pytest.fixture
    def backend(self) -> Backend:
        return load_backend(str(EXAMPLE) + ":make_backend")


@pytest.mark.heavy
def test_way_1_cli_with_a_file_factory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    argv = ["run", "--backend", FILE_REF, "--seed", "5", "--max-examples", "20"]
    assert main([*argv, "--no-database"]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "dtype bfloat16: not in the backend capabilities" in out


def test_way_1_cli_with_a_module_factory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    assert (
        main(
            [
                "run",
                "--backend",
                "my_backend:make_backend",
                "--seed",
                "6",
                "--no-database",
                "--max-examples",
                "20",
            ]
        )
        == 0
    )
    assert "PASSED" in capsys.readouterr().out


def _pytest_with_env(ref: str) -> subprocess.CompletedProcess[str]:
    knobs = {"PAGED_SPEC_SEED": "5", "PAGED_SPEC_EXAMPLES": "10", "PAGED_SPEC_LONG_EXAMPLES": "1"}
    env = {**os.environ, ENV_VAR: ref, "PAGED_SPEC_PROFILE": "quick", **knobs}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--pyargs",
            "conformance.pytest_suite",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_way_2_environment_variable_under_plain_pytest() -> None:
    done = _pytest_with_env(FILE_REF)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    # the summary, on success too, under plain `pytest -q`: the seed and what ran
    assert "paged-attention conformance" in done.stdout
    assert f"backend '{FILE_REF}' (profile quick, seed 5): PASSED" in done.stdout
    assert "reproduce: PAGED_SPEC_SEED=5" in done.stdout


def test_way_2_reports_a_broken_backend_as_a_test_failure() -> None:
    done = _pytest_with_env("conformance.planted.backends:IgnoresScale")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 2 passed" in done.stdout
    assert "FIRST DIFFERENCE" in done.stdout and "load_backend(" in done.stdout
