"""What the conformance suite costs per step beside the backend it checks, at a production shape.

Run ``python -m benchmarks.conformance`` (``--seqs``, ``--context``,
``--decodes`` to change the workload). It drives one lockstep workload on the
eager torch backend: head dim 128, 32 query heads on 8 KV heads, blocks of
16, float16, ``--seqs`` sequences (64) prefilled to ``--context`` tokens
(512) in chunks of 256, then ``--decodes`` steps (8) of one token for every sequence, the
step a serving engine runs most. Every backend call is timed; the rest of
each step (the spec's block manager and memory, the float64 and the
same-precision reference, the comparisons, the ground truth) is the suite's
own time. It prints, per kind of step, both times per step and their ratio,
in one run.

The backend is timed as it runs here (on this machine's CPU unless torch
sees a GPU); the ratio says whether the suite, not the backend, dominates a
run at these sizes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from backend_gpu.torch_backend import TorchBackend
from benchmarks.conformance_device import ORACLES, table
from conformance.lockstep.driver import Lockstep
from conformance.lockstep.workload import WorkloadConfig, scale_for
from spec.kv_budget import cdiv
from spec.kv_geometry import KVGeometry

__all__ = ["main"]


@dataclass
class _Timed:
    """A backend whose every method call adds its time (by ``clock``) to ``seconds``."""

    inner: Any
    seconds: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    clock: Callable[[], float] = time.perf_counter

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def timed(*args: object, **kwargs: object) -> object:
            start = self.clock()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += self.clock() - start
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


@dataclass(frozen=True)
class _Row:
    kind: str
    steps: int
    total_s: float
    backend_s: float

    def line(self) -> str:
        suite = self.total_s - self.backend_s
        per = 1000.0 / max(self.steps, 1)
        return (
            f"| {self.kind} | {self.steps} | {suite * per:.1f} | {self.backend_s * per:.1f} "
            f"| {suite / self.backend_s:.2f} |"
        )


def _measure(timed: _Timed, kind: str, steps: Sequence[Callable[[], object]]) -> _Row:
    before, start = timed.seconds, time.perf_counter()
    for step in steps:
        step()
    return _Row(kind, len(steps), time.perf_counter() - start, timed.seconds - before)


def workload_steps(
    ls: Lockstep, seqs: int, context: int, chunk: int, decodes: int
) -> tuple[list[Callable[[], object]], list[Callable[[], object]]]:
    """Add ``seqs`` random prompts of ``context`` tokens; their prefill and decode steps, to run."""
    rng = np.random.default_rng(0)
    prompts = {s: [int(t) for t in rng.integers(0, 64, context)] for s in range(seqs)}
    for s, prompt in prompts.items():
        ls.add(s, prompt)
    prefill: list[Callable[[], object]] = [
        partial(ls.step, [(s, p[lo : lo + chunk]) for s, p in prompts.items()])
        for lo in range(0, context, chunk)
    ]
    decode: list[Callable[[], object]] = [
        partial(ls.step, [(s, [(s + i) % 64]) for s in prompts]) for i in range(decodes)
    ]
    return prefill, decode


def run(seqs: int, context: int, decodes: int, chunk: int = 256) -> list[_Row]:
    """The workload of the module docstring; one row per kind of step."""
    block, heads, kv_heads, head_dim = 16, 32, 8, 128
    per_seq = cdiv(context + decodes, block) + 1
    geometry = KVGeometry(1, seqs * per_seq, block, kv_heads, head_dim, "float16")
    config = WorkloadConfig(geometry, heads, scale_for(head_dim, False), seed=1)
    timed = _Timed(TorchBackend())
    start = time.perf_counter()
    ls = Lockstep(timed, config)
    rows = [_Row("create and prime the pool", 1, time.perf_counter() - start, timed.seconds)]
    prefill, decode = workload_steps(ls, seqs, context, chunk, decodes)
    rows.append(_measure(timed, f"prefill ({seqs} chunks of up to {chunk} tokens)", prefill))
    rows.append(_measure(timed, f"decode ({seqs} sequences, context ~{context})", decode))
    rows.append(_measure(timed, "end of the workload (whole pool, mean and bias)", [ls.finish]))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.conformance")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument(
        "--device-shapes",
        action="store_true",
        help="per kind of device-envelope step: backend, reference, comparison and bookkeeping "
        "time and peak memory, numpy reference beside the fast one (benchmarks.conformance_device)",
    )
    parser.add_argument(
        "--scale", type=int, default=1, help="with --device-shapes: divide seqs and lengths by N"
    )
    parser.add_argument(
        "--oracles",
        default=",".join(ORACLES),
        help=f"with --device-shapes: the oracles to run, comma-separated ({', '.join(ORACLES)})",
    )
    args = parser.parse_args(argv)
    if args.scale < 1:
        parser.error(f"--scale must be at least 1, got {args.scale}")
    oracles = tuple(o.strip() for o in args.oracles.split(",") if o.strip())
    unknown = [o for o in oracles if o not in ORACLES]
    if unknown or not oracles:
        parser.error(f"--oracles: expected some of {', '.join(ORACLES)}, got {args.oracles!r}")
    if args.device_shapes:
        print(
            f"Suite vs torch backend per step, head dim 128, 32/8 heads, block 16, float16, "
            f"shapes divided by {args.scale} (one run each, fresh process)"
        )
        print("\n".join(table(args.scale, oracles)))
        return 0
    rows = run(args.seqs, args.context, args.decodes)
    print(
        f"Conformance suite vs torch backend, head dim 128, 32/8 heads, block 16, float16, "
        f"{args.seqs} sequences of {args.context} tokens (one run)"
    )
    print("| step | steps | suite ms/step | backend ms/step | suite / backend |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(row.line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
