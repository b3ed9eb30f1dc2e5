"""The simulator's figures, drawn with matplotlib's Agg backend from the results JSON alone.

Sized for the docs column: about 850 pixels wide at 100 dpi, shown at their
natural size, with 11-point text, so no tick is shrunk out of reach.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from conformance.output_files import write_output

COLORS = {
    "static": "tab:red",
    "static-eager": "tab:purple",
    "contiguous": "tab:orange",
    "paged": "tab:blue",
}
MARKERS = {"static": "o", "static-eager": "s", "contiguous": "o", "paged": "o"}


def _labels(results: dict[str, Any]) -> dict[str, str]:
    """Each policy's name in the figures: which static batching each curve is, and its timeout."""
    c = results["config"]
    wait = c["static_wait_steps"] * c["idle_tick_s"]
    return {
        "static": f"static: waits for a full batch (at most {c['static_wait_steps']} steps, "
        f"{wait:.1f} s idle)",
        "static-eager": "static: takes whoever is waiting, never idles",
        "contiguous": "continuous, contiguous reservation",
        "paged": "continuous, paged",
    }


def _order(by_policy: dict[str, Any]) -> list[str]:
    """The policies present, in :data:`COLORS`' order (the JSON's keys are sorted)."""
    return [p for p in COLORS if p in by_policy]


FIGURES = ("rate_sweep.png", "kv_utilization.png", "batch_membership.png")
DPI = 100
WIDTH = 8.5  # inches: 850 pixels


def draw_all(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write every figure of :data:`FIGURES` into ``out_dir``; return their paths."""
    paths = [out_dir / name for name in FIGURES]
    with plt.rc_context({"font.size": 11, "axes.titlesize": 12, "legend.fontsize": 10}):
        for path, draw in zip(paths, (_rate_sweep, _kv_utilization, _membership), strict=True):
            fig = draw(results)
            png = io.BytesIO()
            fig.savefig(png, dpi=DPI, format="png")
            plt.close(fig)
            write_output(path, png.getvalue())
    return paths


def _title(results: dict[str, Any]) -> str:
    c = results["config"]
    return f"{c['traffic']}, {c['model']} on {c['gpu']}, KV pool {c['pool_tokens']:,} tokens"


def _rate_sweep(results: dict[str, Any]) -> Any:
    """Throughput, TTFT and ITL against the rate. The two static curves nearly coincide, so
    the one that takes whoever is waiting is drawn in larger squares, under the other."""
    sweep = results["sweep"]
    rates = sweep["rates"]
    fig, axes = plt.subplots(3, 1, figsize=(WIDTH, 11), sharex=True)
    panels = [  # key, its p50, label, scale, log axis
        ("throughput_tok_s", None, "output tokens / s", 1.0, False),
        ("ttft_p99_s", "ttft_p50_s", "time to first token, s\n(p99 solid, p50 dashed)", 1.0, True),
        ("itl_p99_s", "itl_p50_s", "inter-token latency, ms\n(p99 solid, p50 dashed)", 1e3, False),
    ]
    names = _labels(results)
    for ax, (key, key50, ylabel, scale, log) in zip(axes, panels, strict=True):
        for policy in _order(sweep["runs"]):
            runs = sweep["runs"][policy]
            under = policy == "static-eager"
            style = {"color": COLORS[policy], "markersize": 9 if under else 6, "zorder": 3 - under}
            ax.plot(rates, [r[key] * scale for r in runs], MARKERS[policy] + "-", **style,
                    label=names[policy])  # fmt: skip
            if key50:
                ax.plot(rates, [r[key50] * scale for r in runs], MARKERS[policy] + "--", **style,
                        alpha=0.6)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        if log:  # TTFT spans decades: a log axis with plain numbers
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("request rate, requests / s")
    axes[0].legend()
    fig.suptitle(_title(results))
    fig.tight_layout()
    return fig


def _kv_utilization(results: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(WIDTH, 5.5))
    names = _labels(results)
    for policy in _order(results["timelines"]):
        tl = results["timelines"][policy]
        util = results["main"]["runs"][policy]["kv_util_under_pressure"]
        note = "" if util is None else f" ({util:.1%} while requests wait)"
        ax.plot(tl["t"], tl["kv_util"], color=COLORS[policy], label=names[policy] + note)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("simulated time, s")
    ax.set_ylabel("KV slots holding a token / pool")
    ax.set_title(f"KV utilization at {results['main']['rate']:g} requests / s")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15))  # under the axes: no curve hidden
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _membership(results: dict[str, Any]) -> Any:
    """One panel per policy, one above the other, on one time axis, each with its own request
    axis: in the same seconds static batching serves far fewer requests, and a shared request
    axis would squash its lines into a sliver."""
    members, names = results["membership"], _labels(results)
    seconds = results["config"]["member_seconds"]
    fig, axes = plt.subplots(len(members), 1, figsize=(WIDTH, 3.6 * len(members)), sharex=True)
    for ax, policy in zip(axes, _order(members), strict=True):
        by_request = members[policy]
        ids = [int(rid) for rid in by_request]
        width = max(0.6, min(2.5, 250 / max(len(ids), 1)))
        for rid, runs in by_request.items():
            for start, end in runs:
                ax.hlines(int(rid), start, end, color=COLORS[policy], linewidth=width)
        ax.set_xlim(0, seconds)
        ax.set_ylim(min(ids, default=0) - 1, max(ids, default=0) + 1)
        ax.set_title(f"{names[policy]}\n{len(ids)} requests in the batch in these seconds")
        ax.set_ylabel("request id")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("simulated time, s (a line: the request is in the batch)")
    fig.suptitle(
        f"Batch membership over the first {seconds:g} s at {results['main']['rate']:g} requests / s"
    )
    fig.tight_layout()
    return fig
