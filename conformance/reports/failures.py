"""The report's list of failing passes: every distinct failure, not only the first.

The first failure is the report's headline (FIRST DIFFERENCE, the replay
script); the others are listed here with their pass, kind and first
difference, grouped by the cause each pass was drawn again without, and each
carries its own replay lines in the JSON report.
"""

from __future__ import annotations

from conformance.run.failures import distinct
from conformance.run.runner import RunResult


def failure_lines(result: RunResult) -> list[str]:
    """``FAILURES (n passes)`` and one line per distinct failure, grouped by cause (the dtype,
    KV dtype or variant each pass was drawn again without); nothing when none failed."""
    found = distinct(result.failures)
    if not found:
        return []
    lines = [f"FAILURES: {len(found)} distinct, in {len(result.failures)} failing passes"]
    causes = list(dict.fromkeys(f.cause for f in found))
    number = 0
    for cause in causes:
        lines.append(f"  {'cause: ' + cause if cause else 'no cause named (a fault)'}")
        for failure in (f for f in found if f.cause == cause):
            number += 1
            note = " (not deterministic)" if failure.nondeterminism is not None else ""
            lines.append(f"    {number}. {failure.headline()}{note}")
    return lines
