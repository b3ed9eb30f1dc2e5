"""One failing pass of a run: which pass, the difference, and the workload that shows it.

A run judges every pass (:attr:`~conformance.run.control.RunControl.every_pass`):
a failure in one pass does not stop the others, because one bug can hide
another (a kernel's rounding weakness in a short example hid its int32
overflow in the large-pool pass); and a failing pass is drawn again without
the failure's cause (:mod:`conformance.run.causes`), so a second bug in the
same pass shows too. Each failure leaves one :class:`PassFailure`, with its
cause; the first is also the run's headline difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conformance.judges.compare import Difference

FATAL = ("hang", "crash", "internal")
"""Kinds after which no further pass runs: the backend (or the suite) cannot be trusted to."""


@dataclass(frozen=True)
class PassFailure:
    """A failing pass: its name, difference, workload (replay lines), and how it was found."""

    pass_name: str
    difference: Difference
    workload: tuple[str, ...]
    shrunk: bool
    shrink_note: str
    flaky: bool
    example: int | None  # the example of the run in which it appeared
    nondeterminism: tuple[str, str] | None = None
    cause: str | None = None  # what explains it (conformance.run.causes), as the report says
    isolated: bool = False  # the cause was found (a named mistake, or replays), not missing

    @property
    def kind(self) -> str:
        return self.difference.what

    def headline(self) -> str:
        """``pass long: attention: ...`` (the first line of the difference)."""
        first = self.difference.describe().splitlines()[0]
        return f"pass {self.pass_name}: {self.kind}: {first}"

    def to_json(self) -> dict[str, Any]:
        return {
            "pass": self.pass_name,
            "kind": self.kind,
            "summary": self.difference.describe(),
            "difference": self.difference.to_json(),
            "workload": list(self.workload),
            "shrunk": self.shrunk,
            "shrink_note": self.shrink_note,
            "flaky": self.flaky,
            "example": self.example,
            "nondeterministic": self.nondeterminism is not None,
            "cause": self.cause,
            "cause_isolated": self.isolated,
        }


def by_cause(failures: list[PassFailure]) -> list[list[PassFailure]]:
    """The failures grouped by cause, in the order each cause first appeared: one group per
    isolated cause, however many passes showed it; a failure without an isolated cause
    groups only with its repeats (the same kind and first difference line).

    >>> d, e = Difference("output", 1, "off"), Difference("output", 2, "far off")
    >>> tf32 = dict(cause="float32 products rounded to TF32", isolated=True)
    >>> a = PassFailure("short", d, (), False, "", False, 3, **tf32)
    >>> b = PassFailure("feature (sinks)", e, (), False, "", False, 9, **tf32)
    >>> c = PassFailure("long", e, (), False, "", False, 12)
    >>> [[f.pass_name for f in g] for g in by_cause([a, b, c])]
    [['short', 'feature (sinks)'], ['long']]
    """
    groups: dict[tuple[str, ...], list[PassFailure]] = {}
    for f in failures:
        if f.isolated and f.cause:
            key: tuple[str, ...] = ("cause", f.cause)
        else:
            key = (f.kind, f.difference.describe().splitlines()[0])
        groups.setdefault(key, []).append(f)
    return list(groups.values())


def distinct(failures: list[PassFailure]) -> list[PassFailure]:
    """The first failure of each cause (:func:`by_cause`)."""
    return [group[0] for group in by_cause(failures)]
