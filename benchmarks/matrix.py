"""The conformance matrix: every kernel adapter through the suite, and a dated page of verdicts.

``python -m benchmarks.matrix --out docs/matrix.md`` runs the ``quick`` profile
on each adapter of :mod:`conformance.adapters` (``paged-spec run --backend NAME
--report FILE``, one child process each: a crash is that adapter's row, not the
page's end), on the CPU under Triton's interpreter or on the GPU when there is
one, then writes the page: per adapter the kernel, its release (where its files
came from), what it declares, the verdict, and each distinct cause the run
found, with the failures it covers and, where the adapter's ``EXPLAINED`` has
one, a line naming the kernel's code that causes it. The flex adapter runs twice,
with the suite's default poison and with ``--poison finite``.

Every line of the page comes from the run that wrote it (its JSON reports,
kept beside the page with ``--reports DIR``); ``--from-reports DIR`` writes the
page again from such reports without running. The page names the machine
(platform, CPU, GPU, Python, torch and Triton) and the date the run ended.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conformance.adapters import ADAPTERS
from conformance.output_files import write_output

__all__ = ["RUNS", "Run", "main", "page"]


@dataclass(frozen=True)
class Run:
    """One row of the matrix: an adapter and the options of its run."""

    adapter: str
    options: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return " ".join((self.adapter, *self.options))

    @property
    def file(self) -> str:
        return self.label.replace(" --", "-").replace(" ", "-") + ".json"


RUNS = (
    Run("flex"),
    Run("flex", ("--poison", "finite")),
    Run("vllm-unified"),
    Run("vllm-mla"),
    Run("sglang-decode"),
    Run("sglang-extend"),
)
KERNELS = {
    "flex": "PyTorch FlexAttention paged attention (`PagedAttention` + `flex_attention`)",
    "vllm-unified": "vLLM Triton `unified_attention` + `triton_reshape_and_cache_flash`",
    "vllm-mla": "vLLM Triton MLA decode (`decode_attention_fwd(is_mla=True)`)",
    "sglang-decode": "SGLang Triton `decode_attention_fwd`",
    "sglang-extend": "SGLang Triton `extend_attention_fwd`",
}


def run_one(run: Run, reports: Path, profile: str, seed: int, extra: Sequence[str]) -> Path:
    """``paged-spec run`` on one adapter, its JSON report written under ``reports``."""
    report = reports / run.file
    command = [
        sys.executable, "-m", "conformance", "run", "--backend", run.adapter, *run.options,
        "--profile", profile, "--seed", str(seed), "--no-database", "--report", str(report),
        *extra,
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    took = time.monotonic() - started
    print(f"{run.label}: exit {done.returncode} in {took:.0f} s", flush=True)
    if not report.exists():  # a run that could not even start leaves what it said
        report.write_text(json.dumps({"verdict": f"NO REPORT (exit {done.returncode})",
                                      "stderr": done.stderr[-2000:]}))  # fmt: skip
    return report


def machine() -> list[str]:
    """The machine in a few lines: platform, CPU, GPU, Python, torch and Triton."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    lines = [f"platform: {platform.platform()}", f"CPU: {cpu}, {os.cpu_count()} cores"]
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        lines += [f"GPU: {gpu}", f"torch {torch.__version__}"]
    except ImportError:
        lines.append("torch: not installed")
    try:
        import triton

        interpreted = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
        how = "interpreted on the CPU" if interpreted or gpu == "none" else "compiled"
        lines.append(f"Triton {triton.__version__} ({how})")
    except ImportError:
        lines.append("Triton: not installed")
    lines.append(f"Python {platform.python_version()}")
    return lines


def release(adapter: str) -> str:
    """Where the adapter's kernels came from (the installed engine or the pinned wheel)."""
    try:
        module_name = ADAPTERS[adapter].split(":")[0]
        module = importlib.import_module(module_name)
        if adapter == "flex":
            import torch

            return f"torch {torch.__version__}"
        backend = module.make_backend()
        return str(backend.source)
    except Exception as err:  # the row still says why it has none
        return f"unavailable ({type(err).__name__}: {err})"


def _ints(values: Iterable[int]) -> str:
    """A declared set of ints in a few words: ``16, 32, ..., 1024 (every 16)``, ``32..512``."""
    xs = sorted(values)
    if len(xs) <= 6:
        return ", ".join(map(str, xs))
    steps = {b - a for a, b in itertools.pairwise(xs)}
    if len(steps) == 1:
        step = steps.pop()
        if step == 1:
            return f"{xs[0]}..{xs[-1]}"
        return f"{xs[0]}, {xs[1]}, ..., {xs[-1]} (every {step})"
    return ", ".join(map(str, xs[:4])) + f", ... ({len(xs)} values)"


def declared(caps: Mapping[str, Any]) -> str:
    """The capabilities that shape what the suite draws, in one line."""
    parts = [f"dtypes {', '.join(caps.get('dtypes') or [])}"]
    kv = caps.get("kv_dtypes") or []
    parts.append(f"fp8 {', '.join(kv)}" if kv else "no fp8")
    for key, name in (("block_sizes", "block sizes"), ("head_dims", "head dims")):
        value = caps.get(key)
        parts.append(f"{name} {'any' if value is None else _ints(value)}")
    variants = caps.get("variants") or []
    parts.append(f"variants {', '.join(variants)}" if variants else "no variants")
    latent = caps.get("latent")
    if latent is None or latent:
        parts.append("latent " + ("any" if latent is None else str(latent)))
    parts.append(f"products {caps.get('products', 'exact')}")
    if caps.get("max_query_len") == 1:
        parts.append("decode only")
    if caps.get("table_width"):
        parts.append(f"table width {caps['table_width']}")
    split = caps.get("decode_split")
    parts.append(f"decode split: {split}" if split else "decode split undeclared")
    return "; ".join(parts)


def explanations(adapter: str) -> dict[str, str]:
    try:
        module = importlib.import_module(ADAPTERS[adapter].split(":")[0])
    except Exception:
        return {}
    return dict(getattr(module, "EXPLAINED", {}))


def explain(cause: str, first: str, known: Mapping[str, str]) -> str | None:
    """The adapter's line for ``cause`` whose first failure says ``first``: the first key whose
    first ``|``-separated part is in the cause and whose others are in the failure (case
    aside), if one is."""
    for key, line in known.items():
        name, *failure = key.lower().split("|")
        if name in cause.lower() and all(part in first.lower() for part in failure):
            return line
    return None


def row(run: Run, report: Mapping[str, Any], source: str, known: Mapping[str, str]) -> list[str]:
    """One adapter's section of the page."""
    caps = report.get("capabilities") or {}
    lines = [f"### {run.label}", "", f"* kernel: {KERNELS.get(run.adapter, run.adapter)}"]
    lines += [f"* release: {source}", f"* declares: {declared(caps) if caps else 'n/a'}"]
    verdict = str(report.get("verdict", "no verdict"))
    examples, wall = report.get("examples"), report.get("wall_time_s")
    ran = f" ({examples} examples, {wall:.0f} s)" if examples and wall else ""
    lines.append(f"* verdict: **{verdict.splitlines()[0]}**{ran}")
    causes = report.get("causes") or []
    failures = report.get("failures") or []
    if failures:
        lines.append(f"* distinct causes: {report.get('distinct_failures', len(causes))}")
    for cause in causes:
        name = str(cause.get("cause"))
        passes = "; ".join(cause.get("passes") or [])  # a pass's name may hold a comma
        lines.append(f"  * cause: {name} (passes: {passes})")
        first = next((f for f in failures if f.get("cause") == name), None)
        summary = "" if first is None else str(first.get("summary", "")).splitlines()[0]
        if summary:
            lines.append(f"    * first: {summary}")
        line = explain(name, summary, known)
        lines.append(f"    * why: {line}" if line else "    * why: not explained by the adapter")
    uncaused = [f for f in failures if not f.get("cause")]
    for failure in uncaused:
        summary = str(failure.get("summary", "")).splitlines()[0]
        lines.append(f"  * failure without a cause: pass {failure.get('pass')}: {summary}")
    return [*lines, ""]


def page(
    runs: Sequence[tuple[Run, Mapping[str, Any]]],
    sources: Mapping[str, str],
    machine_lines: Sequence[str],
    when: dt.datetime,
    profile: str,
    seed: int,
) -> str:
    """The matrix page from the runs' reports."""
    lines = [
        "# Conformance matrix: real paged-attention kernels",
        "",
        f"Written by `python -m benchmarks.matrix` on {when:%Y-%m-%d %H:%M} UTC, profile "
        f"`{profile}`, seed {seed}. Every line below comes from the reports of that run.",
        "",
        "Machine:",
        "",
        *(f"* {line}" for line in machine_lines),
        "",
        "| adapter | verdict | distinct causes |",
        "|---|---|---|",
    ]
    for run, report in runs:
        verdict = str(report.get("verdict", "no verdict")).splitlines()[0]
        lines.append(f"| {run.label} | {verdict} | {report.get('distinct_failures', 0) or 0} |")
    lines.append("")
    for run, report in runs:
        lines += row(run, report, sources.get(run.adapter, ""), explanations(run.adapter))
    return "\n".join(lines)


def _run_date(reports: Sequence[Path]) -> dt.datetime:
    """When the run the page reports ended: its last report's time (``--from-reports`` writes
    the page later, but dates it by the run)."""
    return dt.datetime.fromtimestamp(max(path.stat().st_mtime for path in reports), dt.UTC)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.matrix", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/matrix.md"))
    parser.add_argument("--reports", type=Path, default=Path("out/matrix"))
    parser.add_argument(
        "--from-reports",
        action="store_true",
        help="write the page from the reports in --reports, without running",
    )
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="these adapters only")
    args, extra = parser.parse_known_args(argv)
    chosen = [r for r in RUNS if not args.only or r.adapter in args.only]
    args.reports.mkdir(parents=True, exist_ok=True)
    results = []
    for run in chosen:
        path = args.reports / run.file
        if not args.from_reports:
            path = run_one(run, args.reports, args.profile, args.seed, extra)
        if not path.exists():
            parser.error(f"no report {path}: run without --from-reports first")
        results.append((run, json.loads(path.read_text())))
    sources = {run.adapter: release(run.adapter) for run in chosen}
    now = _run_date([args.reports / run.file for run in chosen])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_output(args.out, page(results, sources, machine(), now, args.profile, args.seed) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
