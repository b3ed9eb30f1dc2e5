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
    cause: str | None = None  # what the pass was drawn again without (conformance.run.causes)

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
        }


def distinct(failures: list[PassFailure]) -> list[PassFailure]:
    """The failures without repeats: the same kind and first difference line in two passes once.

    >>> d = Difference("attention", 1, "off")
    >>> a = PassFailure("short", d, (), False, "", False, 3)
    >>> [f.pass_name for f in distinct([a, PassFailure("long", d, (), False, "", False, 9)])]
    ['short']
    """
    seen: set[tuple[str, str]] = set()
    out = []
    for f in failures:
        key = (f.kind, f.difference.describe().splitlines()[0])
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
