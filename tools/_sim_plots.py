"""The simulator's figures, drawn with matplotlib's Agg backend from the results JSON alone."""

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


def draw_all(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write every figure of :data:`FIGURES` into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in FIGURES]
    for path, draw in zip(paths, (_rate_sweep, _kv_utilization, _membership), strict=True):
        fig = draw(results)
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return paths


def _title(results: dict[str, Any]) -> str:
    c = results["config"]
    return f"{c['traffic']}, {c['model']} on {c['gpu']}, KV pool {c['pool_tokens']:,} tokens"


def _rate_sweep(results: dict[str, Any]) -> Any:
    sweep = results["sweep"]
    rates = sweep["rates"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = [
        ("throughput_tok_s", None, "output tokens / s", False),
        ("ttft_p99_s", "ttft_p50_s", "time to first token, s (p99 solid, p50 dashed)", True),
        ("itl_p99_s", "itl_p50_s", "inter-token latency, s (p99 solid, p50 dashed)", True),
    ]
    for ax, (key, key50, ylabel, log) in zip(axes, panels, strict=True):
        for policy, runs in sweep["runs"].items():
            color = COLORS[policy]
            ax.plot(rates, [r[key] for r in runs], "o-", color=color, label=LABELS[policy])
            if key50:
                ax.plot(rates, [r[key50] for r in runs], "o--", color=color, alpha=0.6)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("request rate, requests / s")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(results), fontsize=10)
    fig.tight_layout()
    return fig


def _kv_utilization(results: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(9, 4))
    for policy, tl in results["timelines"].items():
        util = results["main"]["runs"][policy]["kv_util_under_pressure"]
        note = "" if util is None else f" ({util:.1%} while requests wait)"
        ax.plot(tl["t"], tl["kv_util"], color=COLORS[policy], label=LABELS[policy] + note)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("simulated time, s")
    ax.set_ylabel("KV slots holding a token / pool")
    ax.set_title(f"KV utilization at {results['main']['rate']:g} requests / s", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _membership(results: dict[str, Any]) -> Any:
    members = results["membership"]
    fig, axes = plt.subplots(1, len(members), figsize=(12, 4.5), sharey=True)
    steps = results["config"]["member_steps"]
    for ax, (policy, by_request) in zip(axes, members.items(), strict=True):
        for rid, runs in by_request.items():
            for first, last in runs:
                ax.hlines(int(rid), first, last + 1, color=COLORS[policy], linewidth=1.5)
        ax.set_xlim(0, steps)
        ax.set_title(f"{LABELS[policy]}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("request id (a line: in the batch)")
    fig.suptitle(f"Batch membership over the first {steps:,} steps", fontsize=10)
    fig.tight_layout()
    return fig
