"""Installs that match what they claim: the wheel in clean virtual environments, one per extra.

* **base** (numpy and Hypothesis only): ``paged-spec run`` passes on the reference
  backend and on the plugging-in guide's numpy backend, judged by the spec's
  numpy reference (the report says so); the torch backend is a setup error
  naming ``paged-spec[torch]``.
* **torch** (torch's CPU build, no Triton): the eager torch backend runs; the
  Triton backend is a setup error naming ``paged-spec[gpu]``.
* **test** (everything): tests/test_packaging.py installs the wheel beside all
  of this environment's packages and runs the suite, the plugin and the three
  backends.

The wheel is built once (tests/wheel_fixture.py) and installed with
``--no-deps``; each environment borrows exactly the distributions its extra
brings, and what they require, from this one through a path file: no index
and no download, so the test costs seconds. That the wheel's metadata asks for
those same distributions, extra by extra, is checked separately.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from wheel_fixture import ROOT, clean_env, make_venv, requirements_of, wheel

from conformance.run.discovery import EXTRAS

__all__ = ["wheel"]  # the session fixture, imported for pytest

EXAMPLE = ROOT / "tests" / "third_party_backend" / "my_backend.py"  # docs/plugging-in.md's
QUICK = ("--max-examples", "1", "--seed", "1", "--no-database")
BUDGET = ("--time-budget", "4", "--budget-passes")  # a slower backend: its first passes suffice


def _requires(wheel_path: Path) -> dict[str, set[str]]:
    """The wheel's ``Requires-Dist`` by extra (``""``: the base install), as names."""
    with zipfile.ZipFile(wheel_path) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(z.read(name).decode())
    out: dict[str, set[str]] = {}
    for req in meta.get_all("Requires-Dist") or ():
        spec, _, marker = req.partition(";")
        extra = marker.split("extra ==")[-1].strip().strip("'\"") if "extra" in marker else ""
        out.setdefault(extra, set()).add(spec.split("=")[0].split(">")[0].strip().lower())
    return out


def test_each_extra_names_what_it_brings(wheel: tuple[Path, str]) -> None:
    requires = _requires(wheel[0])
    assert requires[""] == {"numpy", "hypothesis"}
    assert requires["torch"] == {"torch"}
    assert requires["gpu"] == {"torch", "triton"}
    assert {"torch", "triton", "pytest"} <= requires["test"]
    for module, extra in EXTRAS.items():  # what a missing import's message tells to install
        assert module in requires[extra]


def _run(bin_dir: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [str(bin_dir / "paged-spec"), *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _imports(bin_dir: Path, module: str) -> bool:
    done = subprocess.run(
        [str(bin_dir / "python"), "-c", f"import {module}"], capture_output=True, env=clean_env()
    )
    return done.returncode == 0


@pytest.mark.slow
def test_the_base_install_runs_the_suite_on_numpy_backends(
    wheel: tuple[Path, str], tmp_path: Path
) -> None:
    bin_dir = make_venv(tmp_path / "venv", wheel[0], requirements_of(["numpy", "hypothesis"]))
    assert not _imports(bin_dir, "torch") and _imports(bin_dir, "conformance")
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(EXAMPLE, project / "my_backend.py")
    for backend in ("reference", "my_backend.py:make_backend"):
        done = _run(bin_dir, project, "run", "--backend", backend, *QUICK)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "judged by: the spec's numpy float64 reference, every step" in done.stdout
        assert "torch is not installed" in done.stdout
    missing = _run(bin_dir, project, "run", "--backend", "torch", *QUICK)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "setup error" in missing.stderr and "pip install 'paged-spec[torch]'" in missing.stderr


@pytest.mark.slow
def test_the_torch_install_runs_the_torch_backend_without_triton(
    wheel: tuple[Path, str], tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    borrowed = requirements_of(["numpy", "hypothesis", "torch"])
    assert "triton" not in borrowed, "torch's CPU build brings no Triton"
    bin_dir = make_venv(tmp_path / "venv", wheel[0], borrowed)
    assert _imports(bin_dir, "torch") and not _imports(bin_dir, "triton")
    done = _run(bin_dir, tmp_path, "run", "--backend", "torch", *QUICK, *BUDGET)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "judged by: " not in done.stdout  # torch is here: the usual references
    missing = _run(bin_dir, tmp_path, "run", "--backend", "triton", *QUICK)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "pip install 'paged-spec[gpu]'" in missing.stderr
