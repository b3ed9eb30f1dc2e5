"""What bounds checking costs: one Triton attention call, unchecked and under the checker.

Run ``python -m benchmarks.bounds`` (``--repeats N``; ``--quick``: a tiny step,
one repeat, to check that it runs). The kernels run under Triton's interpreter
(the only place the checker works); one call is a mixed step of a realistic
shape: a 96-token prefill and six decodes with contexts of 40 to 700 tokens,
block size 16, 8 query and 2 KV heads of dim 32, split-KV forced to 4 splits.
Each mode (unchecked, default, strict) is timed ``--repeats`` times in CPU time
of this process (so that other jobs on a shared machine do not count), in a
rotating order (so that no mode always runs first); the medians and their
ratios to the unchecked run are printed. Outside ``watch`` nothing is hooked,
so an unchecked run costs exactly what it did before the checker existed.

``--suite N`` measures a run of the suite instead: ``N`` short examples of the
quick profile on the Triton backend (one seed, so each mode runs the same
workloads; no long-context examples, no shrinking), unchecked and with
``--check-bounds`` in each mode, in CPU time, with the ratio to the unchecked run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

import backend_gpu  # noqa: F401  (interpreter on CPU-only machines, before triton)
from backend_gpu.triton_backend import TritonBackend
from benchmarks._batches import context_step
from conformance.bounds.checker import MODES, BoundsChecker
from conformance.run.control import RunControl
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from spec.batch import BatchMetadata
from spec.block_manager import BlockManager
from spec.kv_budget import cdiv
from spec.kv_geometry import KVGeometry

__all__ = ["main"]

_WORK = [(0, 96), (40, 1), (130, 1), (257, 1), (400, 1), (511, 1), (700, 1)]  # (context, new)
_QUICK = [(0, 5), (20, 1)]
_B, _KV_HEADS, _GROUP, _D = 16, 2, 4, 32


def _step(work: Sequence[tuple[int, int]]) -> tuple[TritonBackend, BatchMetadata, np.ndarray]:
    """A backend whose cache holds the batch's KV, the batch, and its queries."""
    rng = np.random.default_rng(0)
    blocks = sum(cdiv(c + n, _B) for c, n in work) + 1
    manager = BlockManager(blocks, _B)
    batch, _ = context_step(manager, work)
    backend = TritonBackend(device="cpu", num_splits=4)
    backend.create_cache(KVGeometry(1, blocks, _B, _KV_HEADS, _D))
    slots = list(range(blocks * _B))
    kv = rng.standard_normal((len(slots), _KV_HEADS, _D)).astype(np.float32)
    backend.write_kv(0, kv, -kv, slots)
    query = rng.standard_normal((batch.num_tokens, _KV_HEADS * _GROUP, _D)).astype(np.float32)
    return backend, batch, query


def _timed(fn: Callable[[], object]) -> float:
    """CPU seconds of this process: other jobs on a shared machine do not count."""
    start = time.process_time()
    fn()
    return time.process_time() - start


_SUITE_SEED = 20240601


def _suite(examples: int) -> None:
    """Print the suite's CPU time on the Triton backend unchecked and in each bounds mode."""

    def run(mode: str | None, count: int) -> RunResult:
        control = RunControl(shrink=False, long_examples=0, check_bounds=mode)
        result = run_suite(
            TritonBackend(device="cpu"),
            "triton",
            run_seed=_SUITE_SEED,
            database=None,
            max_examples=count,
            control=control,
            passes=("short",),
        )
        assert result.passed, result.difference
        return result

    run(None, 1)  # warm-up: each kernel's first launch rewrites it for the interpreter
    runs: dict[str, tuple[float, RunResult]] = {}
    for mode in (None, *MODES):
        start = time.process_time()
        result = run(mode, examples)
        runs[mode or "unchecked"] = (time.process_time() - start, result)
    base = runs["unchecked"][0]
    r = runs["unchecked"][1]
    print(
        f"the suite on the Triton backend: {r.stats.examples} short examples, {r.stats.steps} "
        f"steps (seed {_SUITE_SEED}), Triton interpreter, CPU time:"
    )
    for name, (seconds, result) in runs.items():
        checked = "" if result.bounds is None else f"   {result.bounds.summary}"
        print(f"  {name:9s} {seconds:8.2f} s   {seconds / base:5.2f}x unchecked{checked}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bounds", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per mode (>= 1)")
    parser.add_argument("--quick", action="store_true", help="a tiny step, once (a smoke test)")
    parser.add_argument(
        "--suite", type=int, metavar="N", help="time N short examples of the suite instead"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.suite is not None:
        if args.suite < 1:
            parser.error(f"--suite must be at least 1 example, got {args.suite}")
        _suite(args.suite)
        return 0
    repeats = 1 if args.quick else args.repeats
    backend, batch, query = _step(_QUICK if args.quick else _WORK)

    def call() -> object:
        return backend.attention(0, query, batch, 0.2)

    def checked(strict: bool) -> Callable[[], object]:
        def run() -> object:
            checker = BoundsChecker(strict=strict)
            with checker.watch("attention", 0, batch):
                out = call()
            assert not checker.violations, checker.violations[0].describe()
            return out

        return run

    modes = {"unchecked": call, "default": checked(False), "strict": checked(True)}
    call()  # warm-up: kernels rewritten, metadata tensors built once
    times: dict[str, list[float]] = {name: [] for name in modes}
    names = list(modes)
    for r in range(repeats):  # each repeat starts with the next mode: no mode always goes first
        for name in names[r % 3 :] + names[: r % 3]:
            times[name].append(_timed(modes[name]))
    base = statistics.median(times["unchecked"])
    print(
        f"one attention call ({batch.num_tokens} tokens, {batch.num_seqs} sequences), "
        f"Triton interpreter, CPU time, median of {repeats}:"
    )
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:9s} {median * 1e3:8.1f} ms   {median / base:5.2f}x unchecked")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
