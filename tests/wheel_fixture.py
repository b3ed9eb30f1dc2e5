"""The project's wheel, built once per session from a clean copy of the sources, and clean
virtual environments to install it into (tests/test_packaging.py, tests/test_install_extras.py).

An environment gets only the distributions it is given, borrowed from this one through a
folder of links named by a path file: no index, no download, and nothing else importable
(``import torch`` fails in one that was not given torch). ``requirements_of`` closes a list
of distributions over what each requires (extras aside), as pip would install them.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "build", "*.egg-info", "__pycache__", ".hypothesis", ".mypy_cache",
    ".pytest_cache", ".ruff_cache", "site", "out", "mutants", ".whl", "node_modules",
)  # fmt: skip
"""What the repository's .gitignore leaves out: never part of a build."""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the repository on the path or a byte-compiling veto.

    ``PYTHONDONTWRITEBYTECODE`` makes setuptools print "byte-compiling is
    disabled", which is about the machine, not the package.
    """
    drop = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTEST_ADDOPTS", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PAGED_SPEC_")}
    return {**env, **extra}


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel, built from a clean copy of the sources; and everything the build printed.

    Built once per session: each test module that imports the fixture finds the wheel of
    the first under the session's base temporary directory.
    """
    work = tmp_path_factory.getbasetemp() / "wheel"
    log = work / "build.txt"
    if log.exists():
        (built,) = (work / "dist").glob("paged_spec-*.whl")
        return built, log.read_text()
    work.mkdir()
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=_IGNORED)
    # setuptools from this environment when it has it (no index needed), else pip's isolated build
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    dist = work / "dist"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", source, "--no-deps", "-v", "-w", dist, *isolation],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    (built,) = (work / "dist").glob("paged_spec-*.whl")
    log.write_text(output)
    return built, output


def requirements_of(names: Iterable[str]) -> set[str]:
    """``names`` and every distribution they require, transitively (extras left out)."""
    todo, found = [_canonical(n) for n in names], set()
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for req in md.requires(name) or ():
            spec, _, marker = req.partition(";")
            if "extra" in marker:
                continue
            assert not marker.strip(), f"{name} requires {req!r}: a marker this helper ignores"
            todo.append(_canonical(re.match(r"[A-Za-z0-9._-]+", spec.strip())[0]))  # type: ignore[index]
    return found


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def make_venv(where: Path, wheel_path: Path, borrowed: Iterable[str]) -> Path:
    """A new virtual environment holding the wheel (installed without its dependencies) and the
    ``borrowed`` distributions of this environment, nothing else; its ``bin`` folder."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120
    )
    bin_dir = where / ("Scripts" if os.name == "nt" else "bin")
    purelib = subprocess.run(
        [bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    links = where / "borrowed"
    links.mkdir()
    for name in borrowed:
        dist = md.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            origin = Path(str(dist.locate_file(top)))
            if origin.exists() and not (links / top).exists():
                (links / top).symlink_to(origin)
    Path(purelib, "borrowed.pth").write_text(f"{links}\n")
    install = [sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install"]
    quiet = [*install, "--no-deps", "-q", str(wheel_path)]
    subprocess.run(quiet, check=True, env=clean_env(), timeout=300)
    return bin_dir


def everything_here() -> Path:
    """This environment's own packages folder (what the full test set installs)."""
    return Path(sysconfig.get_paths()["purelib"])
