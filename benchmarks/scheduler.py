"""Benchmark the continuous scheduler's own time per step (no model), at small and large loads.

Run ``python -m benchmarks.scheduler`` (``--quick`` for a smoke run,
``--repeats N`` for steadier figures on a busy machine). Each
scenario fills a :class:`~spec.scheduler.ContinuousScheduler` through its
public API only, lets every running request reach its decode phase, then
times ``step()`` + ``update()`` (one sampled token per sample slot) over a
number of steps, best of a few repeats:

* ``16 running``: 16 decoding requests (the baseline of the ratios);
* ``4096 running``: 4,096 decoding requests, every one scheduled every step;
* ``16 running + 8192 waiting``: 16 decoding requests with no seat free, and a
  long waiting queue that cannot be admitted.

Printed side by side: time per step, time per running request, and the ratio
of each scenario's step time to the baseline's. A step is at least linear in
the running requests (each gets a slot and a sample), so the second ratio is
about 256 when the per-request cost is flat; the third ratio is about 1 when a
queue that cannot admit anyone costs nothing per step.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from paged_spec._cli import positive_int
from spec.block_manager import cdiv
from spec.request import Request
from spec.scheduler import ContinuousScheduler, SchedulerConfig

__all__ = ["Scenario", "main", "measure"]

PROMPT = 15  # tokens: the first decode starts a fresh 16-token block
BLOCK = 16


@dataclass(frozen=True)
class Scenario:
    """``running`` decoding requests, ``waiting`` more that find no free seat."""

    name: str
    running: int
    waiting: int = 0


SCENARIOS = (
    Scenario("16 running", 16),
    Scenario("4096 running", 4096),
    Scenario("16 running + 8192 waiting", 16, waiting=8192),
)


def _build(s: Scenario, steps: int) -> ContinuousScheduler:
    """A scheduler whose ``s.running`` requests are all decoding, with room for ``steps`` more."""
    tokens = PROMPT + steps + 4
    config = SchedulerConfig(
        num_blocks=(s.running + 1) * cdiv(tokens, BLOCK),
        block_size=BLOCK,
        max_num_batched_tokens=max(256, s.running * PROMPT),
        max_num_seqs=s.running,
        max_model_len=PROMPT + steps + 8,
    )
    sched = ContinuousScheduler(config)
    for rid in range(s.running + s.waiting):
        prompt = tuple((rid + j) % 50 + 1 for j in range(PROMPT))
        sched.submit(Request(request_id=rid, prompt=prompt, max_new_tokens=steps + 8))
    out = sched.step()  # every seat's prompt in one step; the waiting ones find no seat
    sched.update({x.seq_id: 1 for x in out.samples})
    return sched


def measure(s: Scenario, steps: int, repeats: int) -> float:
    """Best seconds per ``step()`` + ``update()`` over ``repeats`` runs of ``steps`` steps."""
    best = float("inf")
    for _ in range(repeats):
        sched = _build(s, steps)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = sched.step()
            sched.update({x.seq_id: 1 for x in out.samples})
        best = min(best, (time.perf_counter() - t0) / steps)
        assert out.batch.num_seqs == s.running, f"{s.name}: {out.batch.num_seqs} scheduled"
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 steps, once (a smoke test)")
    parser.add_argument(
        "--repeats", type=positive_int, default=5, help="runs per scenario; the best is kept"
    )
    args = parser.parse_args(argv)
    steps, repeats = (5, 1) if args.quick else (40, args.repeats)
    print(f"scheduler time per step (step + update, no model), best of {repeats} x {steps} steps")
    print(f"{'scenario':<28} {'ms/step':>9} {'us/running':>11} {'ratio':>8}")
    base: float | None = None
    for s in SCENARIOS:
        t = measure(s, steps, repeats)
        base = t if base is None else base
        print(f"{s.name:<28} {t * 1e3:>9.3f} {t / s.running * 1e6:>11.2f} {t / base:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
