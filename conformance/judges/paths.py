"""Which kernel paths each feature met: observed from the backend's launches, never assumed.

The suite draws decodes long enough to be split and prefill chunks beside
decodes (its plan: :mod:`conformance.lockstep.pairs`); what path a call then
ran is the backend's to decide. :class:`PathCoverage` counts each attention
call under the path it was *observed* to run, from the call's kernel
launches (:mod:`conformance.observe.paths`) or the backend's own
``attention_path()`` when that names one of the suite's paths, and only
where neither says does it count the call under the suite's plan, saying so.
Beside each feature it keeps what the suite drew it as, so a report can say
"drawn as split-KV decode 18 times, run single-pass every time".

>>> cov = PathCoverage()
>>> cov.plan([("sinks", "split-KV decode"), ("sinks", "prefill")], {}, 1024, "")
>>> cov.note_call({"sinks"}, "split-KV decode", "single-pass decode", "launches", 1)
>>> cov.note_call({"sinks"}, "prefill", "prefill", "launches", 1)
>>> print("\\n".join(cov.describe_pairs()))
feature x path pairs reached: 1 of 2
  sinks: prefill 1
  drawn as split-KV decode, run as single-pass decode: sinks 1
  not reached: sinks x split-KV decode (drawn so 1 time; the kernel ran it as single-pass decode)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from conformance.observe.launches import Launch
from conformance.observe.paths import reader_for

Pair = tuple[str, str]
SOURCES = ("launches", "attention_path", "plan")
"""How a call's path is known: read from its kernel launches, named by the backend's
``attention_path()``, or (neither saying) the suite's plan."""
_SOURCE_WORDS = {
    "launches": "read from its kernel launches",
    "attention_path": "named by its attention_path()",
    "plan": "the suite's plan, not observed",
}


def _span(old: tuple[int, int] | None, value: int) -> tuple[int, int]:
    return (value, value) if old is None else (min(old[0], value), max(old[1], value))


def _merge_spans(mine: dict[Any, tuple[int, int]], theirs: dict[Any, tuple[int, int]]) -> None:
    for key, (lo, hi) in theirs.items():
        mine[key] = _span(_span(mine.get(key), lo), hi)


def _words(span: tuple[int, int], unit: str) -> str:
    """``2 to 9 parts``, ``3 parts``, ``1 head tile``."""
    lo, hi = span
    if lo == hi:
        return f"{lo} {unit.removesuffix('s') if lo == 1 else unit}"
    return f"{lo} to {hi} {unit}"


@dataclass
class PathCoverage:
    """Attention calls by feature and path (observed where possible), by what they were drawn
    as, and the kernel launches that showed it."""

    planned: tuple[Pair, ...] = ()  # the pairs that matter (set by the run)
    unreachable: dict[Pair, str] = field(default_factory=dict)  # pair -> why
    split_keys: int = 256  # the plan: a lone decode of this much visible context is split
    split_plan: str = ""  # the backend's declared plan in words ("": the suite's own guess)
    pairs: Counter[Pair] = field(default_factory=Counter)  # calls by (feature, path run)
    drawn: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (feature, drawn, run)
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)  # feature: split parts span
    reported: Counter[Pair] = field(default_factory=Counter)  # (feature, backend's path name)
    known_by: Counter[str] = field(default_factory=Counter)  # calls by SOURCES
    calls: Counter[str] = field(default_factory=Counter)  # calls by the path they ran
    split_calls: Counter[str] = field(default_factory=Counter)  # of those, split in parts
    launches: Counter[str] = field(default_factory=Counter)  # kernel: launches in attention
    splits: Counter[str] = field(default_factory=Counter)  # kernel: launches that split keys
    single: Counter[str] = field(default_factory=Counter)  # kernel: launches read as one pass
    kernel_parts: dict[str, tuple[int, int]] = field(default_factory=dict)  # kernel: parts span
    head_tiles: dict[str, tuple[int, int]] = field(default_factory=dict)  # kernel: tiles span
    unread: Counter[str] = field(default_factory=Counter)  # kernel: launches no reader knows

    def plan(self, planned: list[Pair], unreachable: dict[Pair, str], split: int, how: str) -> None:
        """The pairs the run must reach, why capabilities rule some out, and the split plan."""
        self.planned, self.unreachable = tuple(planned), dict(unreachable)
        self.split_keys, self.split_plan = split, how

    def note_call(
        self,
        features: Iterable[str],
        drawn: str,
        ran: str,
        source: str,
        parts: int | None,
        reported: str | None = None,
    ) -> None:
        """One attention call: drawn as path ``drawn``, run as ``ran`` (known by ``source``,
        one of :data:`SOURCES`), its keys split into ``parts``, named ``reported`` by the
        backend."""
        assert source in SOURCES, source
        self.known_by[source] += 1
        self.calls[ran] += 1
        if parts is not None and parts > 1:
            self.split_calls[ran] += 1  # a decode's, or a short chunk's after long context
        for f in features:
            self.pairs[(f, ran)] += 1
            self.drawn[(f, drawn, ran)] += 1
            if parts is not None and parts > 1:
                self.parts[f] = _span(self.parts.get(f), parts)
            if reported:
                self.reported[(f, reported)] += 1

    def note_launches(self, launches: Sequence[Launch]) -> None:
        """One attention call's launches, kernel by kernel."""
        for launch in launches:
            self.launches[launch.kernel] += 1
            reader = reader_for(launch.kernel)
            if reader is None:
                self.unread[launch.kernel] += 1
                continue
            got = reader(launch)
            if got.parts == 1:
                self.single[launch.kernel] += 1
            if got.parts is not None and got.parts > 1:
                self.splits[launch.kernel] += 1
                self.kernel_parts[launch.kernel] = _span(
                    self.kernel_parts.get(launch.kernel), got.parts
                )
            if got.head_tiles is not None:
                self.head_tiles[launch.kernel] = _span(
                    self.head_tiles.get(launch.kernel), got.head_tiles
                )

    def add(self, other: PathCoverage) -> None:
        """What ``other`` counted too (a shard of the same run)."""
        self.pairs.update(other.pairs)
        self.drawn.update(other.drawn)
        self.reported.update(other.reported)
        for name in ("known_by", "calls", "split_calls", "launches", "splits", "single", "unread"):
            getattr(self, name).update(getattr(other, name))
        for spans, more in (
            (self.parts, other.parts),
            (self.kernel_parts, other.kernel_parts),
            (self.head_tiles, other.head_tiles),
        ):
            _merge_spans(spans, more)
        if not self.planned:
            self.plan(list(other.planned), other.unreachable, other.split_keys, other.split_plan)

    def reached(self, pair: Pair) -> bool:
        return self.pairs[pair] > 0

    # -- the report --------------------------------------------------------------------------

    def describe(self) -> list[str]:
        """How the paths were known, the launches that showed them, and the pairs."""
        if not self.planned:
            return []
        return [*self.describe_source(), *self.describe_pairs()]

    def describe_source(self) -> list[str]:
        """How the calls' paths are known, the kernels launched, and the plan drawn against.

        >>> cov = PathCoverage(split_keys=256)
        >>> cov.known_by["plan"] += 3
        >>> for line in cov.describe_source():
        ...     print(line.replace(" (", "\\n   (", 1))
        kernel paths of 3 attention calls: the suite's plan, not observed
           (no kernel launch the suite can read, no attention_path())
          drawn as split-KV decodes from 256 visible keys
           (the suite's guess: capabilities.decode_split is not declared)
        """
        calls = sum(self.known_by.values())
        by = [f"{self.known_by[s]:,} {_SOURCE_WORDS[s]}" for s in SOURCES if self.known_by[s]]
        ran = ", ".join(
            f"{p} {n:,}" + (f" ({self.split_calls[p]:,} split)" if self.split_calls[p] and p
                            != "split-KV decode" else "")
            for p, n in self.calls.most_common()
        )  # fmt: skip
        if self.known_by["plan"] == calls and calls:
            why = "no kernel launch the suite can read, no attention_path()"
            if self.unread:
                why = f"launched {', '.join(sorted(self.unread))}, which no reader knows"
            lines = [f"kernel paths of {calls:,} attention calls: {_SOURCE_WORDS['plan']} ({why})"]
        else:
            lines = [f"kernel paths of {calls:,} attention calls: {'; '.join(by)}"]
            lines.append(f"  calls by the path they ran: {ran}")
        if self.launches:
            lines.append(f"  launches: {self._describe_launches()}")
        if self.split_plan:
            lines.append(f"  the backend's plan (capabilities.decode_split): {self.split_plan}")
            plan = "its plan"
        else:
            plan = "the suite's guess: capabilities.decode_split is not declared"
        lines.append(f"  drawn as split-KV decodes from {self.split_keys:,} visible keys ({plan})")
        return lines

    def _describe_launches(self) -> str:
        """``_attention_kernel 1,235 (split 57, 2 to 9 parts), _merge_kernel 57, ...``."""
        out = []
        for kernel, n in self.launches.most_common():
            notes = []
            if self.splits[kernel]:
                notes.append(
                    f"split {self.splits[kernel]:,}, {_words(self.kernel_parts[kernel], 'parts')}"
                )
            elif self.single[kernel]:
                notes.append("never split")
            if kernel in self.head_tiles:
                notes.append(_words(self.head_tiles[kernel], "head tiles"))
            if self.unread[kernel]:
                notes.append("unread")
            out.append(f"{kernel} {n:,}" + (f" ({'; '.join(notes)})" if notes else ""))
        return ", ".join(out)

    def describe_pairs(self) -> list[str]:
        """Pair coverage: how many of the pairs that matter were reached, each one's calls (and
        the parts a feature's split-KV decodes ran), the calls drawn as one path and run as
        another, and every pair not reached with why."""
        if not self.planned:
            return []
        reached = [p for p in self.planned if self.reached(p)]
        lines = [f"feature x path pairs reached: {len(reached)} of {len(self.planned)}"]
        for feature in dict.fromkeys(f for f, _ in self.planned):
            got = []
            for f, p in reached:
                if f != feature:
                    continue
                split = p == "split-KV decode" and f in self.parts
                extra = f" ({_words(self.parts[f], 'parts')})" if split else ""
                got.append(f"{p} {self.pairs[(f, p)]}{extra}")
            named = sorted({n for f, n in self.reported if f == feature})
            backend = f" (backend paths: {', '.join(named)})" if named else ""
            if got:
                lines.append(f"  {feature}: {', '.join(got)}{backend}")
        lines += self._describe_mismatches()
        for pair in self.planned:
            if not self.reached(pair):
                lines.append(f"  not reached: {pair[0]} x {pair[1]} ({self.why_not(pair)})")
        return lines

    def _describe_mismatches(self) -> list[str]:
        """One line per (drawn, run) pair of paths that differ, with the features' calls."""
        wanted = {f for f, _ in self.planned}
        by: dict[Pair, list[str]] = {}
        for (feature, drawn, ran), n in self.drawn.items():
            if drawn != ran and feature in wanted:
                by.setdefault((drawn, ran), []).append(f"{feature} {n}")
        return [f"  drawn as {d}, run as {r}: {', '.join(fs)}" for (d, r), fs in sorted(by.items())]

    def why_not(self, pair: Pair) -> str:
        """Why a planned pair was not reached: the capabilities, or the paths the kernel ran."""
        if pair in self.unreachable:
            return self.unreachable[pair]
        feature, path = pair
        ran = Counter({r: n for (f, d, r), n in self.drawn.items() if f == feature and d == path})
        if not ran:
            return "no call of this run combined them"
        drawn = sum(ran.values())
        runs = ", ".join(r for r, _ in ran.most_common())
        plan = f": {self.split_plan}" if self.split_plan and path == "split-KV decode" else ""
        times = "time" if drawn == 1 else "times"
        return f"drawn so {drawn} {times}; the kernel ran it as {runs}{plan}"

    def to_json(self) -> dict[str, Any]:
        return {
            "planned": len(self.planned),
            "reached": [[*p, self.pairs[p]] for p in self.planned if self.reached(p)],
            "not_reached": [[*p, self.why_not(p)] for p in self.planned if not self.reached(p)],
            "backend_paths": [[f, n, c] for (f, n), c in sorted(self.reported.items())],
            "known_by": {s: self.known_by[s] for s in SOURCES},
            "calls_by_path": dict(self.calls.most_common()),
            "split_calls_by_path": dict(self.split_calls.most_common()),
            "drawn_as": [[f, d, r, n] for (f, d, r), n in sorted(self.drawn.items()) if d != r],
            "split_parts": {f: list(s) for f, s in sorted(self.parts.items())},
            "split_plan": {"from_keys": self.split_keys, "declared": self.split_plan or None},
            "launches": {
                k: {
                    "launches": n,
                    "split": self.splits[k],
                    "parts": list(self.kernel_parts.get(k, ())),
                    "head_tiles": list(self.head_tiles.get(k, ())),
                    "read": k not in self.unread,
                }
                for k, n in sorted(self.launches.items())
            },
        }
