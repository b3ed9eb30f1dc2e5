"""Planted bugs in KV cache groups: each the numpy backend with one group rule broken.

Each is a mistake a backend can make when a model's layers sit in several KV
cache groups (each group its own block tables over one pool, a windowed
group's released entries ``-1``), and each needs the workloads of the suite's
groups pass (:mod:`conformance.lockstep.groups`): layers in two groups, and a window
short enough that blocks are released within a few steps. Each is
registered in :data:`conformance.planted.backends.PLANTED` (through
:data:`PLANTED_GROUPS`), so the self-test runs it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from conformance.lockstep.numpy_backend import Ints, NumpyPagedBackend
from spec.attention import AttentionVariant
from spec.backend import FloatArray
from spec.batch import PAD_BLOCK, BatchMetadata


class _GroupBug(NumpyPagedBackend):
    """A planted group bug: only the groups pass draws KV cache groups, so the self-test runs
    that pass alone (passes are seeded apart: the run's later passes draw the same)."""

    selftest_passes = ("groups",)


class ReadsGroupZeroTables(_GroupBug):
    """Every layer reads group 0's block tables (``batch.block_tables``), whatever its group.

    Exact while a model has one group: only a layer of another group shows it,
    since the groups' tables name different blocks of the one pool.
    """

    def _table_group(self, layer: int) -> int:
        return 0


class DropsReleasedEntries(_GroupBug):
    """The ``-1`` entries a window released are taken for padding and dropped from the row.

    The row then starts at the first held block, so every key is read from a
    position ``released * B`` later than its own. Exact until a window releases
    a block.
    """

    def _table(self, batch: BatchMetadata, i: int, group: int) -> Sequence[int]:
        return [b for b in super()._table(batch, i, group) if b != PAD_BLOCK]

    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        with np.errstate(invalid="ignore"):  # a query whose keys all shifted away: 0 / 0
            return super().attention(layer, query, batch, scale, variant=variant)


class SlotsOncePerStep(_GroupBug):
    """The slot mapping is taken once per step, at its first write, and reused for every layer.

    A per-step cache keyed without the KV cache group: the layers of the other
    group write their K and V into the first group's slots. Exact with one group.
    """

    _step_slots: Ints | None = None

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        self._step_slots = None  # a step starts with its copies
        super().copy_blocks(copies)

    def _write_slots(self, slots: Ints) -> Ints:
        if self._step_slots is None or len(self._step_slots) != len(slots):
            self._step_slots = slots
        return self._step_slots


PLANTED_GROUPS: dict[str, type[NumpyPagedBackend]] = {
    "every layer reads group 0's block tables": ReadsGroupZeroTables,
    "released (-1) table entries dropped as padding (keys shift)": DropsReleasedEntries,
    "slot mapping reused for every layer, whatever its group": SlotsOncePerStep,
}
"""The planted KV cache group bugs, by the bug class each stands for."""
