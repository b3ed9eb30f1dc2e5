"""What the interpreter shim's speed-ups save: one Triton pass, with them and without.

    python -m benchmarks.interpreter --pass short --examples 12

Runs the same pass of the lockstep suite on the Triton backend under
``TRITON_INTERPRET=1`` twice, each in a fresh process on the same seed (so on
the same workloads, step for step): once with the shim as the suite installs
it, once with the shim's value corrections but without its speed-ups (the
interpreter's own overflow checks computed and discarded; the language
patched again at every ``@triton.jit`` helper call; numpy dtypes and block
types rebuilt for every operation). It prints each time, the
steps run and their ratio. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any


def _without_speed_ups() -> None:
    """Install the shim, then put back the interpreter's own attributes the speed-ups replace."""
    from triton.runtime import interpreter as interp

    from conformance.interpreter.shim import SHIM

    SHIM.install()  # the suite's own install nests inside this one: it changes nothing
    for owner, name in (
        (interp.interpreter_builder, "options"),
        (interp.InterpretedFunction, "__call__"),
        (interp, "_get_np_dtype"),
        (interp.InterpreterBuilder, "get_block_ty"),
    ):
        setattr(owner, name, SHIM.saved[(owner, name)])  # the patches that change speed only


def _child(pass_name: str, examples: int, seed: int, fast: bool, out: Any) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from conformance.run.discovery import load_backend
    from conformance.run.runner import run_suite

    backend = load_backend("triton")
    if not fast:
        _without_speed_ups()
    start = time.perf_counter()
    result = run_suite(
        backend, "triton", run_seed=seed, database=None, max_examples=examples, passes=[pass_name]
    )
    out.put((time.perf_counter() - start, result.stats.steps, result.passed))


def measure(pass_name: str, examples: int, seed: int, fast: bool) -> tuple[float, int, bool]:
    """Seconds, steps and verdict of one pass, in a fresh process."""
    ctx = mp.get_context("spawn")
    queue: Any = ctx.Queue()
    child = ctx.Process(target=_child, args=(pass_name, examples, seed, fast, queue))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"the {'fast' if fast else 'baseline'} run failed ({child.exitcode})")
    result: tuple[float, int, bool] = queue.get(timeout=10)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pass", dest="pass_name", default="short", help="the pass to run")
    parser.add_argument("--examples", type=int, default=12, help="examples of the pass")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    rows = []
    for fast in (False, True):
        seconds, steps, passed = measure(args.pass_name, args.examples, args.seed, fast)
        label = "with the speed-ups" if fast else "without (baseline)"
        verdict = "passed" if passed else "FAILED"
        print(f"{label:22} {seconds:8.1f} s  {steps} steps  {verdict}", flush=True)
        rows.append(seconds)
    print(f"baseline / with: {rows[0] / rows[1]:.2f}")


if __name__ == "__main__":
    main()
