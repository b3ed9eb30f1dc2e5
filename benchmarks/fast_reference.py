"""The spec's numpy reference beside the fast reference, at device-envelope shapes: time and memory.

Each case runs in a fresh child process, so that its peak resident memory
(``ru_maxrss``, less the child's memory before the call) is its own. The numpy
reference is the spec (:func:`spec.attention.paged_attention`); the fast one is
:func:`conformance.judges.fast_reference.paged_attention` on the CPU here (pass
``--device cuda`` beside a GPU; peak memory is then the device's). Both use
torch's and numpy's threads as configured. The last case is a 32,768-token
prompt's last 8,192-query chunk, for the fast reference only: the numpy one
would need a 137 GB score matrix. Its time is measured over its first
``--prompt-queries`` queries (the peak memory is one launch's, reached at once).

    python -m benchmarks.fast_reference
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time
from dataclasses import dataclass

import numpy as np

from spec.batch import BatchMetadata


@dataclass(frozen=True)
class Case:
    """A step: ``seqs`` sequences of ``context`` tokens, the last ``queries`` of each new."""

    name: str
    seqs: int
    context: int
    queries: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    numpy: bool = True  # also run the spec's numpy reference


CASES = (
    Case("decode 64 x 2,048, 32/8 heads", 64, 2048, 1),
    Case("decode 16 x 2,048, 32/8 heads", 16, 2048, 1),
    Case("prefill 2,048 over 8,192, 32/8 heads", 1, 8192, 2048),
)
BLOCK = 16


def _step(case: Case, kv_dtype: type = np.float64) -> tuple[BatchMetadata, np.ndarray, np.ndarray]:
    """The batch, and a pool ``[blocks, B, H_kv, D]`` of K (V is its negation), shuffled."""
    rng = np.random.default_rng(0)
    per = -(-case.context // BLOCK)
    perm = rng.permutation(case.seqs * per)
    tables = tuple(tuple(int(b) for b in perm[i * per : (i + 1) * per]) for i in range(case.seqs))
    n, c = case.queries, case.context
    positions = tuple(p for _ in range(case.seqs) for p in range(c - n, c))
    slots = tuple(t[p // BLOCK] * BLOCK + p % BLOCK for t in tables for p in range(c - n, c))
    batch = BatchMetadata(
        BLOCK,
        tuple(range(case.seqs)),
        tuple(range(0, case.seqs * n + 1, n)),
        (c,) * case.seqs,
        tables,
        slots,
        positions,
    )
    pool = rng.standard_normal((case.seqs * per, BLOCK, case.kv_heads, case.head_dim))
    query = rng.standard_normal((case.seqs * n, case.heads, case.head_dim))
    return batch, pool.astype(kv_dtype), query


def _run(case: Case, which: str, device: str, out: mp.Queue[tuple[float, float]]) -> None:
    """In the child: build the step, then time one call and measure the peak memory it adds."""
    batch, pool, query = _step(case)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if which == "numpy":
        from spec.attention import paged_attention
        from spec.kv_memory import KVMemory

        memory = KVMemory(1, pool.shape[0], BLOCK, case.kv_heads, case.head_dim, lazy=False)
        memory.k[0][:], memory.v[0][:] = pool, -pool
        del pool
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        paged_attention(query, batch, memory, 0)
        elapsed = time.perf_counter() - start
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024.0
    else:
        import torch

        from conformance.judges import fast_reference as fr

        kv = fr.PagedKV(torch.from_numpy(pool).to(device), torch.from_numpy(-pool).to(device))
        q = torch.from_numpy(query).to(device)
        del pool
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        fr.paged_attention(q, batch, kv)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if device.startswith("cuda"):
            peak = float(torch.cuda.max_memory_allocated() - base)
        else:
            peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024.0
    out.put((elapsed, peak))


def measure(case: Case, which: str, device: str) -> tuple[float, float]:
    """Seconds and peak added bytes of one call, in a fresh process."""
    ctx = mp.get_context("spawn")
    queue: mp.Queue[tuple[float, float]] = ctx.Queue()
    child = ctx.Process(target=_run, args=(case, which, device, queue))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the {which} reference's run of {case.name!r} failed")
    return queue.get(timeout=10)


def _fmt(seconds: float, peak: float) -> str:
    return f"{seconds:8.2f} s {peak / 2**20:9.0f} MiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="the fast reference's torch device")
    parser.add_argument(
        "--prompt-queries",
        type=int,
        default=512,
        help="queries of the 32,768-token prompt's last chunk to time (8192: the whole chunk)",
    )
    parser.add_argument("--skip-numpy", action="store_true", help="the fast reference only")
    parser.add_argument(
        "--prompt-only", action="store_true", help="only the 32,768-token prompt's chunk"
    )
    args = parser.parse_args(argv)
    print(f"{'step':40} {'numpy (spec)':>22} {'fast reference':>22}")
    for case in () if args.prompt_only else CASES:
        fast = measure(case, "fast", args.device)
        slow = "(skipped)" if args.skip_numpy else _fmt(*measure(case, "numpy", args.device))
        print(f"{case.name:40} {slow:>22} {_fmt(*fast):>22}")
    prompt = Case(
        f"32,768 prompt, chunk 4 of 4: {args.prompt_queries} of 8,192 q, 64/8 heads",
        1,
        32768 - 8192 + args.prompt_queries,
        args.prompt_queries,
        heads=64,
        numpy=False,
    )
    big = _fmt(*measure(prompt, "fast", args.device))
    print(f"{prompt.name:40} {'(needs > 100 GB)':>22} {big:>22}")


if __name__ == "__main__":
    main()
