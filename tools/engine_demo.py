"""Continuous batching end to end: a few dozen requests through the engine, checked.

``python -m tools.engine_demo [--backend triton|torch|reference] [--requests N]``

Runs requests of mixed lengths (short chats and long documents, some sharing a
system prompt, some with parallel samples, greedy and sampled) through the
tiny model on a paged KV cache small enough to force preemption, prints the
metrics per request class, then runs every sample alone with contiguous
attention and prints ``identical to unbatched: K/K requests``. Exits 1 if any
request differs. ``--baseline`` also runs the static-batching scheduler.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence

import torch

from spec.errors import CapacityError
from spec.metrics import format_table
from spec.request import Request
from spec.scheduler import ContinuousScheduler, SchedulerConfig, StaticScheduler
from tools._cli import positive_int
from tools.engine import Engine, make_backend
from tools.tiny_model import TinyModel, generate_alone

SYSTEM_PROMPT = tuple(range(100, 124))  # 24 tokens shared by the chat requests


def make_requests(count: int, seed: int) -> tuple[list[Request], dict[int, int]]:
    """Chats (shared system prompt, short) and documents (long prompt); staggered arrivals."""
    rng = random.Random(seed)
    requests, arrivals = [], {}
    for rid in range(count):
        doc = rid % 4 == 3
        user = tuple(rng.randrange(256) for _ in range(rng.randint(2, 12)))
        prompt = tuple(rng.randrange(256) for _ in range(rng.randint(40, 90))) if doc else user
        requests.append(
            Request(
                request_id=rid,
                prompt=prompt if doc else SYSTEM_PROMPT + prompt,
                max_new_tokens=rng.randint(4, 24),
                stop_tokens=frozenset({rng.randrange(256)}),
                n=2 if rid % 7 == 5 else 1,
                temperature=0.0 if rid % 2 else 0.8,
                seed=rid,
                request_class="document" if doc else "chat",
            )
        )
        arrivals[rid] = rid // 3
    return requests, arrivals


def run(
    backend_name: str,
    scheduler_cls: type[ContinuousScheduler],
    config: SchedulerConfig,
    model: TinyModel,
    requests: Sequence[Request],
    arrivals: dict[int, int],
) -> Engine:
    engine = Engine(model, make_backend(backend_name), scheduler_cls(config))
    engine.run(requests, arrivals)
    return engine


def report(name: str, engine: Engine) -> None:
    """The metrics table, with the engine's wall clock as the clock for seconds."""
    ends, metrics = engine.step_end_times, engine.scheduler.metrics
    print(f"\n{name}: {len(ends)} steps in {ends[-1]:.1f} s")
    print(format_table(metrics.summarize(ends), metrics.totals()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.engine_demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--backend", default="triton", choices=["triton", "torch", "reference"])
    parser.add_argument("--requests", type=positive_int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-blocks", type=positive_int, default=40)
    parser.add_argument("--block-size", type=positive_int, default=8)
    parser.add_argument("--preemption", default="recompute", choices=["recompute", "swap"])
    parser.add_argument("--baseline", action="store_true", help="also run static batching")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny matrices: threads only contend

    model = TinyModel()
    requests, arrivals = make_requests(args.requests, args.seed)
    config = SchedulerConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=64,
        max_num_seqs=12,
        max_model_len=model.config.max_positions,
        preemption=args.preemption,
        num_host_blocks=2 * args.num_blocks,
        enable_prefix_caching=True,
    )
    try:
        engine = run(args.backend, ContinuousScheduler, config, model, requests, arrivals)
    except CapacityError as e:  # a pool too small for the requests: a usage error
        parser.error(f"--num-blocks {args.num_blocks} x --block-size {args.block_size}: {e}")
    report(f"continuous batching on {args.backend}", engine)
    if args.baseline:
        report(
            "static batching", run(args.backend, StaticScheduler, config, model, requests, arrivals)
        )

    same = 0
    for r in requests:
        alone = tuple(generate_alone(model, r, i) for i in range(r.n))
        got = engine.finished[r.request_id].outputs
        same += got == alone
        if got != alone:
            print(f"request {r.request_id}: batched {got} != alone {alone}")
    print(f"identical to unbatched: {same}/{len(requests)} requests")
    return 0 if same == len(requests) else 1


if __name__ == "__main__":
    sys.exit(main())
