"""A large pool: the backend's blocks past 2^31 elements, while the spec's pool stays small.

With ``config.block_base > 0`` spec block ``b`` is backend block
``block_base + b`` in everything the backend is handed (tables, slots, copies,
reads), so KV element offsets pass 2^31 while the spec, the comparison and the
backend's resident memory stay small. One guard block below and one above are
primed and must never change.

>>> pool = LargePool(base=10, num_blocks=4, block_size=2)
>>> pool.slots([0, 3, -1]), pool.copies([(1, 2)]), pool.guards
([20, 23, -1], [(11, 12)], [(9, 0), (14, 1)])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from spec.batch import PAD_BLOCK, BatchMetadata, GroupLayout
from spec.block_manager import PAD_SLOT
from spec.kv_geometry import KVGeometry


@dataclass(frozen=True)
class LargePool:
    """Where the spec's blocks lie in the backend's pool: ``base`` blocks further (0: the same)."""

    base: int
    num_blocks: int  # the spec's pool
    block_size: int

    def geometry(self, g: KVGeometry) -> KVGeometry:
        """The geometry the backend allocates: the spec's, or a large pool around it."""
        return replace(g, num_blocks=self.base + g.num_blocks + 1) if self.base else g

    @property
    def guards(self) -> list[tuple[int, int]]:
        """``(backend block, spec-side index)`` of the guard blocks of a large pool."""
        if not self.base:
            return []
        return [(self.base - 1, 0), (self.base + self.num_blocks, 1)]

    def slots(self, slots: Sequence[int]) -> list[int]:
        shift = self.base * self.block_size
        return [s + shift if s != PAD_SLOT else s for s in slots]

    def copies(self, copies: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(s + self.base, d + self.base) for s, d in copies]

    def tables(self, tables: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(b + self.base if b != PAD_BLOCK else b for b in row) for row in tables)

    def batch(self, batch: BatchMetadata) -> BatchMetadata:
        """``batch`` with its block ids in the backend's pool."""
        if not self.base:
            return batch
        return BatchMetadata(
            block_size=batch.block_size,
            seq_ids=batch.seq_ids,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_tables=self.tables(batch.block_tables),
            slot_mapping=tuple(self.slots(batch.slot_mapping)),
            positions=batch.positions,
            copies=tuple(self.copies(batch.copies)),
            extra_groups=tuple(
                GroupLayout(self.tables(e.block_tables), tuple(self.slots(e.slot_mapping)))
                for e in batch.extra_groups
            ),
        )
