"""The distribution: the wheel builds with no warning and holds the four packages and their data,
nothing else; installed in a fresh virtual environment, its console script and pytest plugin work.

The first test builds the wheel (setuptools, as ``pip wheel`` runs it); the
second installs it into a new virtual environment that borrows this one's
dependencies (numpy, Hypothesis, torch, pytest) through a path file, so no
download is needed, and runs there, outside the repository:
``paged-spec list``, ``paged-spec run`` (reference, torch, triton),
``pytest --paged-backend`` and
``python -c "import tools"`` (which must fail).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from wheel_fixture import ROOT, wheel
from wheel_fixture import clean_env as _env

__all__ = ["wheel"]  # the session fixture, imported for pytest

PACKAGES = {"spec", "backend_gpu", "conformance", "paged_spec"}
NOT_SHIPPED = {"tests", "docs_tools", "benchmarks", "tools", "docs"}


def test_the_wheel_builds_without_a_warning(wheel: tuple[Path, str]) -> None:
    _, output = wheel
    warnings = [line for line in output.splitlines() if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings)


def test_the_wheel_holds_the_packages_their_data_and_nothing_else(wheel: tuple[Path, str]) -> None:
    path, _ = wheel
    names = set(zipfile.ZipFile(path).namelist())
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == PACKAGES, f"top-level entries: {sorted(top)}"
    assert not {name.split("/")[0] for name in names} & NOT_SHIPPED
    data = [
        *ROOT.glob("conformance/vectors/schema/*.json"),
        *ROOT.glob("conformance/vectors/reader_c/*.c"),
        *ROOT.glob("conformance/vectors/reader_c/*.h"),
    ]
    assert len(data) >= 3
    for file in data:
        assert file.relative_to(ROOT).as_posix() in names, f"{file.name} is not in the wheel"
    for package in PACKAGES:
        assert f"{package}/py.typed" in names, f"{package} is not marked typed"
    assert "conformance/run/shard.py" in names and "paged_spec/pytest_plugin.py" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(path).read(entry_points).decode()
    assert "paged-spec = conformance.cli:main" in text
    assert "[pytest11]\npaged_spec = paged_spec.pytest_plugin" in text


@pytest.mark.slow
def test_installed_in_a_fresh_environment_the_script_and_the_plugin_work(
    wheel: tuple[Path, str], tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # this environment's dependencies, after the new environment's own packages (no download)
    Path(purelib, "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps"]
    subprocess.run([*install, "-q", str(wheel[0])], check=True, env=_env(), timeout=300)
    project = tmp_path / "project"  # a kernel project: its own test, outside the repository
    project.mkdir()
    (project / "test_kernel.py").write_text("def test_kernel():\n    assert True\n")

    def run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in argv],
            cwd=project,
            capture_output=True,
            text=True,
            env=_env(TRITON_INTERPRET="1", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"),
            timeout=300,
        )

    where = run(python, "-c", "import conformance, paged_spec; print(conformance.__file__)")
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    listed = run(bin_dir / "paged-spec", "list")
    assert listed.returncode == 0 and "reference" in listed.stdout, listed.stderr
    assert "usage: paged-spec run" in run(bin_dir / "paged-spec", "run").stderr
    quick = ("--seed", "1", "--no-database")
    done = run(bin_dir / "paged-spec", "run", "--backend", "reference", "--max-examples", "2",
               "--time-budget", "3", "--budget-passes", *quick)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "conformance: backend 'reference' (profile quick, seed 1): " in done.stdout
    assert "FAILED" not in done.stdout
    for backend in ("torch", "triton"):  # the full install runs every installed backend
        done = run(bin_dir / "paged-spec", "run", "--backend", backend, "--max-examples", "1",
                   "--time-budget", "3", "--budget-passes", *quick)  # fmt: skip
        assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout + done.stderr
    session = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--paged-backend",
                  "reference", "--paged-time-budget", "3", "--paged-seed", "1",
                  "--paged-no-database")  # fmt: skip
    assert session.returncode == 0, session.stdout + session.stderr
    assert "4 passed" in session.stdout, "the project's test and the suite's three"
    for name in ("tools", "benchmarks", "docs_tools"):
        gone = run(python, "-c", f"import {name}")
        assert gone.returncode == 1 and "ModuleNotFoundError" in gone.stderr, name
