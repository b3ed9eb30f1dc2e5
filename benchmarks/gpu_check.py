"""The GPU check: decode bandwidth, the SDPA baseline and the suite on the device, in one JSON.

Given a CUDA device, within 10 minutes (``--budget``, default 540 s):

1. the Triton backend's decode kernel on B=64 sequences at 4,096 tokens of
   context, fp16, 32 query / 8 KV heads, head dim 128, blocks of 16: its time
   and achieved bandwidth beside the device's copy bandwidth, measured in the
   same run (:mod:`benchmarks.attention`);
2. the same workload on ``torch.nn.functional.scaled_dot_product_attention``
   over a contiguous copy of the cache (the baseline), and the largest
   difference between the two;
3. ``python -m conformance run --profile quick`` on the Triton backend under
   the device-resident contract (``make_device_backend``), with the device
   envelope (its ``capabilities.device`` is the GPU) and the fast reference
   on the GPU, bounded by the time left (``--time-budget``).

Every figure goes in the JSON file ``--out``. **GPU figures come only from a
GPU**: without CUDA the check exits 2 saying so, and ``--dry-run`` writes the
JSON's shape (every figure ``null``, ``"gpu_figures": false``) without running
anything, which is how the tests exercise it on a CPU.

    python -m benchmarks.gpu_check --out gpu_check.json      # or benchmarks/gpu_check.sh
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMA = 1
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


def conformance_command(budget_s: float, report: Path) -> list[str]:
    """The suite's run on the Triton backend under the device contract, bounded by ``budget_s``."""
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
        "--time-budget",
        f"{max(budget_s, 1.0):.0f}",
        "--report",
        str(report),
    ]


def skeleton(device: str) -> dict[str, Any]:
    """The JSON with every figure ``None``: what a dry run writes, and what a run fills in."""
    return {
        "schema": SCHEMA,
        "gpu_figures": False,
        "note": NOTE,
        "device": device,
        "device_name": None,
        "workload": dict(WORKLOAD),
        "decode": dict.fromkeys(DECODE_FIGURES),
        "conformance": {
            "command": conformance_command(0, Path("REPORT.json"))[1:],
            "exit_code": None,
            "verdict": None,
            "wall_s": None,
            "examples": None,
            "steps": None,
            "oracles": None,
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


def _conformance(budget_s: float, out: dict[str, Any]) -> None:
    """Step 3, in a child process; its report's verdict and counts go in ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = conformance_command(budget_s, report)
        start = time.monotonic()
        try:
            done = subprocess.run(command, timeout=budget_s + 60, check=False)
            out["exit_code"] = done.returncode
        except subprocess.TimeoutExpired:
            out["exit_code"] = None
            out["verdict"] = f"did not finish within {budget_s + 60:.0f} s"
        out["wall_s"] = time.monotonic() - start
        out["command"] = command[1:]
        if report.exists():
            data = json.loads(report.read_text())
            out["verdict"] = data.get("verdict", out.get("verdict"))
            out["examples"], out["steps"] = data.get("examples"), data.get("steps")
            out["oracles"] = {
                k: v for k, v in data.get("invariants", {}).items() if "judged by" in k
            }


def run(device: str, budget_s: float, skip_conformance: bool = False) -> dict[str, Any]:
    """Every figure of the check on ``device``; raises :class:`SystemExit` (2) without CUDA."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise SystemExit(
            f"gpu_check: no CUDA device ({device!r}); {NOTE}. --dry-run writes the JSON's shape"
        )
    start = time.monotonic()
    result = skeleton(device)
    result["device_name"] = torch.cuda.get_device_name(torch.device(device))
    _decode_figures(device, result["decode"])
    result["gpu_figures"] = True
    if not skip_conformance:
        _conformance(budget_s - (time.monotonic() - start) - 30, result["conformance"])
    result["wall_s"] = time.monotonic() - start
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=NOTE)
    parser.add_argument("--out", required=True, metavar="FILE.json", help="where every figure goes")
    parser.add_argument("--device", default="cuda:0", help="the CUDA device (default cuda:0)")
    parser.add_argument(
        "--budget", type=float, default=540.0, metavar="SECONDS", help="the whole check's time"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="write the JSON's shape (no figures), run nothing"
    )
    parser.add_argument(
        "--skip-conformance", action="store_true", help="the bandwidth figures only"
    )
    args = parser.parse_args(argv)
    if not args.budget > 60:
        parser.error(f"--budget must be more than 60 seconds, got {args.budget}")
    result = (
        skeleton(args.device)
        if args.dry_run
        else run(args.device, args.budget, args.skip_conformance)
    )
    try:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    except OSError as e:
        parser.exit(2, f"gpu_check: cannot write {args.out}: {e}\n")
    print(f"gpu_check: wrote {args.out} ({'GPU figures' if result['gpu_figures'] else NOTE})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
