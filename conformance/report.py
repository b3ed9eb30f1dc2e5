"""Reports of a run: text for a person, JSON and JUnit XML for CI, a replay script for a failure.

The replay script is the shrunk failing workload as plain Python: it loads the
same backend by the same name and applies the same operations through a
:class:`~conformance.lockstep.Lockstep`, which raises
:class:`~conformance.lockstep.ConformanceFailure` at the first difference.
"""

from __future__ import annotations

import json
import os
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from conformance.runner import PROFILES, RunResult


def portable_ref(ref: str) -> str:
    """``ref`` with a ``file.py:factory`` path made absolute, so it loads from any directory.

    >>> portable_ref("reference")
    'reference'
    >>> portable_ref("/abs/my_backend.py:make")
    '/abs/my_backend.py:make'
    """
    module, sep, attr = ref.rpartition(":")
    if not sep or not (module.endswith(".py") or "/" in module or os.sep in module):
        return ref
    return f"{Path(module).resolve()}:{attr}"


def replay_script(result: RunResult) -> str:
    """A runnable Python script that replays the failing workload against the same backend."""
    return "\n".join(
        [
            f'"""Replays a failing conformance workload for backend {result.backend!r}.',
            "",
            "Raises conformance.ConformanceFailure at the first difference.",
            '"""',
            "from conformance import Lockstep, WorkloadConfig, load_backend",
            "from spec.attention import AttentionVariant",
            "from spec.backend import KVGeometry",
            "",
            f"backend = load_backend({portable_ref(result.backend)!r})",
            *result.workload,
            'print("no difference: this workload passes")',
            "",
        ]
    )


def reproduce_command(result: RunResult) -> str:
    return (
        f"python -m conformance run --backend {shlex.quote(portable_ref(result.backend))} "
        f"--profile {result.profile} --seed {result.seed}"
    )


def text_report(result: RunResult) -> str:
    """The summary a person reads: verdict, what ran, what was skipped, and any difference."""
    s = result.stats
    verdict = "PASSED" if result.passed else "FAILED"
    lines = [
        f"conformance: backend {result.backend!r} "
        f"(profile {result.profile}, seed {result.seed}): {verdict}",
        f"  {_examples(result)}, {s.steps} steps, longest sequence {s.longest} tokens, "
        f"{result.wall_time_s:.1f} s",
        "  rules exercised:",
        *(f"    {count:7d}  {name}" for name, count in sorted(s.rules.items())),
        "  invariants checked:",
        *(f"    {count:7d}  {name}" for name, count in sorted(s.checks.items())),
        f"  shapes run: {len(s.configs)} distinct (dtype, block size, heads, head dim)",
        *_coverage_lines(result),
    ]
    lines += ["  skipped:", *(f"    {why}" for why in _skips(result))] if _skips(result) else []
    if result.difference is not None:
        lines += ["", "FIRST DIFFERENCE", result.difference.describe()]
        if result.flaky:
            lines.append("  (flaky: the backend failed once but not on replay; nondeterminism?)")
        lines += [
            "",
            "SHRUNK FAILING WORKLOAD (save as replay.py, run: python replay.py)",
            replay_script(result),
            f"reproduce the run: {reproduce_command(result)}",
        ]
    return "\n".join(lines)


def _coverage_lines(result: RunResult) -> list[str]:
    """Where the examples came from (envelope, passes, declared sets) and what they reached."""
    passes = ", ".join(f"{name} {count}" for name, count in result.passes)
    lines = [f"  envelope: {result.envelope}; passes (examples asked): {passes}"]
    lines += [f"  drawn: {note}" for note in result.notes]
    lines += ["  coverage:", *(f"    {line}" for line in result.stats.coverage.describe())]
    return lines


def _skips(result: RunResult) -> list[str]:
    """Every skip: the plan's, then attention the backend could not run, with how often."""
    during = [f"{why} ({n} times)" for why, n in sorted(result.stats.skips.items())]
    return [*result.skipped, *during]


def _examples(result: RunResult) -> str:
    s = result.stats
    if s.first_failure_example is None:
        return f"{s.examples} examples"
    return f"failed in example {s.first_failure_example}; {s.examples} examples with shrinking"


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
        "passed": result.passed,
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
        "coverage": s.coverage.to_json(),
        "skipped": _skips(result),
        "capabilities": {
            "name": result.capabilities.name,
            "device": result.capabilities.device,
            "dtypes": sorted(result.capabilities.dtypes),
        },
        "failure": None
        if result.difference is None
        else {
            "difference": result.difference.to_json(),
            "summary": result.difference.describe(),
            "replay_script": replay_script(result),
            "reproduce": reproduce_command(result),
            "flaky": result.flaky,
        },
    }


def write_json(result: RunResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_report(result), indent=2) + "\n")


def write_junit(result: RunResult, path: Path) -> None:
    """One test case for the lockstep run, and one skipped case per skipped capability."""
    suite = ET.Element(
        "testsuite",
        name="conformance",
        tests=str(1 + len(_skips(result))),
        failures=str(int(not result.passed)),
        errors="0",
        skipped=str(len(_skips(result))),
        time=f"{result.wall_time_s:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    for name, value in (
        ("backend", result.backend),
        ("profile", result.profile),
        ("seed", str(result.seed)),
    ):
        ET.SubElement(props, "property", name=name, value=value)
    classname = f"conformance.{result.backend}"
    case = ET.SubElement(
        suite, "testcase", classname=classname, name="lockstep", time=f"{result.wall_time_s:.3f}"
    )
    if result.difference is not None:
        failure = ET.SubElement(
            case, "failure", message=result.difference.describe().splitlines()[0]
        )
        failure.text = text_report(result)
    for why in _skips(result):
        skipped = ET.SubElement(
            ET.SubElement(suite, "testcase", classname=classname, name=why), "skipped"
        )
        skipped.set("message", why)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)
