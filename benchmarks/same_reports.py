"""Two runs' reports compared, timings masked: the proof that a change of structure changed no
verdict, no count and no line of output.

``python -m benchmarks.same_reports BEFORE AFTER`` takes two files of the same kind: JSON
reports (``run --report``), or text (a run's or the selftest's standard output). It masks
what varies from run to run of the same seed (wall-clock seconds, the slowest call, the
per-job progress lines, temporary paths) and prints every line that still differs, or
``same`` and exits 0. A JSON report is compared key by key, timings (``time_split``,
``wall_time_s``, ``slowest_call``) left out.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any

_VARIES = (
    (re.compile(r"\d+(\.\d+)? ?s\b"), "<s>"),  # seconds, anywhere
    (re.compile(r"slowest [^;]*;"), "slowest <call>;"),
    (re.compile(r"/tmp/[^\s'\"]+"), "<tmp>"),
    (re.compile(r"0x[0-9a-f]+"), "<addr>"),
)
_PROGRESS = re.compile(r"^\s*\.\.\. ")  # progress lines: when they print varies
_TIMING_KEYS = frozenset({"time_split", "wall_time_s", "slowest_call", "wall_s", "seconds"})


def masked_lines(text: str) -> list[str]:
    """``text``'s lines with what varies between runs of one seed masked, progress dropped.

    >>> masked_lines("done in 3.2 s\\n  ... job 1/2: 8 examples\\nslowest 9.1 s: x; ok")
    ['done in <s>', 'slowest <call>; ok']
    """
    out = []
    for line in text.splitlines():
        if _PROGRESS.match(line):
            continue
        for pattern, mask in _VARIES:
            line = pattern.sub(mask, line)
        out.append(line)
    return out


def without_timings(value: Any) -> Any:
    """A JSON value with every timing key left out, recursively."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in _TIMING_KEYS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    if isinstance(value, str):
        return "\n".join(masked_lines(value))
    return value


def differences(before: Path, after: Path) -> list[str]:
    """The lines of a unified diff of the two files, masked; empty when they are the same."""
    texts = []
    for path in (before, after):
        raw = path.read_text()
        if path.suffix == ".json":
            raw = json.dumps(without_timings(json.loads(raw)), indent=1, sort_keys=True)
        texts.append(masked_lines(raw))
    old, new = texts
    return list(difflib.unified_diff(old, new, str(before), str(after), lineterm=""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    diff = differences(args.before, args.after)
    print("\n".join(diff) if diff else "same")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
