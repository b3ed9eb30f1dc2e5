"""The GPU check: decode bandwidth, the backend tests and the suite on the device, in one JSON.

Given a CUDA device, within 10 minutes (``--budget``, default 570 s):

1. the Triton backend's decode kernel on B=64 sequences at 4,096 tokens of
   context, fp16, 32 query / 8 KV heads, head dim 128, blocks of 16: its time
   and achieved bandwidth beside the device's copy bandwidth, measured in the
   same run (:mod:`benchmarks.attention`);
2. the same workload on ``torch.nn.functional.scaled_dot_product_attention``
   over a contiguous copy of the cache (the baseline), and the largest
   difference between the two;
3. the backend tests on the device (:data:`BACKEND_TESTS`, compiled: no
   ``TRITON_INTERPRET``): passed, failed and skipped counts;
4. ``python -m conformance run --profile quick`` on the Triton backend under
   the device-resident contract (``make_device_backend``), with the device
   envelope and the fast reference on the GPU, to completion (a PARTIAL run
   is a failed check), twice: **cold**, with an empty Triton cache, and
   **warm**, with the cache the cold run filled. Each run's report gives its
   wall time, the Triton compiles and their time apart from the backend's
   other time, and the suite's own time (:mod:`conformance.run.compiles`).
   The runs use ``--jobs`` (default: half the CPUs, at most 8): the jobs
   compile the specialisations their examples need side by side, and the
   kernels specialise on fewer runtime integers (``do_not_specialize``), so a
   cold run compiles fewer kernels (a ``quick`` run on the CPU envelope
   launches 119 distinct specialisations, 281 before).

Every figure goes in the JSON file ``--out``. **GPU figures come only from a
GPU**: without CUDA the check exits 2 saying so, and ``--dry-run`` writes the
JSON's shape (every figure ``null``, ``"gpu_figures": false``) without running
anything, which is how the tests exercise it on a CPU.

    python -m benchmarks.gpu_check --out gpu_check.json      # or benchmarks/gpu_check.sh
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.errors import SetupError
from conformance.output_files import check_output, write_output

SCHEMA = 2
NOTE = "GPU figures come only from a GPU: a dry run or a CPU machine reports none"
WORKLOAD: dict[str, Any] = {
    "batch": 64,
    "context": 4096,
    "dtype": "float16",
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "block_size": 16,
}
DECODE_FIGURES = (
    "triton_us",
    "triton_gbps",
    "copy_gbps",
    "share_of_copy_bandwidth",
    "sdpa_us",
    "speedup_over_sdpa",
    "max_abs_diff_vs_sdpa",
)
CONFORMANCE_BACKEND = "backend_gpu.triton_backend:make_device_backend"
BACKEND_TESTS = (
    "tests/test_backend_kernels.py",
    "tests/test_backend_variants.py",
    "tests/test_backend_invalid_inputs.py",
    "tests/test_backend_contract.py",
    "tests/test_backend_latent.py",
    "tests/test_backend_groups.py",
    "tests/test_backend_speculative.py",
    "tests/test_conformance_device.py",
    "tests/test_gpu_check.py",
    "tests/test_gpu_compiled.py",
)
"""What step 3 runs on the device (those of the list that exist)."""
RUN_FIGURES = (
    "exit_code",
    "verdict",
    "complete",
    "wall_s",
    "examples",
    "steps",
    "compiles",
    "compile_s",
    "backend_s",
    "suite_s",
    "specialisations",
    "oracles",
)


def default_jobs() -> int:
    """Conformance jobs on this machine: half its CPUs, between 1 and 8."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def conformance_command(report: Path, jobs: int) -> list[str]:
    """The suite's run on the Triton backend under the device contract, to completion."""
    return [
        sys.executable,
        "-m",
        "conformance",
        "run",
        "--backend",
        CONFORMANCE_BACKEND,
        "--profile",
        "quick",
        "--seed",
        "1",
        "--envelope",
        "device",
        "--jobs",
        str(jobs),
        "--no-database",
        "--report",
        str(report),
    ]


def tests_command(junit: Path, workers: int) -> list[str]:
    """The backend tests, compiled on the device."""
    present = [t for t in BACKEND_TESTS if Path(t).exists()]
    return [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
        f"--junitxml={junit}", *present,
    ]  # fmt: skip


def skeleton(device: str) -> dict[str, Any]:
    """The JSON with every figure ``None``: what a dry run writes, and what a run fills in."""
    return {
        "schema": SCHEMA,
        "gpu_figures": False,
        "note": NOTE,
        "device": device,
        "device_name": None,
        "versions": None,
        "workload": dict(WORKLOAD),
        "decode": dict.fromkeys(DECODE_FIGURES),
        "tests": {
            "command": tests_command(Path("JUNIT.xml"), 1)[1:],
            "passed": None,
            "failed": None,
            "skipped": None,
            "wall_s": None,
        },
        "conformance": {
            "command": conformance_command(Path("REPORT.json"), 1)[1:],
            "cold": dict.fromkeys(RUN_FIGURES),
            "warm": dict.fromkeys(RUN_FIGURES),
        },
        "wall_s": None,
    }


def _decode_figures(device_name: str, out: dict[str, Any]) -> None:
    """Step 1 and 2 on the GPU, through :mod:`benchmarks.attention`'s own measurement."""
    import torch

    from benchmarks import attention as bench

    device = torch.device(device_name)
    copy_bw = bench.copy_bandwidth(device)
    w = WORKLOAD
    shape = bench.Shape(w["num_heads"], w["num_kv_heads"], w["head_dim"], w["block_size"])
    row = bench.measure(
        bench.decode(w["batch"], w["context"]), w["dtype"], shape, device, False, copy_bw
    )
    out.update(
        triton_us=row.time_us,
        triton_gbps=row.gbps,
        copy_gbps=copy_bw,
        share_of_copy_bandwidth=row.copy_share,
        sdpa_us=row.sdpa_us,
        speedup_over_sdpa=None if not row.sdpa_us or not row.time_us else row.sdpa_us / row.time_us,
        max_abs_diff_vs_sdpa=row.max_diff,
    )


def _compiled_env(cache: Path | None = None) -> dict[str, str]:
    """This process's environment with kernels compiled (no interpreter), and a Triton cache;
    the tests' settings (the CI Hypothesis profile, one thread per worker)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CI="true", OMP_NUM_THREADS="1")
    if cache is not None:
        env["TRITON_CACHE_DIR"] = str(cache)
    return env


def _tests(budget_s: float, out: dict[str, Any]) -> None:
    """Step 3, in a child process: the backend tests' counts from their JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = tests_command(junit, max(1, min(8, len(os.sched_getaffinity(0)))))
        start = time.monotonic()
        try:
            subprocess.run(command, env=_compiled_env(), timeout=budget_s, check=False)
        except subprocess.TimeoutExpired:
            out["failed"] = f"did not finish within {budget_s:.0f} s"
        out["wall_s"], out["command"] = time.monotonic() - start, command[1:]
        if junit.exists():
            suite = ET.parse(junit).getroot()
            suite = suite if suite.tag == "testsuite" else suite[0]
            total = int(suite.get("tests", 0))
            failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped = int(suite.get("skipped", 0))
            out.update(passed=total - failed - skipped, failed=failed, skipped=skipped)


def _conformance(budget_s: float, cache: Path, jobs: int, out: dict[str, Any]) -> None:
    """One quick run in a child process with Triton's cache in ``cache``; its report's verdict,
    completeness, counts and time split go in ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = conformance_command(report, jobs)
        start = time.monotonic()
        try:
            done = subprocess.run(
                command, env=_compiled_env(cache), timeout=max(budget_s, 1.0), check=False
            )
            out["exit_code"] = done.returncode
        except subprocess.TimeoutExpired:
            out["verdict"] = f"did not finish within {budget_s:.0f} s"
        out["wall_s"] = time.monotonic() - start
        if report.exists():
            data = json.loads(report.read_text())
            split = data.get("time_split") or {}
            backend = split.get("backend_s")
            wall = split.get("wall_s")
            out.update(
                verdict=data.get("verdict", out.get("verdict")),
                complete=data.get("complete"),
                examples=data.get("examples"),
                steps=data.get("steps"),
                compiles=split.get("compiles"),
                compile_s=split.get("compile_s"),
                backend_s=backend,
                suite_s=None if backend is None or wall is None else wall * jobs - backend,
                specialisations=(data.get("specialisations") or {}).get("total"),
                oracles={k: v for k, v in data.get("invariants", {}).items() if "judged by" in k},
            )


def run(device: str, budget_s: float, jobs: int, skip_conformance: bool = False) -> dict[str, Any]:
    """Every figure of the check on ``device``; raises :class:`SystemExit` (2) without CUDA."""
    import torch
    import triton

    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise SystemExit(
            f"gpu_check: no CUDA device ({device!r}); {NOTE}. --dry-run writes the JSON's shape"
        )
    start = time.monotonic()
    result = skeleton(device)
    result["device_name"] = torch.cuda.get_device_name(torch.device(device))
    result["versions"] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    _decode_figures(device, result["decode"])
    result["gpu_figures"] = True

    def left() -> float:
        return budget_s - (time.monotonic() - start)

    _tests(min(180.0, left() - 240), result["tests"])
    if not skip_conformance:
        with tempfile.TemporaryDirectory() as cache:
            runs = result["conformance"]
            runs["command"] = conformance_command(Path("REPORT.json"), jobs)[1:]
            _conformance(left() - 90, Path(cache), jobs, runs["cold"])  # an empty cache
            _conformance(left() - 10, Path(cache), jobs, runs["warm"])  # the one just filled
    result["wall_s"] = time.monotonic() - start
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=NOTE)
    parser.add_argument("--out", required=True, metavar="FILE.json", help="where every figure goes")
    parser.add_argument("--device", default="cuda:0", help="the CUDA device (default cuda:0)")
    parser.add_argument(
        "--budget", type=float, default=570.0, metavar="SECONDS", help="the whole check's time"
    )
    parser.add_argument(
        "--jobs", type=int, default=None, help="conformance jobs (default: half the CPUs, <= 8)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="write the JSON's shape (no figures), run nothing"
    )
    parser.add_argument(
        "--skip-conformance", action="store_true", help="the bandwidth figures and tests only"
    )
    args = parser.parse_args(argv)
    if not args.budget > 60:
        parser.error(f"--budget must be more than 60 seconds, got {args.budget}")
    if args.jobs is not None and not 1 <= args.jobs <= 64:
        parser.error(f"--jobs must be 1 to 64, got {args.jobs}")
    jobs = default_jobs() if args.jobs is None else args.jobs
    try:  # before minutes of checks, not after
        check_output(Path(args.out), "--out")
    except SetupError as e:
        parser.exit(2, f"gpu_check: {e}\n")
    result = (
        skeleton(args.device)
        if args.dry_run
        else run(args.device, args.budget, jobs, args.skip_conformance)
    )
    try:
        write_output(Path(args.out), json.dumps(result, indent=2) + "\n")
    except (OSError, SetupError) as e:
        parser.exit(2, f"gpu_check: cannot write {args.out}: {e}\n")
    print(f"gpu_check: wrote {args.out} ({'GPU figures' if result['gpu_figures'] else NOTE})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
