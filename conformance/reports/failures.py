"""The report's list of failures: one entry per distinct cause, not per failing pass.

The first failure is the report's headline (FIRST DIFFERENCE, the replay
script). A cause (:mod:`conformance.run.causes`) found in several passes is one
entry, with the passes that showed it; a failure whose cause was not isolated
is an entry of its own. Each failure keeps its replay lines in the JSON report.
"""

from __future__ import annotations

from conformance.run.failures import PassFailure, by_cause
from conformance.run.result import RunResult


def failure_lines(result: RunResult) -> list[str]:
    """``FAILURES: n distinct causes, in m failing passes`` and one entry per cause: its name,
    the first failure's headline, and the other passes that showed it."""
    groups = by_cause(result.failures)
    if not groups:
        return []
    n, m = len(groups), len(result.failures)
    lines = [f"FAILURES: {n} distinct cause{'s' * (n != 1)}, in {m} failing pass{'es' * (m != 1)}"]
    for number, group in enumerate(groups, 1):
        first = group[0]
        lines.append(f"  {number}. {_cause_words(first)}")
        note = " (not deterministic)" if first.nondeterminism is not None else ""
        lines.append(f"     {first.headline()}{note}")
        more = [f.pass_name for f in group[1:]]
        if more:
            passes = f"pass{'es' * (len(more) > 1)}"
            lines.append(f"     also in {len(more)} more {passes}: {', '.join(more)}")
    return lines


def _cause_words(failure: PassFailure) -> str:
    if failure.cause is None:
        return "no cause named (a fault of the backend process or the run)"
    return f"cause: {failure.cause}" if failure.isolated else f"cause {failure.cause}"
