"""Suite time per step under each contract: numpy (the default) and device-resident, one run.

Run ``python -m benchmarks.device_contract`` (``--seqs``, ``--context``,
``--decodes``, ``--layers``, ``--repeats``). It drives the same lockstep
workload on the eager torch backend three times: under the numpy contract
(the suite compares the whole pool after every step, as it does for any pool
of at most :data:`conformance.lockstep.driver.WHOLE_POOL_SLOTS` slots), under the
numpy contract comparing only the blocks each step wrote (what the device
contract compares, so the two differ only in how data crosses), and under the
device-resident contract (``tensors="torch"``: metadata built once per step on
the device, tensors in and out, only the compared blocks read back). The
workload: head dim 64, 8 query heads on 2 KV heads, blocks of 16, float16,
``--seqs`` sequences (8) prefilled to ``--context`` tokens (256) in chunks of
128, then ``--decodes`` steps (16) of one token for every sequence.

It prints, per contract and kind of step, the time per step (suite and
backend together: where the conversions happen differs between the
contracts, so only the sum compares) and the backend's share, then the ratio
of each numpy row to the device row. Times are this process's CPU time on one
torch thread (other processes on a busy machine do not count), each the best
of ``--repeats`` runs (3), interleaved, so that drift slows each contract
alike.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from backend_gpu.torch_backend import TorchBackend, make_device_backend
from benchmarks.conformance import _Timed, workload_steps
from conformance.lockstep.driver import Lockstep
from conformance.lockstep.kv_check import WHOLE_POOL_SLOTS
from conformance.lockstep.workload import WorkloadConfig, scale_for
from paged_spec._cli import positive_int
from spec.kv_budget import cdiv
from spec.kv_geometry import KVGeometry

__all__ = ["main"]

CONTRACTS: tuple[tuple[str, Callable[[], TorchBackend], int], ...] = (
    ("numpy (default: whole pool each step)", lambda: TorchBackend("cpu"), WHOLE_POOL_SLOTS),
    ("numpy, step blocks only", lambda: TorchBackend("cpu"), 0),
    ("device (tensors='torch')", lambda: make_device_backend("cpu"), WHOLE_POOL_SLOTS),
)
"""Name, backend factory and the lockstep's ``whole_pool_slots`` of each measured contract."""


@dataclass(frozen=True)
class Timing:
    """One contract's per-step wall time and backend time, in seconds, per kind of step."""

    contract: str
    prefill_s: float
    prefill_backend_s: float
    decode_s: float
    decode_backend_s: float


def run_once(
    contract: int, seqs: int, context: int, decodes: int, layers: int, chunk: int = 128
) -> Timing:
    """The module docstring's workload under ``CONTRACTS[contract]``: seconds per step."""
    name, factory, whole = CONTRACTS[contract]
    block, heads, kv_heads, head_dim = 16, 8, 2, 64
    per_seq = cdiv(context + decodes, block) + 1
    geometry = KVGeometry(layers, seqs * per_seq, block, kv_heads, head_dim, "float16")
    config = WorkloadConfig(geometry, heads, scale_for(head_dim, False), seed=1)
    timed = _Timed(factory(), clock=time.process_time)
    ls = Lockstep(timed, config, whole_pool_slots=whole)
    prefill, decode = workload_steps(ls, seqs, context, chunk, decodes)
    p_total, p_backend = _per_step(timed, prefill)
    d_total, d_backend = _per_step(timed, decode)
    ls.finish()
    return Timing(name, p_total, p_backend, d_total, d_backend)


def _per_step(timed: _Timed, steps: Sequence[Callable[[], object]]) -> tuple[float, float]:
    before, start = timed.seconds, time.process_time()
    for step in steps:
        step()
    n = max(len(steps), 1)
    return (time.process_time() - start) / n, (timed.seconds - before) / n


def run(seqs: int, context: int, decodes: int, layers: int, repeats: int) -> list[Timing]:
    """Each contract's best per-step times over ``repeats`` interleaved runs."""
    runs: list[list[Timing]] = [[] for _ in CONTRACTS]
    for _ in range(repeats):
        for i in range(len(CONTRACTS)):
            runs[i].append(run_once(i, seqs, context, decodes, layers))
    return [
        Timing(
            r[0].contract,
            min(t.prefill_s for t in r),
            min(t.prefill_backend_s for t in r),
            min(t.decode_s for t in r),
            min(t.decode_backend_s for t in r),
        )
        for r in runs
    ]


def table(timings: Sequence[Timing]) -> list[str]:
    """The per-step table, and each row's ratio to the device contract's (the last row)."""
    device = timings[-1]
    lines = [
        "| contract | prefill ms/step (backend) | decode ms/step (backend) "
        "| prefill / device | decode / device |",
        "|---|---|---|---|---|",
    ]
    for t in timings:
        lines.append(
            f"| {t.contract} | {t.prefill_s * 1e3:.1f} ({t.prefill_backend_s * 1e3:.1f}) "
            f"| {t.decode_s * 1e3:.1f} ({t.decode_backend_s * 1e3:.1f}) "
            f"| {t.prefill_s / device.prefill_s:.2f} | {t.decode_s / device.decode_s:.2f} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.device_contract", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seqs", type=positive_int, default=8)
    parser.add_argument("--context", type=positive_int, default=256)
    parser.add_argument("--decodes", type=positive_int, default=16)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time then measures the work, not threads spinning
    try:
        timings = run(args.seqs, args.context, args.decodes, args.layers, args.repeats)
    finally:
        torch.set_num_threads(threads)
    print(
        f"Lockstep on the torch backend (cpu), {args.layers} layers, head dim 64, 8/2 heads, "
        f"block 16, float16, {args.seqs} sequences of {args.context} tokens, "
        f"{args.decodes} decode steps; CPU ms, best of {args.repeats} (one run)"
    )
    for line in table(timings):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
