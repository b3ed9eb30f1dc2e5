"""Reports of a scheduler-suite run: text for a person, JSON and JUnit XML for CI, a replay script.

The same shapes as the backend suite's (:mod:`conformance.reports.report`): a verdict
line with the seed, what ran, and for a failure the rule, the step, and the
shrunk workload as plain Python that rebuilds it and calls
:func:`conformance.scheduler.suite.check_workload`, which raises
:class:`~conformance.scheduler.rules.SchedulerInvariantError` at the violation.

>>> from spec.request import Request
>>> print(python_call(Request(request_id=0, prompt=(5, 6), max_new_tokens=2, n=2)))
Request(request_id=0, prompt=(5, 6), max_new_tokens=2, n=2)
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from conformance.output_files import junit_suite, write_output
from conformance.reports.report import INTERRUPTED
from conformance.run.replay import portable_ref
from conformance.scheduler.engine import EQUIVALENCE
from conformance.scheduler.suite import PROFILES, SchedulerRunResult
from conformance.scheduler.workloads import Workload


def python_call(obj: Any) -> str:
    """A dataclass instance as the constructor call that rebuilds it, defaults left out."""
    args = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.init and (f.default is dataclasses.MISSING or value != f.default):
            args.append(f"{f.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(args)})"


def workload_source(w: Workload) -> list[str]:
    """Python lines that assign the workload to ``workload``."""
    return [
        "workload = Workload(",
        f"    config={python_call(w.config)},",
        "    requests=(",
        *(f"        {python_call(r)}," for r in w.requests),
        "    ),",
        f"    arrivals={w.arrivals!r},",
        f"    aborts={w.aborts!r},",
        ")",
    ]


def replay_script(result: SchedulerRunResult) -> str:
    """A runnable script: rebuild the shrunk workload, check it against the same scheduler."""
    assert result.workload is not None and result.failure is not None
    return "\n".join(
        [
            f'"""Replays a failing scheduler workload for {result.scheduler!r}.',
            "",
            f"Raises SchedulerInvariantError ({result.failure.rule}) at the violation.",
            '"""',
            "from conformance.scheduler.suite import check_workload, load_scheduler",
            "from conformance.scheduler.workloads import Workload",
            "from spec.request import Request",
            "from spec.scheduler import SchedulerConfig",
            "",
            f"make = load_scheduler({portable_ref(result.scheduler)!r})",
            *workload_source(result.workload),
            "check_workload(make, workload)",
            'print("no violation: this workload passes")',
            "",
        ]
    )


def reproduce_command(result: SchedulerRunResult) -> str:
    return (
        "python -m conformance scheduler --scheduler "
        f"{shlex.quote(portable_ref(result.scheduler))} "
        f"--profile {result.profile} --seed {result.seed}"
    )


def verdict(result: SchedulerRunResult) -> str:
    """One phrase that cannot be mistaken: a pass, a partial pass, an interruption, a failure."""
    if result.interrupted:
        return f"{INTERRUPTED}: no verdict"
    if result.passed:
        if result.stopped:
            return f"PARTIAL: passed within the {result.stopped}: {result.stats.examples} examples"
        return "PASSED"
    return {
        "hang": "FAILED: a scheduler call hung",
        "crash": "FAILED: the scheduler process crashed",
        "internal": "FAILED: the run stopped with an error",
    }.get(result.kind or "", "FAILED")


def _run_lines(result: SchedulerRunResult) -> list[str]:
    """How the run was bounded: a time budget that cut it short, the slowest call, isolation."""
    lines = []
    if result.stopped:
        lines.append(
            f"  stopped early: the {result.stopped} ({result.time_budget_s:g} s) was spent; the "
            "run asked for more examples: this is not a full run"
        )
    call, seconds = result.slowest_call
    timeout = "none" if result.call_timeout_s is None else f"{result.call_timeout_s:g} s"
    where = "in a child process" if result.isolated else "in this process"
    slowest = f"slowest {seconds:.2f} s: {call}" if call else "none made"
    lines.append(f"  scheduler calls {where}; {slowest}; per-call timeout {timeout}")
    return lines


def text_report(result: SchedulerRunResult) -> str:
    """The summary a person reads: verdict, what ran, what was skipped, and any violation."""
    s = result.stats
    sizes = ", ".join(str(b) for b in sorted(s.block_sizes))
    lines = [
        f"conformance: scheduler {result.scheduler!r} "
        f"(profile {result.profile}, seed {result.seed}): {verdict(result)}",
        f"  {_examples(result)}, {s.requests} requests, {s.steps} steps, "
        f"{result.wall_time_s:.1f} s",
        *_run_lines(result),
        "  paths exercised:",
        *(f"    {count:7d}  {name}" for name, count in sorted(s.paths.items())),
        "  invariants checked:",
        *(f"    {count:7d}  {name}" for name, count in sorted(s.checks.items())),
        f"  block sizes run: {sizes}",
    ]
    lines += ["  skipped:", *(f"    {why}" for why in result.skipped)] if result.skipped else []
    if result.failure is not None:
        f = result.failure
        lines += ["", f"VIOLATION of {f.rule!r} at step {f.step}", f"  {f.detail}"]
        if result.flaky:
            lines.append("  (flaky: it failed once but not on replay; nondeterminism?)")
        if result.diagnostics:
            lines += ["", "WHAT THE SCHEDULER PROCESS PRINTED LAST", *result.diagnostics]
        if result.workload is not None:
            lines += ["", _workload_header(result), replay_script(result)]
        lines.append(f"reproduce the run: {reproduce_command(result)}")
    return "\n".join(lines)


def _workload_header(result: SchedulerRunResult) -> str:
    run = "(save as replay.py, run: python replay.py)"
    if result.kind == "hang":
        return f"FAILING WORKLOAD, not shrunk: each replay of a hang costs the whole timeout {run}"
    if result.kind == "crash":
        return f"FAILING WORKLOAD, not shrunk: the scheduler process crashed {run}"
    return f"SHRUNK FAILING WORKLOAD {run}"


def _examples(result: SchedulerRunResult) -> str:
    s = result.stats
    if s.first_failure_example is None:
        return f"{s.examples} examples"
    return f"failed in example {s.first_failure_example}; {s.examples} examples with shrinking"


def _jsonable(value: Any) -> Any:
    if isinstance(value, frozenset | set):
        return sorted(value)
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def json_report(result: SchedulerRunResult) -> dict[str, Any]:
    s, p = result.stats, PROFILES[result.profile]
    failure = result.failure
    return {
        "scheduler": result.scheduler,
        "profile": result.profile,
        "profile_settings": {
            "max_examples": p.max_examples,
            "max_requests": p.max_requests,
            "max_prompt": p.max_prompt,
            "max_new": p.max_new,
            "shrink_runs": p.shrink_runs,
        },
        "seed": result.seed,
        "passed": result.passed,
        "verdict": verdict(result),
        "complete": result.complete,
        "partial": result.partial,
        "stopped": result.stopped,
        "interrupted": result.interrupted,
        "isolated": result.isolated,
        "call_timeout_s": result.call_timeout_s,
        "time_budget_s": result.time_budget_s,
        "slowest_call": {"call": result.slowest_call[0], "seconds": result.slowest_call[1]},
        "wall_time_s": round(result.wall_time_s, 3),
        "examples": s.examples,
        "first_failure_example": s.first_failure_example,
        "requests": s.requests,
        "steps": s.steps,
        "paths": dict(sorted(s.paths.items())),
        "invariants": dict(sorted(s.checks.items())),
        "block_sizes": {str(b): n for b, n in sorted(s.block_sizes.items())},
        "skipped": list(result.skipped),
        "failure": None
        if failure is None
        else {
            "kind": result.kind,
            "rule": failure.rule,
            "step": failure.step,
            "detail": failure.detail,
            "workload": _jsonable(result.workload),
            "replay_script": None if result.workload is None else replay_script(result),
            "reproduce": reproduce_command(result),
            "flaky": result.flaky,
            "diagnostics": list(result.diagnostics),
        },
    }


def write_json(result: SchedulerRunResult, path: Path) -> None:
    """The JSON report, written by :func:`conformance.output_files.write_output`'s rule."""
    write_output(path, json.dumps(json_report(result), indent=2) + "\n")


def write_junit(result: SchedulerRunResult, path: Path) -> None:
    """Two test cases: the invariants, and token-exact equivalence (skipped where unsupported)."""
    failure = result.failure
    counts = {
        "tests": 2,
        "failures": int(failure is not None),
        "errors": int(result.interrupted),
        "skipped": len(result.skipped),
    }
    properties = (
        ("scheduler", result.scheduler),
        ("profile", result.profile),
        ("seed", str(result.seed)),
        ("verdict", verdict(result)),
        ("complete", str(result.complete).lower()),
    )
    suite = junit_suite("conformance-scheduler", counts, result.wall_time_s, properties)
    classname = f"conformance.scheduler.{result.scheduler}"
    for name in ("invariants", EQUIVALENCE):
        case = ET.SubElement(suite, "testcase", classname=classname, name=name)
        case.set("time", f"{result.wall_time_s:.3f}")
        if failure is not None and (failure.rule == EQUIVALENCE) == (name == EQUIVALENCE):
            element = ET.SubElement(case, "failure", message=f"{failure.rule}: {failure}")
            element.text = text_report(result)
        elif name == EQUIVALENCE and result.skipped:
            ET.SubElement(case, "skipped", message=result.skipped[0])
        elif name != EQUIVALENCE and result.interrupted:
            ET.SubElement(case, "error", message=verdict(result)).text = text_report(result)
        elif name != EQUIVALENCE and result.partial:
            ET.SubElement(case, "system-out").text = text_report(result)
    write_output(path, ET.tostring(suite, encoding="unicode", xml_declaration=True))
