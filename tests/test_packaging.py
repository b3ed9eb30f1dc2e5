"""The distribution: the wheel builds with no warning and holds the four packages and their data,
nothing else; installed in a fresh virtual environment, its console script and pytest plugin work.

The first test builds the wheel (setuptools, as ``pip wheel`` runs it); the
second installs it into a new virtual environment that borrows this one's
dependencies (numpy, Hypothesis, torch, pytest) through a path file, so no
download is needed, and runs there, outside the repository:
``paged-spec list``, ``paged-spec run``, ``pytest --paged-backend`` and
``python -c "import tools"`` (which must fail).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"spec", "backend_gpu", "conformance", "paged_spec"}
NOT_SHIPPED = {"tests", "docs_tools", "benchmarks", "tools", "docs"}
_IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "build", "*.egg-info", "__pycache__", ".hypothesis", ".mypy_cache",
    ".pytest_cache", ".ruff_cache", "site", "out", "mutants", ".whl",
)  # fmt: skip
"""What the repository's .gitignore leaves out: never part of a build."""


def _env(**extra: str) -> dict[str, str]:
    """This environment without the repository on the path or a byte-compiling veto.

    ``PYTHONDONTWRITEBYTECODE`` makes setuptools print "byte-compiling is
    disabled", which is about the machine, not the package.
    """
    drop = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTEST_ADDOPTS", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PAGED_SPEC_")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel, built from a clean copy of the sources; and everything the build printed."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=_IGNORED)
    # setuptools from this environment when it has it (no index needed), else pip's isolated build
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    dist = work / "dist"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", source, "--no-deps", "-v", "-w", dist, *isolation],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    (built,) = (work / "dist").glob("paged_spec-*.whl")
    return built, output


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
    session = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--paged-backend",
                  "reference", "--paged-time-budget", "3", "--paged-seed", "1",
                  "--paged-no-database")  # fmt: skip
    assert session.returncode == 0, session.stdout + session.stderr
    assert "4 passed" in session.stdout, "the project's test and the suite's three"
    for name in ("tools", "benchmarks", "docs_tools"):
        gone = run(python, "-c", f"import {name}")
        assert gone.returncode == 1 and "ModuleNotFoundError" in gone.stderr, name
