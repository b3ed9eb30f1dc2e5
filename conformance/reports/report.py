"""Reports of a run: text for a person, JSON and JUnit XML for CI, a replay script for a failure.

The replay script is the shrunk failing workload as plain Python: it loads the
same backend by the same name and applies the same operations through a
:class:`~conformance.lockstep.driver.Lockstep`, which raises
:class:`~conformance.lockstep.driver.ConformanceFailure` at the first difference.
A run with the bounds check on replays with the same check (a fresh
:class:`~conformance.bounds.checker.BoundsChecker` of the same mode), so a bounds
failure replays as one; its reports carry the checker's summary and notes.
"""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET
from collections.abc import Set as AbstractSet
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

from conformance.bounds.checker import CONTRACT
from conformance.interpreter.limits import limit_in
from conformance.interpreter.specialisations import counts
from conformance.output_files import junit_suite, write_output
from conformance.reports.failures import failure_lines
from conformance.run import replay
from conformance.run.failures import by_cause, distinct
from conformance.run.profiles import PROFILES
from conformance.run.replay import portable_ref
from conformance.run.result import RunResult
from spec.capabilities import Capabilities

INTERRUPTED = "INTERRUPTED (Ctrl-C or SIGTERM)"
"""The verdict's first words for a run the user stopped (SIGTERM is handled as SIGINT)."""


def replay_script(result: RunResult) -> str:
    """A runnable Python script that replays the failing workload against the same backend."""
    return replay.script(result.backend, result.workload, result.control.check_bounds)


def reproduce_command(result: RunResult) -> str:
    if result.reproduce:
        return result.reproduce
    mode = result.control.check_bounds
    return (
        f"python -m conformance run --backend {shlex.quote(portable_ref(result.backend))} "
        f"--profile {result.profile} --seed {result.seed}"
        + (f" --check-bounds {mode}" if mode else "")
        + (f" --shard {result.shard.describe()}" if result.shard else "")
        + (f" --jobs {result.jobs}" if result.jobs > 1 else "")
    )


def text_report(result: RunResult) -> str:
    """The summary a person reads: verdict, what ran, what was skipped, and any difference."""
    s = result.stats
    first, *rest = summary_lines(result)
    lines = [
        first,
        *headline(result),
        *rest,
        *_drawn_lines(result),
        "  rules exercised:",
        *(f"    {count:7d}  {name}" for name, count in sorted(s.rules.items())),
        "  invariants checked:",
        *(f"    {count:7d}  {name}" for name, count in sorted(s.checks.items())),
        f"  shapes run: {len(s.configs)} distinct (dtype, block size, heads, head dim)",
        *_coverage_lines(result),
    ]
    lines += ["  skipped:", *(f"    {why}" for why in _skips(result))] if _skips(result) else []
    if result.difference is not None:
        lines += ["", *failure_lines(result)] if len(result.failures) > 1 else []
        lines += ["", "FIRST DIFFERENCE", result.difference.describe()]
        lines += _nondeterminism_lines(result)
        if result.diagnostics:
            lines += ["", "WHAT THE BACKEND PROCESS PRINTED LAST", *result.diagnostics]
        if result.workload:
            lines += ["", _workload_header(result), replay_script(result)]
        lines.append(f"reproduce the run: {reproduce_command(result)}")
    return "\n".join(lines)


def headline(result: RunResult) -> list[str]:
    """The first difference, right under the verdict: where, and the named mistake that
    reproduces it (:mod:`conformance.judges.hypotheses`) when one does."""
    diff = result.difference
    if diff is None:
        return []
    first = diff.describe().splitlines()[0]
    named = [f"  {line.strip()}" for line in (diff.diagnosis or "").splitlines()[:1]]
    return [f"  first difference: {first}", *named]


def _drawn_lines(result: RunResult) -> list[str]:
    """The attention variants and KV dtypes the run's examples drew, with how many examples."""
    drawn = result.stats.drawn
    if not drawn:
        return []
    return [
        "  drawn variants and dtypes (examples): "
        + ", ".join(f"{name} {n}" for name, n in sorted(drawn.items()))
    ]


def _coverage_lines(result: RunResult) -> list[str]:
    """Where the examples came from (envelope, passes, declared sets) and what they reached."""
    passes = ", ".join(f"{name} {count}" for name, count in result.passes)
    lines = [f"  envelope: {result.envelope}; passes (examples asked): {passes}"]
    lines += [f"  drawn: {note}" for note in result.notes]
    lines += [f"  judged by: {result.oracle}"] if result.oracle else []
    lines += ["  coverage:", *(f"    {line}" for line in result.stats.coverage.describe())]
    margins = result.stats.margins.describe()
    lines += ["  numerics (the most of each allowance used):", *(f"    {m}" for m in margins)]
    return lines + _time_lines(result) + _specialisation_lines(result)


def _time_lines(result: RunResult) -> list[str]:
    """Where the run's time went: the backend's calls (of which compiling kernels), the rest
    the suite's own (the spec, the references, the comparisons, drawing)."""
    s = result.stats
    backend = sum(s.call_seconds.values())
    if not backend:
        return []
    compiled = (
        f", of which compiling {s.compiles} Triton kernels {s.compile_seconds:.1f} s"
        if s.compiles
        else ""
    )
    suite = max(result.wall_time_s * max(result.jobs, 1) - backend, 0.0)
    return [f"  time: backend calls {backend:.1f} s{compiled}; the suite {suite:.1f} s"]


def _specialisation_lines(result: RunResult) -> list[str]:
    """How many kernel specialisations the run launched under the interpreter: what a compiled
    run of the same seed compiles once each (:mod:`conformance.interpreter.specialisations`)."""
    keys = result.stats.specialisations
    if not keys:
        return []
    per = ", ".join(f"{kernel} {n}" for kernel, n in counts(keys).items())
    return [
        f"  Triton specialisations launched (a compiled run compiles each once): {len(keys)}: {per}"
    ]


def _skips(result: RunResult) -> list[str]:
    """Every skip: the plan's, then attention the backend could not run, with how often."""
    during = [f"{why} ({n} times)" for why, n in sorted(result.stats.skips.items())]
    return [*result.skipped, *during]


def summary_lines(result: RunResult) -> list[str]:
    """The report's first lines: backend, profile, seed and verdict; what ran; how it was run."""
    s = result.stats
    return [
        f"conformance: backend {result.backend!r} "
        f"(profile {result.profile}, seed {result.seed}{_shard(result)}): {verdict(result)}"
        + _poison_note(result),
        f"  {_examples(result)}, {s.steps} steps, longest sequence {s.longest} tokens, "
        f"{result.wall_time_s:.1f} s",
        *_products_line(result.capabilities),
        *_run_lines(result),
    ]


def _poison_note(result: RunResult) -> str:
    """What the verdict does not cover, on its own line's end: with ``--poison finite`` (or
    ``off``), reads of memory no token owns were not judged for NaN.

    >>> from conformance.lockstep.machine import RunStats
    >>> from conformance.run.control import RunControl
    >>> r = RunResult("x", "quick", 1, Capabilities("x"), (), RunStats(),
    ...               control=RunControl(poison="finite"))
    >>> _poison_note(r)
    ' (reads of slots no token owns were not judged for NaN: --poison finite)'
    """
    mode = result.control.poison
    if mode == "nan":
        return ""
    return f" (reads of slots no token owns were not judged for NaN: --poison {mode})"


def _products_line(caps: Capabilities) -> list[str]:
    """Under which declared product precision the outputs were judged, when not the default."""
    if caps.products == "exact":
        return []
    return [
        f"  products: the backend declares {caps.products!r} "
        f"({PRODUCT_WORDS[caps.products]}): its outputs were judged beside a same-precision "
        "reference that rounds them so"
    ]


PRODUCT_WORDS = {
    "tf32": "float32 products on TF32 operands",
    "activation": "each q.k product rounded to the activation dtype",
    "fp8": "Q and P cast to the fp8 cache dtype",
    "normalised": "probabilities normalised, then rounded to the activation dtype before P @ V",
}
"""How a report names each declared product precision (:data:`spec.capabilities.PRODUCTS`)."""


def _shard(result: RunResult) -> str:
    """``, shard K/N`` for one shard of a run (its examples are every N-th), and ``, in J
    jobs`` for shards run side by side; else nothing."""
    shard = "" if result.shard is None else f", shard {result.shard.describe()}"
    return shard + (f", in {result.jobs} jobs" if result.jobs > 1 else "")


def verdict(result: RunResult) -> str:
    """One phrase that cannot be mistaken: a full pass, a pass within a budget, or the failure.

    >>> from conformance.lockstep.machine import RunStats
    >>> from spec.backend import Capabilities
    >>> cut = RunResult("x", "quick", 1, Capabilities("x"), (), RunStats(examples=9))
    >>> cut.stopped = "time budget"
    >>> verdict(cut)
    'PARTIAL: passed within the time budget: 9 examples'
    """
    if result.interrupted:
        return f"{INTERRUPTED}: no verdict"
    if result.difference is None:
        if result.stopped:
            return f"PARTIAL: passed within the {result.stopped}: {result.stats.examples} examples"
        return "PASSED"
    if result.nondeterminism is not None:
        return "FAILED: the backend is not deterministic"
    limit = limit_in(result.difference.detail) if result.difference.what == "exception" else None
    if limit is not None:
        return f"NOT JUDGED: {limit.split(';')[0]} (not a kernel bug: run it on a GPU)"
    return {
        "crash": "FAILED: the backend process crashed",
        "hang": "FAILED: a backend call hung",
        "bounds": "FAILED: a kernel accessed memory out of bounds",
        "internal": "FAILED: the run stopped with an error",
    }.get(result.difference.what, "FAILED")


def _run_lines(result: RunResult) -> list[str]:
    """How the run was bounded: a time budget that cut it short, the slowest call, isolation."""
    c, lines = result.control, []
    short, long = result.requested
    if result.stopped:
        lines.append(
            f"  stopped early: the {result.stopped} ({c.time_budget_s:g} s) was spent; the run "
            f"asked for {short} + {long} long-context examples: this is not a full run"
        )
    elif long == 0:
        lines.append("  long-context examples: none (0 asked for)")
    call, seconds = result.slowest_call
    timeout = "none" if c.call_timeout_s is None else f"{c.call_timeout_s:g} s"
    where = "in a child process" if result.isolated else "in this process"
    slowest = f"slowest {seconds:.2f} s: {call}" if call else "none made"
    lines.append(f"  backend calls {where}; {slowest}; per-call timeout {timeout}")
    return lines + _bounds_lines(result)


def _bounds_lines(result: RunResult) -> list[str]:
    """The bounds check, when it was on: what it checked, its notes, and the rule it enforces."""
    mode = result.control.check_bounds
    if mode is None:
        return []
    if result.bounds is None:
        return [f"  bounds check ({mode}): the run ended before the checker's summary"]
    first, *notes = result.bounds.lines()
    lines = [f"  {first} (in every example run, replays included)", *(f"  {n}" for n in notes)]
    if result.difference is not None and result.difference.what == "bounds":
        lines.append(f"  the contract (spec.batch.PADDING_RULE): {CONTRACT}")
    return lines


def _nondeterminism_lines(result: RunResult) -> list[str]:
    if result.nondeterminism is not None:
        first, again = result.nondeterminism
        if result.difference is not None and first == result.difference.describe():
            first = "the difference above"
        return [
            "",
            "THE BACKEND IS NOT DETERMINISTIC: the same workload gave two outcomes",
            "  first run:",
            *(f"    {line}" for line in first.splitlines()),
            "  replay of the workload below:",
            *(f"    {line}" for line in again.splitlines()),
        ]
    if result.flaky:
        return ["  (flaky: the failure vanished on one replay but came back on another)"]
    return []


def _workload_header(result: RunResult) -> str:
    run = "(save as replay.py, run: python replay.py)"
    if result.shrunk:
        note = f"\n{result.shrink_note}" if result.shrink_note else ""
        return f"SHRUNK FAILING WORKLOAD {run}{note}"
    why = result.shrink_note or "not shrunk"
    return f"FAILING WORKLOAD, {why} {run}"


def _examples(result: RunResult) -> str:
    s = result.stats
    if s.first_failure_example is None:
        return f"{s.examples} examples"
    total = "with shrinking" if result.shrunk else "in all"
    return f"failed in example {s.first_failure_example}; {s.examples} examples {total}"


def json_report(result: RunResult) -> dict[str, Any]:
    s = result.stats
    return {
        "backend": result.backend,
        "profile": result.profile,
        "profile_settings": {
            "max_examples": PROFILES[result.profile].max_examples,
            "steps": PROFILES[result.profile].steps,
            "long_examples": PROFILES[result.profile].long_examples,
        },
        "seed": result.seed,
        "shard": None if result.shard is None else result.shard.describe(),
        "jobs": result.jobs,
        "passed": result.passed,
        "verdict": verdict(result),
        "complete": result.complete,
        "partial": result.partial,
        "stopped": result.stopped,
        "interrupted": result.interrupted,
        "requested": {"examples": result.requested[0], "long_examples": result.requested[1]},
        "control": asdict(result.control),
        "isolated": result.isolated,
        "slowest_call": {"call": result.slowest_call[0], "seconds": result.slowest_call[1]},
        "bounds": None if result.bounds is None else result.bounds.to_json(),
        "wall_time_s": round(result.wall_time_s, 3),
        "examples": s.examples,
        "first_failure_example": s.first_failure_example,
        "steps": s.steps,
        "longest_sequence": s.longest,
        "rules": dict(sorted(s.rules.items())),
        "invariants": dict(sorted(s.checks.items())),
        "shapes": dict(sorted(s.configs.items())),
        "envelope": result.envelope,
        "passes": [{"pass": name, "examples": count} for name, count in result.passes],
        "drawn": list(result.notes),
        "oracle": result.oracle,
        "drawn_features": dict(sorted(s.drawn.items())),
        "coverage": s.coverage.to_json(),
        "numerics_margins": {
            "step_excess": dict(sorted(s.margins.step.items())),
            "example_mean_share": dict(sorted(s.margins.mean.items())),
            "example_lean_ulps": dict(sorted(s.margins.lean.items())),
        },
        "specialisations": {
            "total": len(s.specialisations),
            "per_kernel": counts(s.specialisations),
        },
        "time_split": {
            "backend_s": round(sum(s.call_seconds.values()), 3),
            "backend_by_call_s": {k: round(v, 3) for k, v in sorted(s.call_seconds.items())},
            "compiles": s.compiles,
            "compile_s": round(s.compile_seconds, 3),
            "wall_s": round(result.wall_time_s, 3),
            "jobs": result.jobs,
        },
        "skipped": _skips(result),
        "capabilities": _capabilities(result.capabilities),
        "failure": None
        if result.difference is None
        else {
            "difference": result.difference.to_json(),
            "summary": result.difference.describe(),
            "replay_script": replay_script(result),
            "reproduce": reproduce_command(result),
            "flaky": result.flaky,
            "kind": result.difference.what,
            "shrunk": result.shrunk,
            "shrink_note": result.shrink_note,
            "nondeterministic": result.nondeterminism is not None,
            "outcomes": None
            if result.nondeterminism is None
            else dict(zip(("first", "replay"), result.nondeterminism, strict=True)),
            "diagnostics": list(result.diagnostics),
        },
        "failures": [f.to_json() for f in result.failures],
        "distinct_failures": len(distinct(result.failures)),
        "causes": [
            {
                "cause": group[0].cause,
                "isolated": group[0].isolated,
                "passes": [f.pass_name for f in group],
            }
            for group in by_cause(result.failures)
        ],
    }


def _capabilities(caps: Capabilities) -> dict[str, Any]:
    """Every declared field (sets sorted, ``None`` for "any"); the excludes hook by presence."""
    out: dict[str, Any] = {}
    for f in fields(caps):
        value = getattr(caps, f.name)
        if f.name == "excludes":
            value = value is not None
        elif is_dataclass(value) and not isinstance(value, type):
            value = asdict(value)
        elif isinstance(value, AbstractSet):
            value = sorted(value)
        out[f.name] = value
    return out


def write_json(result: RunResult, path: Path) -> None:
    """The JSON report, written by :func:`conformance.output_files.write_output`'s rule."""
    write_output(path, json.dumps(json_report(result), indent=2) + "\n")


def write_junit(result: RunResult, path: Path) -> None:
    """One test case for the lockstep run (and one per further distinct failing pass), and one
    skipped case per skipped capability."""
    counts = {
        "tests": max(1, len(distinct(result.failures))) + len(_skips(result)),
        "failures": max(len(distinct(result.failures)), int(result.difference is not None)),
        "errors": int(result.interrupted),
        "skipped": len(_skips(result)),
    }
    properties = (
        ("backend", result.backend),
        ("profile", result.profile),
        ("seed", str(result.seed)),
        *((("shard", result.shard.describe()),) if result.shard else ()),
        *((("jobs", str(result.jobs)),) if result.jobs > 1 else ()),
        ("verdict", verdict(result)),
        ("complete", str(result.complete).lower()),
        *(("bounds", line) for line in ([] if result.bounds is None else result.bounds.lines())),
    )
    suite = junit_suite("conformance", counts, result.wall_time_s, properties)
    classname = f"conformance.{result.backend}"
    case = ET.SubElement(
        suite, "testcase", classname=classname, name="lockstep", time=f"{result.wall_time_s:.3f}"
    )
    if result.difference is not None:
        failure = ET.SubElement(
            case, "failure", message=result.difference.describe().splitlines()[0]
        )
        failure.text = text_report(result)
    elif result.interrupted:
        ET.SubElement(case, "error", message=verdict(result)).text = text_report(result)
    elif result.partial:
        ET.SubElement(case, "system-out").text = text_report(result)
    for later in distinct(result.failures)[1:]:  # the first is the lockstep case's
        name = f"lockstep ({later.pass_name})"
        other = ET.SubElement(suite, "testcase", classname=classname, name=name)
        ET.SubElement(other, "failure", message=later.headline()).text = (
            later.difference.describe() + "\n\n" + "\n".join(later.workload)
        )
    for why in _skips(result):
        skipped = ET.SubElement(
            ET.SubElement(suite, "testcase", classname=classname, name=why), "skipped"
        )
        skipped.set("message", why)
    write_output(path, ET.tostring(suite, encoding="unicode", xml_declaration=True))
