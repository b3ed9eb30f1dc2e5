"""``pip install 'paged-spec[gpu]'`` beside an engine's stack leaves its torch and Triton alone.

vLLM and SGLang pin their own torch (torch 2.11 with Triton 3.6 on the GPU
machines the project runs on), so the extras take ranges (``torch>=2.11``,
``triton>=3.6``) and the project's own exact releases live in constraints.txt.
Two checks, each in a fresh virtual environment that already holds an older
torch and Triton the ranges allow, with ``pip install --no-index``, so pip can
only keep what is there or fail:

* **the resolver**, beside torch 2.11.0 and Triton 3.6.0 as an engine installs
  them (their metadata only: PyPI's torch 2.11 is a multi-GB CUDA build): pip
  would install paged-spec and nothing else;
* **a real install and run**, beside the CPU build of torch already in this
  environment and Triton 3.6.0 (older than constraints.txt's 3.9.0, fetched from
  PyPI once and cached, as tests/test_interpreter_ptx.py does): both are left as
  they were, and the suite runs there (the reference, and the flex adapter).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from wheel_fixture import ROOT, clean_env, requirements_of, wheel

__all__ = ["wheel"]  # the session fixture, imported for pytest

OLDER_TORCH, OLDER_TRITON = "2.11.0", "3.6.0"
CACHE = Path(os.environ.get("PAGED_SPEC_CACHE", Path.home() / ".cache" / "paged-spec"))
QUICK = ("--max-examples", "1", "--seed", "1", "--no-database", "--time-budget", "20",
         "--budget-passes")  # fmt: skip


def _venv(where: Path, paths: list[Path]) -> Path:
    """A virtual environment without pip whose sys.path also holds ``paths``; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "borrowed.pth").write_text("".join(f"{p}\n" for p in paths))
    return python


def _borrowed(where: Path, names: set[str]) -> Path:
    """A folder of links to this environment's distributions ``names`` (tests/wheel_fixture's
    way: no index, no download)."""
    import importlib.metadata as md

    where.mkdir()
    for name in names:
        dist = md.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or () if ".." not in str(f)}:
            origin = Path(str(dist.locate_file(top)))
            if origin.exists() and not (where / top).exists():
                (where / top).symlink_to(origin)
    return where


def _stub(where: Path, name: str, version: str) -> Path:
    """A distribution's metadata alone: installed, as far as pip can tell."""
    info = where / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    return where


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pip", "--python", str(python), *args]
    return subprocess.run(command, capture_output=True, text=True, env=clean_env(), timeout=600)


def _older_triton() -> Path:
    """Triton 3.6's package, unpacked under the cache (shared with test_interpreter_ptx)."""
    target = CACHE / f"triton-{OLDER_TRITON}"
    if (target / "triton" / "__init__.py").exists():
        return target
    wheels = CACHE / f"wheels.{os.getpid()}"
    wheels.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", f"triton=={OLDER_TRITON}", "--no-deps",
         "--only-binary", ":all:", "-d", str(wheels), "-q"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if got.returncode != 0:
        why = f"could not fetch triton=={OLDER_TRITON} from PyPI:\n{got.stderr[-2000:]}"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI reaches PyPI: a failure here is a failure
        pytest.skip(f"{why}\n(an offline machine: run this test where PyPI is reachable)")
    wheel_file = next(wheels.glob(f"triton-{OLDER_TRITON}-*.whl"))
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    with zipfile.ZipFile(wheel_file) as z:
        for info in z.infolist():
            z.extract(info, partial)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                (partial / info.filename).chmod(mode)
    try:
        partial.rename(target)
    except OSError:  # another worker unpacked it first
        shutil.rmtree(partial)
    shutil.rmtree(wheels)
    return target


def test_the_extras_are_ranges_and_the_pins_are_constraints(wheel: tuple[Path, str]) -> None:
    with zipfile.ZipFile(wheel[0]) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [line for line in z.read(meta).decode().splitlines() if "extra ==" in line]
    for extra in ("torch", "gpu", "test"):
        assert f'Requires-Dist: torch>=2.11; extra == "{extra}"' in requires
    assert 'Requires-Dist: triton>=3.6; extra == "gpu"' in requires
    assert not [line for line in requires if "==" in line.split(";")[0]]  # no exact pin
    pins = (ROOT / "constraints.txt").read_text().splitlines()
    assert "torch==2.13.0" in pins and "triton==3.9.0" in pins
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


@pytest.mark.slow
def test_pip_keeps_the_engines_torch_and_triton(wheel: tuple[Path, str], tmp_path: Path) -> None:
    stack = _stub(_stub(tmp_path / "engine", "torch", OLDER_TORCH), "triton", OLDER_TRITON)
    base = _borrowed(tmp_path / "base", requirements_of(["numpy", "hypothesis"]))
    python = _venv(tmp_path / "venv", [stack, base])
    report = tmp_path / "report.json"
    done = _pip(
        python, "install", "--no-index", "--dry-run", "--report", str(report), f"{wheel[0]}[gpu]"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["paged-spec"]


@pytest.mark.slow
def test_flex_runs_from_the_torch_extra_and_the_triton_adapters_say_what_to_install(
    wheel: tuple[Path, str], tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    borrowed = requirements_of(["numpy", "hypothesis", "torch"])
    python = _venv(tmp_path / "venv", [_borrowed(tmp_path / "base", borrowed)])
    done = _pip(python, "install", "--no-index", "--no-deps", "-q", str(wheel[0]))
    assert done.returncode == 0, done.stdout + done.stderr
    env = clean_env(OMP_NUM_THREADS="1", PAGED_SPEC_CACHE=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    script = str(python.parent / "paged-spec")

    def paged_spec(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [script, "run", "--backend", *argv, *QUICK],
            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip

    flex = paged_spec("flex", "--poison", "finite")
    assert flex.returncode == 0, flex.stdout[-3000:] + flex.stderr[-3000:]
    verdict = flex.stdout.splitlines()[0]  # a loaded machine may spend the 20 s budget first
    assert verdict.startswith("conformance: backend 'flex' (profile quick, seed 1): "), verdict
    assert ": PASSED (" in verdict or ": PARTIAL: passed within the time budget" in verdict
    assert verdict.endswith(
        "(reads of slots no token owns were not judged for NaN: --poison finite)"
    )
    vllm = paged_spec("vllm-unified")
    assert vllm.returncode == 2, vllm.stdout[-3000:] + vllm.stderr[-3000:]
    assert "pip install 'paged-spec[gpu]'" in vllm.stderr
    assert not (tmp_path / "cache").exists()  # refused before fetching anything


@pytest.mark.slow
def test_an_install_beside_an_older_triton_leaves_it_and_runs(
    wheel: tuple[Path, str], tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    older = _older_triton()
    borrowed = requirements_of(["numpy", "hypothesis", "torch"])
    assert "triton" not in borrowed, "torch's CPU build brings no Triton"
    base = _borrowed(tmp_path / "base", borrowed)
    python = _venv(tmp_path / "venv", [base, older])
    versions = "import torch, triton; print(torch.__version__, triton.__version__)"

    def installed() -> str:
        done = subprocess.run([python, "-c", versions], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    before = installed()
    assert before.endswith(f" {OLDER_TRITON}")
    done = _pip(python, "install", "--no-index", "-q", f"{wheel[0]}[gpu]")
    assert done.returncode == 0, done.stdout + done.stderr
    assert installed() == before  # pip needed nothing it did not have, and changed nothing
    env = clean_env(OMP_NUM_THREADS="1", PAGED_SPEC_CACHE=str(CACHE))
    env.pop("TRITON_INTERPRET", None)
    script = python.parent / "paged-spec"
    # The Triton backend is not run here: Triton 3.6's interpreter converts a one-element
    # array with int() (its tensor __index__), which numpy 2.4 refuses; compiled on a GPU,
    # where that Triton is used, there is no interpreter.
    for backend in (("reference",), ("flex", "--poison", "finite")):
        run = subprocess.run(
            [str(script), "run", "--backend", *backend, *QUICK],
            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
