"""A launch's arguments as the bounds checker reads them: each tensor's span, and the block tables.

A tensor argument's :class:`Extent` is the memory it may be read through; a
:class:`Table` is an argument recognised as one KV cache group's block table, whose
entries past each row's used length are padding (:data:`spec.batch.PADDING_RULE`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from spec.batch import BatchMetadata
from spec.block_manager import cdiv

if TYPE_CHECKING:
    import torch

Ints = NDArray[np.int64]
Bools = NDArray[np.bool_]

Rows = list[tuple[int, ...]]
"""One KV cache group's used block-table entries, a tuple per batch row."""


def used_rows(batch: BatchMetadata) -> list[Rows]:
    """Each KV cache group's rows of used block-table entries: the first ``ceil(seq_len / B)``.

    A windowed group's used entries start with its released ones (``-1``): the
    table is recognised as the suite passed it, and only entries past
    ``ceil(seq_len / B)`` are padding.

    >>> from spec.batch import BatchMetadata
    >>> b = BatchMetadata(4, (0, 1), (0, 5, 6), (5, 2), ((3, 1), (2, -1)), (), ())
    >>> used_rows(b)
    [[(3, 1), (2,)]]
    """
    return [
        [
            tuple(table[: cdiv(n, batch.block_size)])
            for table, n in zip(batch.tables(g), batch.seq_lens, strict=True)
        ]
        for g in range(batch.num_groups)
    ]


@dataclass(frozen=True)
class Extent:
    """A tensor argument: its element span ``[lo, hi)`` and its storage, in bytes."""

    name: str
    tensor: str
    base: int
    itemsize: int
    lo: int
    hi: int
    storage_lo: int
    storage_hi: int

    @staticmethod
    def of(name: str, t: torch.Tensor) -> Extent:
        size, base = t.element_size(), t.data_ptr()
        reach = [s * (n - 1) for s, n in zip(t.stride(), t.shape, strict=True)]
        lo = hi = base  # an empty tensor spans nothing (and torch gives it data_ptr() 0)
        if t.numel():
            lo += size * sum(r for r in reach if r < 0)
            hi += size * (1 + sum(r for r in reach if r > 0))
        storage = t.untyped_storage()
        desc = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
        start = storage.data_ptr()
        return Extent(name, desc, base, size, lo, hi, start, start + storage.nbytes())

    def distance(self, addr: Ints, size: int) -> Ints:
        """How far each access is outside the span, in this tensor's elements (signed)."""
        before = -((self.lo - addr + self.itemsize - 1) // self.itemsize)
        past = (addr + size - self.hi + self.itemsize - 1) // self.itemsize
        out: Ints = np.where(addr < self.lo, before, np.maximum(past, 1))
        return out


@dataclass(frozen=True)
class Table:
    """A recognised block table: where each entry lives, and each row's used length."""

    extent: Extent
    shape: tuple[int, int]
    strides: tuple[int, int]
    used: Ints  # per tensor row; 0 for rows past the batch

    def padding(self, addr: Ints) -> tuple[Bools, Ints, Ints]:
        """Which accesses read padding (or a gap of the view), and their ``(row, entry)``."""
        e = self.extent
        inside = (addr >= e.lo) & (addr < e.hi)
        off = (addr - e.base) // e.itemsize
        (rows, width), (s0, s1) = self.shape, self.strides
        if s0 >= s1 * width:
            row = off // s0
            col = (off - row * s0) // s1
        else:
            col = off // s1
            row = (off - col * s1) // s0
        row = np.clip(row, 0, rows - 1)
        bad = inside & ((col >= self.used[row]) | (col < 0))
        return bad, row, col


def tensors_of(name: str, value: object) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one launch argument: itself, a wrapper's base, a tuple's members."""
    import torch

    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, tuple | list):
        for i, item in enumerate(value):
            yield from tensors_of(f"{name}[{i}]", item)
    elif isinstance(getattr(value, "base", None), torch.Tensor):  # TensorWrapper, descriptor
        yield name, value.base  # type: ignore[attr-defined]


def find_tables(named: Sequence[tuple[str, torch.Tensor]], groups: Sequence[Rows]) -> list[Table]:
    """The arguments whose rows start with one group's used entries, each table once
    (how strict mode finds them: :mod:`conformance.bounds.checker`)."""
    found: list[Table] = []
    for rows in groups:
        names = {t.extent.name for t in found}
        found += [t for t in _tables_of(named, rows) if t.extent.name not in names]
    return found


def _tables_of(named: Sequence[tuple[str, torch.Tensor]], rows: Rows) -> list[Table]:
    """The arguments whose rows start with ``rows``, one group's used entries."""
    import torch

    need = max((len(r) for r in rows), default=0)
    found = []
    for name, t in named:
        ints = not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)
        if not (ints and t.ndim == 2 and t.shape[0] >= len(rows) and t.shape[1] >= need):
            continue
        s0, s1 = t.stride()
        rows_first = s0 >= s1 * t.shape[1]
        if not need or 0 in (s0, s1) or not (rows_first or s1 >= s0 * t.shape[0]):
            continue
        if all(tuple(t[i, : len(r)].tolist()) == r for i, r in enumerate(rows)):
            used = np.zeros(t.shape[0], dtype=np.int64)
            used[: len(rows)] = [len(r) for r in rows]
            found.append(Table(Extent.of(name, t), (t.shape[0], t.shape[1]), (s0, s1), used))
    return found
