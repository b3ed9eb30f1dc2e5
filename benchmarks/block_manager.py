"""Benchmark the block manager's copy-on-write bookkeeping: is each operation O(1) in P?

Run ``python -m benchmarks.block_manager`` (``--sizes 10 10000``, ``--repeats N``).

What it measures: a step in which ``P`` forked sequences have already written
into a shared, partly filled block, so ``P`` copy-on-write copies are pending
(one parent with a 2-token block, ``P + 1`` forks of it). Then, ``repeats``
times, with ``P`` copies pending each time:

* **append into a shared block**: one more fork appends one token. Its last
  block is shared, so the append records copy ``P + 1``;
* **free**: that fork is freed, which drops its pending copy (back to ``P``);

and it refills the fork (not timed). Each operation is timed on its own
(``time.perf_counter_ns``); the table shows the median per operation, at each
``P`` side by side, and the ratio of the largest ``P`` to the smallest. With
O(1) bookkeeping the ratio stays near 1 however large ``P`` grows; a scan of
the pending copies makes it grow like ``P``. It also times building the state,
``P`` forked appends in one step: O(P) if each append is O(1), O(P^2) if not.

Last, it times ``check_integrity`` (the invariant check the stateful tests
run after every step) on the same state at two sizes (``--integrity-sizes``,
1,000 and 10,000 by default), the median of ``--integrity-repeats`` calls,
and prints ``T(large) / ((large / small) * T(small))``: near 1 when the check
is linear in the pending copies, near ``large / small`` when it is quadratic.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from spec.block_manager import BlockManager

__all__ = ["main", "measure"]

BLOCK_SIZE = 16
OPERATIONS = ("append into a shared block", "free")


def _pending_step(p: int) -> tuple[BlockManager, float]:
    """A manager with ``p`` copies pending in one step, a spare fork (id 1), and the setup time."""
    m = BlockManager(num_blocks=p + 8, block_size=BLOCK_SIZE)
    m.add_sequence(0, [])
    m.append_slots(0, [1, 2])
    m.take_copies()  # the parent's step is laid out: it may fork now
    for child in range(1, p + 2):
        m.fork(0, child)
    start = time.perf_counter()
    for child in range(2, p + 2):
        m.append_slots(child, [3])  # each fork writes into the shared block: one copy each
    return m, time.perf_counter() - start


def measure(p: int, repeats: int) -> tuple[dict[str, float], float]:
    """Median seconds per operation with ``p`` copies pending, and the time to build the step."""
    m, setup = _pending_step(p)
    times: dict[str, list[int]] = {op: [] for op in OPERATIONS}
    spare = 1
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        m.append_slots(spare, [3])
        t1 = time.perf_counter_ns()
        m.free(spare)
        t2 = time.perf_counter_ns()
        m.fork(0, spare)
        times[OPERATIONS[0]].append(t1 - t0)
        times[OPERATIONS[1]].append(t2 - t1)
    assert len(m.take_copies()) == p, "the state drifted: the benchmark would not measure P"
    return {op: statistics.median(ts) / 1e9 for op, ts in times.items()}, setup


def integrity_seconds(p: int, repeats: int) -> float:
    """Median seconds of one ``check_integrity`` call with ``p`` copies pending."""
    m, _ = _pending_step(p)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        m.check_integrity()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e9


def integrity_report(sizes: Sequence[int], repeats: int) -> str:
    """One line: ``check_integrity`` at the two sizes, and its cost against linear growth."""
    lo, hi = sizes[0], sizes[-1]
    t_lo, t_hi = integrity_seconds(lo, repeats), integrity_seconds(hi, repeats)
    ratio = t_hi / (hi / lo * t_lo)
    return (
        f"check_integrity, median of {repeats}: P = {lo:,}: {_format(t_lo)}, "
        f"P = {hi:,}: {_format(t_hi)}; T(P={hi:,}) / ({hi / lo:,.0f} x T(P={lo:,})) = "
        f"{ratio:.2f} (1 if linear in P, {hi / lo:,.0f} if quadratic)"
    )


def _format(seconds: float) -> str:
    return f"{seconds * 1e6:,.2f} us" if seconds < 1e-3 else f"{seconds * 1e3:,.1f} ms"


def report(sizes: Sequence[int], repeats: int) -> str:
    """The table the command prints: one row per operation, one column per ``P``, and the ratio."""
    results = [measure(p, repeats) for p in sizes]
    lo, hi = sizes[0], sizes[-1]
    header = ["operation", *(f"P = {p:,}" for p in sizes), f"ratio P={hi:,} / P={lo:,}"]
    rows = []
    for op in OPERATIONS:
        cells = [r[op] for r, _ in results]
        rows.append([op, *map(_format, cells), f"{cells[-1] / cells[0]:.2f}x"])
    setups = [s for _, s in results]
    growth = f"{setups[-1] / setups[0]:.0f}x (P grew {hi / lo:,.0f}x)"
    rows.append(["build the step (P forked appends)", *map(_format, setups), growth])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    intro = (
        f"Block manager copy-on-write bookkeeping: median time per operation over {repeats} "
        f"repeats, with P copy-on-write copies pending in the step (block size {BLOCK_SIZE})."
    )
    return "\n".join([intro, "", *lines])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.block_manager", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 10_000], metavar="P")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument(
        "--integrity-sizes", type=int, nargs=2, default=[1_000, 10_000], metavar="P"
    )
    parser.add_argument("--integrity-repeats", type=int, default=5)
    args = parser.parse_args(argv)
    for name, sizes in (("--sizes", args.sizes), ("--integrity-sizes", args.integrity_sizes)):
        if len(sizes) < 2 or min(sizes) < 1 or sizes != sorted(sizes) or sizes[0] == sizes[-1]:
            parser.error(f"{name} needs at least two increasing values >= 1")
    if args.repeats < 1 or args.integrity_repeats < 1:
        parser.error("--repeats and --integrity-repeats must be >= 1")
    print(report(args.sizes, args.repeats))
    print()
    print(integrity_report(args.integrity_sizes, args.integrity_repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
