"""The simulator's figures, drawn with matplotlib's Agg backend from the results JSON alone.

Sized for the docs column: about 850 pixels wide at 100 dpi, shown at their
natural size, with 11-point text, so no tick is shrunk out of reach.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"static": "tab:red", "contiguous": "tab:orange", "paged": "tab:blue"}
LABELS = {
    "static": "static batching",
    "contiguous": "continuous, contiguous reservation",
    "paged": "continuous, paged",
}
FIGURES = ("rate_sweep.png", "kv_utilization.png", "batch_membership.png")
DPI = 100
WIDTH = 8.5  # inches: 850 pixels


def draw_all(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write every figure of :data:`FIGURES` into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in FIGURES]
    with plt.rc_context({"font.size": 11, "axes.titlesize": 12, "legend.fontsize": 10}):
        for path, draw in zip(paths, (_rate_sweep, _kv_utilization, _membership), strict=True):
            fig = draw(results)
            fig.savefig(path, dpi=DPI)
            plt.close(fig)
    return paths


def _title(results: dict[str, Any]) -> str:
    c = results["config"]
    return f"{c['traffic']}, {c['model']} on {c['gpu']}, KV pool {c['pool_tokens']:,} tokens"


def _rate_sweep(results: dict[str, Any]) -> Any:
    sweep = results["sweep"]
    rates = sweep["rates"]
    fig, axes = plt.subplots(3, 1, figsize=(WIDTH, 11), sharex=True)
    panels = [
        ("throughput_tok_s", None, "output tokens / s", False),
        ("ttft_p99_s", "ttft_p50_s", "time to first token, s\n(p99 solid, p50 dashed)", True),
        ("itl_p99_s", "itl_p50_s", "inter-token latency, s\n(p99 solid, p50 dashed)", True),
    ]
    for ax, (key, key50, ylabel, log) in zip(axes, panels, strict=True):
        for policy, runs in sweep["runs"].items():
            color = COLORS[policy]
            ax.plot(rates, [r[key] for r in runs], "o-", color=color, label=LABELS[policy])
            if key50:
                ax.plot(rates, [r[key50] for r in runs], "o--", color=color, alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("request rate, requests / s")
    axes[0].legend()
    fig.suptitle(_title(results))
    fig.tight_layout()
    return fig


def _kv_utilization(results: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(WIDTH, 4.5))
    for policy, tl in results["timelines"].items():
        util = results["main"]["runs"][policy]["kv_util_under_pressure"]
        note = "" if util is None else f" ({util:.1%} while requests wait)"
        ax.plot(tl["t"], tl["kv_util"], color=COLORS[policy], label=LABELS[policy] + note)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("simulated time, s")
    ax.set_ylabel("KV slots holding a token / pool")
    ax.set_title(f"KV utilization at {results['main']['rate']:g} requests / s")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _membership(results: dict[str, Any]) -> Any:
    """One panel per policy, one above the other, each with its own request axis: in the
    same steps static batching serves far fewer requests, and a shared axis would squash
    its lines into a sliver."""
    members = results["membership"]
    fig, axes = plt.subplots(len(members), 1, figsize=(WIDTH, 8.5), sharex=True)
    steps = results["config"]["member_steps"]
    for ax, (policy, by_request) in zip(axes, members.items(), strict=True):
        ids = [int(rid) for rid in by_request]
        width = max(0.6, min(2.0, 250 / max(len(ids), 1)))
        for rid, runs in by_request.items():
            for first, last in runs:
                ax.hlines(int(rid), first, last + 1, color=COLORS[policy], linewidth=width)
        ax.set_xlim(0, steps)
        ax.set_ylim(min(ids, default=0) - 1, max(ids, default=0) + 1)
        ax.set_title(f"{LABELS[policy]}: {len(ids)} requests in the batch in these steps")
        ax.set_ylabel("request id")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step (a line: the request is in that step's batch)")
    fig.suptitle(f"Batch membership over the first {steps:,} steps")
    fig.tight_layout()
    return fig
