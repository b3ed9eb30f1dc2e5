"""Where the tests run the kernels, and which tests need which: the rule, in one place.

Triton picks compiled or interpreted when a kernel is decorated (``TRITON_INTERPRET``,
which :mod:`backend_gpu` sets on a machine without CUDA), so one test process tests one
thing: kernels interpreted on CPU tensors, or kernels compiled for CUDA tensors.

* ``make test`` sets ``TRITON_INTERPRET=1``: kernels are interpreted on the CPU on every
  machine. On a CUDA machine the session hides the GPU (``tests/conftest.py``), so that
  every default device is the CPU's and the run is CI's run.
* Without ``TRITON_INTERPRET`` on a CUDA machine, kernels compile and :data:`DEVICE` is the
  GPU: the backend tests build their tensors there. That is the GPU check's run of the
  modules ``benchmarks/gpu_check.py`` lists (``BACKEND_TESTS``), from the repository root:
  ``env -u TRITON_INTERPRET CI=true OMP_NUM_THREADS=1 python -m pytest -q -n 8 ...``.

Two marks (registered in ``pyproject.toml``; ``tests/conftest.py`` turns them into skips
that say why): ``needs_interpreter`` for a test whose subject is the interpreter, and
``gpu_only`` for one whose subject is compiled kernels on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import backend_gpu  # noqa: F401  (sets TRITON_INTERPRET without CUDA, before any kernel exists)
from backend_gpu.kernels._checks import interpreting

ROOT = Path(__file__).resolve().parents[1]

INTERPRETED = interpreting()
"""Whether this process interprets the kernels (CPU tensors) rather than compiling them."""
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
"""Where the kernels under test run, and so where the tests build their tensors."""
ON_GPU = DEVICE.type == "cuda"

NEEDS_INTERPRETER = (
    "needs Triton's interpreter: this process compiles the kernels "
    "(make test sets TRITON_INTERPRET=1 and runs it)"
)
GPU_ONLY = (
    "compiled kernels on a CUDA device: this process interprets them on the CPU "
    "(on a CUDA machine, run the GPU tests without TRITON_INTERPRET: see tests/devices.py)"
)
MARKS = {
    "needs_interpreter": (not INTERPRETED, NEEDS_INTERPRETER),
    "gpu_only": (not ON_GPU, GPU_ONLY),
}
"""Each mark: whether it skips in this process, and the reason it gives."""


def interpreted_env() -> dict[str, str]:
    """This process's environment for a child that interprets the kernels on the CPU
    (``TRITON_INTERPRET=1``, the GPU hidden as ``make test`` hides it)."""
    return {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def run_interpreted(script: Path, *args: str, timeout: float = 300) -> str:
    """Run ``script`` with the kernels interpreted, in a child; its stdout, or a failure
    carrying its stderr."""
    done = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        env={**interpreted_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{script.name} failed interpreted:\n{done.stderr[-4000:]}"
    return done.stdout
