"""What running the backend in a child process costs: one seed, isolated and in process.

    python -m benchmarks.isolation --backend torch --seed 20240601

Runs ``python -m conformance run`` twice on the same seed (so on the same
workloads, step for step), once as usual (the backend in a child process) and
once with ``--in-process``, and prints each wall time and their ratio. On a
shared machine, run it more than once: the ratio of one pair is only as good as
the machine's quiet.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time


def _run(backend: str, seed: int, extra: list[str]) -> tuple[float, str]:
    argv = [sys.executable, "-m", "conformance", "run", "--backend", backend]
    argv += ["--seed", str(seed), "--no-database", *extra]
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    summary = re.search(r"^  (\d+ examples.*?), [\d.]+ s$", done.stdout, re.MULTILINE)
    return seconds, summary.group(1) if summary else "?"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--seed", type=int, default=20240601)
    args = parser.parse_args(argv)
    isolated, what = _run(args.backend, args.seed, [])
    in_process, what_too = _run(args.backend, args.seed, ["--in-process"])
    print(f"backend {args.backend}, seed {args.seed}: {what}")
    if what != what_too:
        print(f"  (in process it ran {what_too}: not the same workload)")
    print(f"  isolated (child process): {isolated:7.1f} s")
    print(f"  in process:               {in_process:7.1f} s")
    print(f"  ratio isolated / in process: {isolated / in_process:.3f}")


if __name__ == "__main__":
    main()
