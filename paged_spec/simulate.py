"""Simulate serving: static against continuous batching, contiguous against paged KV memory.

``python -m paged_spec.simulate`` serves one synthetic trace (Poisson arrivals,
ShareGPT-like lengths) four ways on the spec's own schedulers and block
manager (static batching as Orca's request-level scheduling, waiting for a full batch;
static batching that takes whoever is waiting; continuous batching on
max-length slabs; continuous batching on paged memory), timing each step
with a roofline model of an 8B model on an H200-class GPU (see
``paged_spec/sim/cost.py``), and does so at several request rates. It writes
``results.json`` and three PNG figures into ``--out`` (default
``out/simulate``) and prints:

* the throughput of continuous batching (paged) over static
  batching, and the split of that gain into scheduling (continuous over
  static, both reserving the maximum) and memory (paged over contiguous, both
  continuous);
* KV utilization of paged against contiguous memory: the share of the pool's
  slots that hold a token's KV, averaged over the time in which requests were
  waiting (when memory, not demand, limits the batch).

``--model hybrid-27b`` serves a hybrid model instead: its clock
adds the reading and writing of each sequence's fixed-size state, and its
memory runs through two KV cache groups, the paged full-attention KV and one
state slot per seat taken out of the pool first (``--max-num-seqs`` seats;
the default 512 would not leave room for the 144 MiB slots).

The policies, their shared loop and the metrics are in ``paged_spec/sim/run.py``;
traffic presets and trace files in ``paged_spec/sim/traffic.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from paged_spec._cli import positive_float, positive_floats, positive_int
from paged_spec.sim.config import SimConfig
from paged_spec.sim.cost import MODEL_PRESETS, idle_step_seconds
from paged_spec.sim.progress import LineSink, progress_line, run_jobs
from paged_spec.sim.run import POLICIES, Timeline, run
from paged_spec.sim.scenarios import SCENARIOS
from paged_spec.sim.traffic import LENGTH_PRESETS
from spec.errors import SpecError

__all__ = ["SimConfig", "main", "simulate", "write_outputs"]


def _job(
    policy: str,
    rate: float,
    cfg: SimConfig,
    main_run: bool,
    progress_every: float,
    sink: LineSink | None,
) -> tuple[str, float, dict[str, Any], Timeline | None]:
    """One run; top-level so that worker processes can pickle it. Progress goes to ``sink``."""

    def progress(done: int, total: int, clock: float) -> None:
        if sink is not None:
            sink.put(progress_line(policy, rate, done, total, clock))

    members = cfg.member_seconds if main_run else 0.0
    metrics, tl = run(
        policy,
        cfg.trace(rate),
        cfg.engine(),
        member_seconds=members,
        progress=progress,
        progress_every=progress_every,
    )
    return policy, rate, metrics, tl if main_run else None


def simulate(
    cfg: SimConfig, *, jobs: int = 1, quiet: bool = True, progress_every: float = 1.0
) -> dict[str, Any]:
    """Every policy at every rate; the last rate's runs also keep their timelines.

    Unless ``quiet``, each run reports on stderr every ``progress_every`` seconds
    of wall time, one whole line at a time (:mod:`paged_spec.sim.progress`).
    """
    if not cfg.rates or min(cfg.rates) <= 0:
        raise ValueError(f"rates must be positive, got {cfg.rates}")
    main_rate = cfg.rates[-1]
    engine = cfg.engine()
    tick = idle_step_seconds(engine.gpu, engine.model)
    tasks = [
        (p, r, cfg, r == main_rate, progress_every) for r in reversed(cfg.rates) for p in POLICIES
    ]
    done = run_jobs(_job, tasks, jobs=jobs, quiet=quiet)
    by_key = {(p, r): (m, tl) for p, r, m, tl in done}
    main_runs = {p: by_key[p, main_rate] for p in POLICIES}
    results: dict[str, Any] = {
        "config": asdict(cfg) | {"pool_tokens": engine.pool_tokens, "idle_tick_s": tick},
        "main": {"rate": main_rate, "runs": {p: m for p, (m, _) in main_runs.items()}},
        "sweep": {
            "rates": list(cfg.rates),
            "runs": {p: [by_key[p, r][0] for r in cfg.rates] for p in POLICIES},
        },
        "timelines": {
            p: _downsample(tl, cfg.timeline_points) for p, (_, tl) in main_runs.items() if tl
        },
        "membership": {
            p: {  # to the tenth of a millisecond: the figure's resolution, and a smaller file
                str(rid): [[round(a, 4), round(b, 4)] for a, b in runs]
                for rid, runs in main_runs[p][1].members.items()  # type: ignore[union-attr]
            }
            for p in ("static", "static-eager", "paged")
        },
    }
    results["summary"] = summary(results)
    return results


def summary(results: dict[str, Any]) -> dict[str, float | None]:
    """The headline ratios of the main run."""
    runs = results["main"]["runs"]
    tput = {p: runs[p]["throughput_tok_s"] for p in POLICIES}
    return {
        "continuous_over_static_throughput": tput["paged"] / tput["static"],
        "scheduling_gain": tput["contiguous"] / tput["static"],
        "memory_gain": tput["paged"] / tput["contiguous"],
        "paged_kv_utilization": runs["paged"]["kv_util_under_pressure"],
        "contiguous_kv_utilization": runs["contiguous"]["kv_util_under_pressure"],
    }


def _downsample(tl: Timeline, points: int) -> dict[str, list[float]]:
    """Average the per-step series over ``points`` equal time bins (empty bins dropped)."""
    end = np.asarray(tl.end)
    bins = np.minimum((end / end[-1] * points).astype(int), points - 1)
    out: dict[str, list[float]] = {"t": [], "kv_util": [], "batch": []}
    counts = np.bincount(bins, minlength=points)
    keep = counts > 0
    for key, series in (("t", end), ("kv_util", tl.kv_util), ("batch", tl.batch)):
        sums = np.bincount(bins, weights=np.asarray(series, dtype=float), minlength=points)
        out[key] = [round(float(x), 6) for x in sums[keep] / counts[keep]]
    return out


def write_outputs(results: dict[str, Any], out_dir: Path, *, plots: bool = True) -> list[Path]:
    """``results.json`` and (unless ``plots`` is false) the figures; return the paths written."""
    from conformance.output_files import write_output  # the one rule for an output path

    path = out_dir / "results.json"
    write_output(path, json.dumps(results, indent=1, sort_keys=True) + "\n")
    written = [path]
    if plots:
        from paged_spec.sim.plots import draw_all  # matplotlib only when drawing

        written += draw_all(results, out_dir)
    return written


def _pct(u: float | None) -> str:
    return "n/a (never under pressure)" if u is None else f"{u:.1%}"


def _num(x: float | None, scale: float = 1.0, digits: int = 3) -> str:
    """A latency for the headline; "-" when nothing was measured (no request made 2 tokens)."""
    return "-" if x is None else f"{x * scale:.{digits}f}"


def headline(results: dict[str, Any]) -> str:
    """The lines ``python -m paged_spec.simulate`` prints."""
    s, runs = results["summary"], results["main"]["runs"]
    util = {p: runs[p]["kv_util_under_pressure"] for p in ("paged", "contiguous")}
    rows = [
        f"main run: {results['main']['rate']:g} requests/s, {results['config']['num_requests']} "
        f"requests, {results['config']['traffic']}",
    ]
    for p in POLICIES:
        r = runs[p]
        rows.append(
            f"  {p:>12}: {r['throughput_tok_s']:>9,.0f} tok/s  TTFT p50/p99 "
            f"{_num(r['ttft_p50_s'])}/{_num(r['ttft_p99_s'])} s  ITL p50/p99 "
            f"{_num(r['itl_p50_s'], 1e3, 1)}/{_num(r['itl_p99_s'], 1e3, 1)} ms  "
            f"preemptions {r['preemptions']}"
        )
    rows += [
        f"continuous/static throughput: {s['continuous_over_static_throughput']:.2f}x "
        f"(scheduling {s['scheduling_gain']:.2f}x, paging {s['memory_gain']:.2f}x)",
        f"KV utilization while requests wait: paged {_pct(util['paged'])}, "
        f"contiguous {_pct(util['contiguous'])}",
    ]
    return "\n".join(rows)


def _parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = argparse.ArgumentParser(
        prog="python -m paged_spec.simulate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--traffic", default=d.traffic, help=f"{sorted(LENGTH_PRESETS)} or a trace file")
    p.add_argument("--num-requests", type=positive_int, default=d.num_requests)
    p.add_argument(
        "--rates",
        type=positive_floats,
        default=",".join(f"{r:g}" for r in d.rates),
        help="requests/s, comma-separated; the last is the main run",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default=d.model)
    p.add_argument("--kv-pool-gib", type=positive_float, default=d.kv_pool_gib)
    p.add_argument("--block-size", type=positive_int, default=d.block_size)
    p.add_argument("--max-model-len", type=positive_int, default=d.max_model_len)
    p.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=d.max_num_batched_tokens)
    p.add_argument(
        "--static-wait-steps",
        type=positive_int,
        default=d.static_wait_steps,
        help="steps a static batch may wait to fill (an idle step lasts one lone decode step)",
    )
    p.add_argument("--out", type=Path, default=Path("out/simulate"))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        help="print one lesson's table instead (its own fixed trace; no files written)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.scenario:
        print("\n".join(SCENARIOS[args.scenario]()))
        return 0
    if args.max_model_len < 2:
        parser.error(
            f"argument --max-model-len: must be >= 2 (a prompt and an output token), "
            f"got {args.max_model_len}"
        )
    from conformance.errors import SetupError
    from conformance.output_files import check_output_folder

    try:
        cfg = SimConfig(
            traffic=args.traffic,
            num_requests=args.num_requests,
            rates=args.rates,
            seed=args.seed,
            model=args.model,
            kv_pool_gib=args.kv_pool_gib,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            static_wait_steps=args.static_wait_steps,
        )
        check_output_folder(args.out, "--out")  # before the run, not after it
        cfg.trace(cfg.rates[-1])  # fail early on a bad trace, preset or pool
        for policy in POLICIES:
            cfg.engine().scheduler(policy)
        start = time.monotonic()
        results = simulate(cfg, jobs=args.jobs, quiet=args.quiet)
    except (ValueError, OSError, SpecError, SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        paths = write_outputs(results, args.out, plots=not args.no_plots)
    except (OSError, SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(headline(results))
    print(f"wrote {', '.join(str(p) for p in paths)} in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
