"""Bounds checking for Triton kernels under the interpreter: every element a kernel touches.

The suite compares outputs and caches, so a load whose value is never used is
invisible to it: a kernel that reads block-table entries past a row, or past the
end of the table tensor, and only feeds them to masked K/V loads, passes. On a
GPU such a read may fault, read another process's data, or (at the end of an
allocation) crash, depending on the allocator. A :class:`BoundsChecker` sees it.

While :meth:`BoundsChecker.watch` is active (around one backend call), every
launch of a Triton kernel under ``TRITON_INTERPRET=1`` is checked element by
element (the hooks: :mod:`conformance.bounds._hooks`):

* **The allowed memory** of a launch is the union of the byte spans of the
  tensors passed to it (pointer arguments, also inside tuples, ``triton.reinterpret``
  wrappers and tensor descriptors). A tensor's span runs from its lowest
  element's first byte to its highest element's last byte, computed from
  ``data_ptr()``, sizes and strides: a view's own elements, not the whole
  storage it lives in (``big[:2]`` does not allow ``big[2]``). Gaps inside a
  strided view (the columns ``x[:, :4]`` skips) count as inside: exact element
  membership is ambiguous for overlapping or expanded strides, and the span
  never flags a correct kernel. Reading inside *another* argument's span is
  allowed too: addresses carry no record of the pointer they came from.
* **Masked-off lanes are not accesses.** A lane whose mask is false is never
  read or written (on a GPU too), so it is never checked and never flagged,
  whatever address it holds. Every unmasked lane of every ``tl.load``,
  ``tl.store`` and atomic is.
* **Default mode** flags any unmasked access outside the allowed memory, as a
  load, a store or an atomic.
* **Strict mode** also flags reads of block-table padding: entries of row ``i``
  at or past ``ceil(seq_len[i] / B)``. The checker finds the table among the
  launch's arguments by content: an integer 2-D tensor (any width, any row
  stride, any integer dtype) with at least the batch's rows, whose row ``i``
  starts with the batch's ``ceil(seq_len[i] / B)`` used entries (rows past the
  batch's count as having none), in any KV cache group's tables (a windowed
  group's used entries begin with its released ``-1`` ones). A table the
  kernel receives flattened to 1-D, offset, or rebuilt in another order is not
  recognised; strict mode then checks extents only and
  :meth:`BoundsChecker.notes` says no table was found.

A refused lane is not performed (a load reads ``other`` or zero, a store does
nothing), so a kernel that writes past its cache cannot corrupt the checking
process; the outputs of a call with violations are meaningless, and the
violation is the failure. Hooks exist only inside ``watch``: an unchecked run
executes the interpreter's own code, and ``watch`` restores it exactly on exit.
The hooks are process-wide, as the interpreter is: one ``watch`` at a time
(nesting raises), and no interpreted launches in other threads meanwhile.

In the suite (``python -m conformance run --check-bounds [default|strict]``),
:class:`~conformance.lockstep.driver.Lockstep` watches every backend call that may
launch kernels (the cache's creation, writes, copies and reads, and
attention), and a call with a violation is a conformance failure of kind ``"bounds"``; what a run
checked is its :class:`BoundsReport`. :func:`unusable` says why a process
cannot be checked at all (the run then refuses to start).

>>> v = Violation("attention", 0, "kernel", 1, "load", "outside", "block_tables",
...               "int32 [2, 3]", True, 6, 1, 1, 4, (1, 0, 0))
>>> print(v.describe())
attention (layer 0), kernel kernel, launch 1: 4 loads outside every tensor of the launch, \
nearest block_tables (int32 [2, 3], inside its storage); first by program (1, 0, 0): \
element 6, 1 past the end (worst 1)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from conformance.bounds import _hooks as _bounds_hooks
from conformance.bounds.arguments import (
    Bools,
    Extent,
    Ints,
    Rows,
    find_tables,
    tensors_of,
    used_rows,
)
from spec.batch import PADDING_RULE, BatchMetadata

if TYPE_CHECKING:
    pass

CONTRACT = PADDING_RULE
"""What a kernel may read: :data:`spec.batch.PADDING_RULE`, the sentence this checker enforces."""

MODES = ("default", "strict")
"""The checker's modes, as ``--check-bounds`` and ``PAGED_SPEC_CHECK_BOUNDS`` name them."""

GPU_NOTE = (
    "bounds checking needs Triton's interpreter (TRITON_INTERPRET=1 set before triton is "
    "imported); on a GPU run the suite under compute-sanitizer: "
    "compute-sanitizer --tool memcheck python -m conformance run --backend ..."
)
_NO_LAUNCH = "no Triton kernel ran under the interpreter: nothing was checked"


@dataclass(frozen=True)
class Violation:
    """The unmasked accesses of one launch, of one kind, attributed to one argument.

    ``kind`` is ``"outside"`` (no tensor of the launch spans the address;
    ``argument`` is the one whose storage holds it, else the nearest) or
    ``"padding"`` (strict mode: a block-table entry at or past the row's
    ``ceil(seq_len / B)``). ``offset`` is the first such access's element
    offset from ``argument``'s ``data_ptr()``; ``distance`` how far out it is,
    in the argument's elements (negative: before its first element; positive:
    past its last, 1 being the element just after; for padding, entries past
    the row's used length, 1 being the first padding entry); ``worst`` the
    largest distance of the launch; ``count`` how many element accesses.
    """

    call: str
    layer: int | None
    kernel: str
    launch: int  # 1-based, within the watched call
    access: str  # "load", "store" or "atomic"
    kind: str  # "outside" or "padding"
    argument: str
    tensor: str  # the argument's dtype and shape, e.g. "int32 [2, 3]"
    inside_storage: bool
    offset: int
    distance: int
    worst: int
    count: int
    program: tuple[int, ...]
    row: int | None = None  # padding only: the table row, the entry, and the row's used length
    entry: int | None = None
    used: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line a report can print: where, what, how far out, how often."""
        where = self.call if self.layer is None else f"{self.call} (layer {self.layer})"
        what = f"{self.count} {self.access}{'' if self.count == 1 else 's'}"
        head = f"{where}, kernel {self.kernel}, launch {self.launch}: {what}"
        first = f"first by program {self.program}"
        if self.kind == "padding":
            return (
                f"{head} of block-table padding in {self.argument} ({self.tensor}); {first}: "
                f"row {self.row}, entry {self.entry}, the row uses {self.used} "
                f"(ceil(seq_len / B)); {self.distance} past (worst {self.worst})"
            )
        storage = "inside its storage" if self.inside_storage else "outside its storage"
        side = "before the start" if self.distance < 0 else "past the end"
        return (
            f"{head} outside every tensor of the launch, nearest {self.argument} ({self.tensor}, "
            f"{storage}); {first}: element {self.offset}, {abs(self.distance)} {side} "
            f"(worst {abs(self.worst)})"
        )


@dataclass
class Watched:
    """One watched backend call: what was checked and what was found."""

    call: str
    layer: int | None
    launches: int = 0
    accesses: int = 0  # unmasked element accesses checked
    tables: list[str] = field(default_factory=list)  # "kernel:argument" found as block tables
    violations: list[Violation] = field(default_factory=list)


class BoundsChecker:
    """Checks every unmasked element access of interpreted Triton launches; see the module doc.

    ``strict`` also flags reads of block-table padding (needs ``batch`` in
    :meth:`watch`). ``violations`` accumulates over every watched call.
    """

    def __init__(self, strict: bool = False) -> None:
        if not isinstance(strict, bool):
            raise TypeError(f"BoundsChecker(strict=...) takes a bool, got {strict!r}")
        self.strict = strict
        self.violations: list[Violation] = []
        self.launches = 0
        self.accesses = 0
        self._table_calls = 0  # watched calls given a batch in strict mode
        self._tables_found = 0  # ... in which some launch had a recognised block table
        self._unavailable = _bounds_hooks.interpreter_available()

    @classmethod
    def for_mode(cls, mode: str) -> BoundsChecker:
        """The checker of a mode of :data:`MODES` (``ValueError`` names any other)."""
        if mode not in MODES:
            raise ValueError(f"bounds-check mode {mode!r}: choose from {', '.join(MODES)}")
        return cls(strict=mode == "strict")

    @property
    def mode(self) -> str:
        return "strict" if self.strict else "default"

    def __repr__(self) -> str:
        """The expression that builds an equal, fresh checker (replay scripts print it)."""
        return f"BoundsChecker(strict={self.strict})"

    @contextmanager
    def watch(
        self, call: str, layer: int | None = None, batch: BatchMetadata | None = None
    ) -> Iterator[Watched]:
        """Check the Triton launches inside the block; yields this call's :class:`Watched`.

        Without a usable interpreter it checks nothing (see :meth:`notes`).
        """
        seen = Watched(call, layer)
        rows = used_rows(batch) if self.strict and batch is not None else None  # per group
        if self._unavailable is not None:
            yield seen
            return
        recorder = _Recorder(seen, rows)
        try:
            with _bounds_hooks.installed(recorder):
                yield seen
        finally:
            self.violations += seen.violations
            self.launches += seen.launches
            self.accesses += seen.accesses
            if rows is not None and seen.launches:
                self._table_calls += 1
                self._tables_found += bool(seen.tables)

    def notes(self) -> list[str]:
        """What a report should say about coverage: nothing checked, or no table found."""
        notes = []
        if self._unavailable is not None:
            notes.append(f"nothing was bounds-checked: {self._unavailable}; {GPU_NOTE}")
        elif self.launches == 0:
            notes.append(f"{_NO_LAUNCH}; {GPU_NOTE}")
        if self.strict and self._table_calls and not self._tables_found:
            notes.append(
                "strict mode found no block-table argument in any launch (an integer 2-D "
                "tensor whose rows start with the batch's used entries), so only extents "
                "were checked"
            )
        return notes

    def summary(self) -> str:
        """A line for the report: mode, how much was checked, how many violations."""
        return _summary(self.mode, self.launches, self.accesses, len(self.violations))

    def report(self) -> BoundsReport:
        """What this checker checked so far, as plain data (it travels between processes)."""
        return BoundsReport(
            self.mode,
            self.launches,
            self.accesses,
            len(self.violations),
            self.summary(),
            tuple(self.notes()),
        )


@dataclass(frozen=True)
class BoundsReport:
    """A run's bounds check: its mode, the launches and element accesses checked, violations.

    ``summary`` is :meth:`BoundsChecker.summary` and ``notes`` its
    :meth:`BoundsChecker.notes` (coverage caveats: nothing checked, no table found).
    """

    mode: str
    launches: int
    accesses: int
    violations: int
    summary: str
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """The summary, then each note: what a report prints under the run's settings."""
        return [self.summary, *(f"note: {n}" for n in self.notes)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def add(self, other: BoundsReport) -> BoundsReport:
        """This check and ``other``'s (a shard of the same run) as one report.

        >>> a = BoundsReport("strict", 0, 0, 0, "", (_NO_LAUNCH,))
        >>> a.add(BoundsReport("strict", 2, 40, 1, "", ())).lines()
        ['bounds check (strict): 2 launches, 40 element accesses, 1 violations']
        """
        assert self.mode == other.mode, "shards of different runs"
        launches = self.launches + other.launches
        accesses, violations = self.accesses + other.accesses, self.violations + other.violations
        notes = dict.fromkeys(
            n for n in (*self.notes, *other.notes) if not (launches and n.startswith(_NO_LAUNCH))
        )
        summary = _summary(self.mode, launches, accesses, violations)
        return BoundsReport(self.mode, launches, accesses, violations, summary, tuple(notes))


def _summary(mode: str, launches: int, accesses: int, violations: int) -> str:
    return (
        f"bounds check ({mode}): {launches} launches, {accesses} element accesses, "
        f"{violations} violations"
    )


def unusable() -> str | None:
    """Why launches in this process cannot be checked (``None``: they can).

    The checker sees only kernels that Triton's interpreter runs: the seam
    must exist in the installed triton, and ``TRITON_INTERPRET`` must be set
    (a kernel decorated without it compiles for a GPU, and no hook sees it).
    """
    reason = _bounds_hooks.interpreter_available()
    if reason is not None:
        return reason
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        return "TRITON_INTERPRET is not set, so Triton kernels compile and run natively"
    return None


@dataclass
class _Tally:
    """The accesses of one launch of one (kind, access, argument): a count and the first."""

    first: Violation
    count: int = 0
    worst: int = 0


class _Launch:
    """One launch's allowed memory, recognised tables, and what it did outside them."""

    def __init__(
        self, kernel: str, index: int, args: dict[str, object], rows: list[Rows] | None
    ) -> None:
        self.kernel, self.index = kernel, index
        named = [t for name, value in args.items() for t in tensors_of(name, value)]
        self.extents = [Extent.of(name, t) for name, t in named]
        spans = sorted((e.lo, e.hi) for e in self.extents if e.hi > e.lo)
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = np.array([m[0] for m in merged], dtype=np.int64)
        self.ends = np.array([m[1] for m in merged], dtype=np.int64)
        self.tables = find_tables(named, rows) if rows else []
        self.tallies: dict[tuple[str, str, str], _Tally] = {}

    def inside(self, addr: Ints, size: int) -> Bools:
        """Whether each ``size``-byte access lies within one merged span."""
        idx = np.searchsorted(self.starts, addr, side="right") - 1
        ends = self.ends[np.clip(idx, 0, None)] if self.ends.size else np.zeros_like(addr)
        ok: Bools = (idx >= 0) & (addr + size <= ends)
        return ok

    def record_outside(self, op: str, addr: Ints, size: int, program: tuple[int, ...]) -> None:
        """Attribute each access to the argument whose storage holds it, else the nearest."""
        if not self.extents:
            e = Extent("(no tensor arguments)", "-", 0, 1, 0, 0, 0, 0)
            self._tally("outside", op, e, addr, e.distance(addr, size), program, False)
            return
        far = np.int64(1) << np.int64(62)
        scores = []
        for e in self.extents:
            gap = np.maximum(np.maximum(e.lo - addr, addr + size - e.hi), 0)
            held = (addr >= e.storage_lo) & (addr < e.storage_hi)
            scores.append(np.where(held, gap, gap + far))
        nearest = np.argmin(np.stack(scores), axis=0)
        for i in np.unique(nearest):
            e, mine = self.extents[int(i)], addr[nearest == i]
            inside = bool(e.storage_lo <= mine[0] < e.storage_hi)
            self._tally("outside", op, e, mine, e.distance(mine, size), program, inside)

    def record_padding(self, op: str, addr: Ints, program: tuple[int, ...]) -> None:
        if not addr.size:
            return
        low, high = addr.min(), addr.max()
        for table in self.tables:
            if high < table.extent.lo or low >= table.extent.hi:
                continue  # the usual case (a K or V tile): nowhere near the table
            bad, row, col = table.padding(addr)
            if bad.any():
                r, c = row[bad], col[bad]
                dist = c - table.used[r] + 1
                extra = {"row": int(r[0]), "entry": int(c[0]), "used": int(table.used[r[0]])}
                self._tally("padding", op, table.extent, addr[bad], dist, program, True, extra)

    def _tally(
        self,
        kind: str,
        op: str,
        e: Extent,
        addr: Ints,
        dist: Ints,
        program: tuple[int, ...],
        held: bool,
        extra: dict[str, int] | None = None,
    ) -> None:
        key = (kind, op, e.name)
        if key not in self.tallies:
            first = Violation(
                call="",
                layer=None,
                kernel=self.kernel,
                launch=self.index,
                access=op,
                kind=kind,
                argument=e.name,
                tensor=e.tensor,
                inside_storage=held,
                offset=int((addr[0] - e.base) // e.itemsize),
                distance=int(dist[0]),
                worst=0,
                count=0,
                program=tuple(int(p) for p in program),
                **(extra or {}),
            )
            self.tallies[key] = _Tally(first)
        tally = self.tallies[key]
        tally.count += int(addr.size)
        worst = int(dist[np.argmax(np.abs(dist))])
        if abs(worst) > abs(tally.worst):
            tally.worst = worst

    def violations(self, call: str, layer: int | None) -> list[Violation]:
        return [
            replace(t.first, call=call, layer=layer, worst=t.worst, count=t.count)
            for t in self.tallies.values()
        ]


class _Recorder:
    """The hooks' listener for one watched call: checks accesses against the current launch."""

    def __init__(self, seen: Watched, rows: list[Rows] | None) -> None:
        self.seen = seen
        self.rows = rows
        self.current: _Launch | None = None

    def launch(self, kernel: str, args: dict[str, object]) -> None:
        self.seen.launches += 1
        self.current = _Launch(kernel, self.seen.launches, args, self.rows)
        self.seen.tables += [f"{kernel}:{t.extent.name}" for t in self.current.tables]

    def launch_done(self) -> None:
        if self.current is not None:
            self.seen.violations += self.current.violations(self.seen.call, self.seen.layer)
        self.current = None

    def access(
        self,
        op: str,
        ptrs: NDArray[np.uint64],
        mask: NDArray[np.bool_],
        size: int,
        program: tuple[int, ...],
    ) -> NDArray[np.bool_] | None:
        launch = self.current
        if launch is None:
            return None
        lanes = np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs))
        addr = np.asarray(ptrs)[lanes].astype(np.int64)
        self.seen.accesses += int(addr.size)
        ok = launch.inside(addr, size)
        allowed = None
        if not ok.all():
            launch.record_outside(op, addr[~ok], size, program)
            allowed = np.array(lanes, dtype=bool)
            allowed[lanes] = ok
            allowed = allowed.astype(np.asarray(mask).dtype, copy=False)
        if launch.tables:
            launch.record_padding(op, addr[ok], program)
        return allowed
