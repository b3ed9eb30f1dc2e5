"""Block tables as wide as the backend asks: an engine's persistent table, padded.

The suite builds each step's tables exactly ``ceil(max seq_len / B)`` wide.
An engine hands its kernels a persistent table, as wide as its longest
allowed sequence; a backend declares that width
(:attr:`spec.backend.Capabilities.table_width`) and the suite hands every
group's tables padded to it with :data:`spec.batch.PAD_BLOCK`, so a kernel
whose tile loads run past a row's used entries meets the padding it will
meet in an engine. :data:`spec.batch.PADDING_RULE` governs the extra
entries like any padding: a kernel may read them, never use them as block ids.
"""

from __future__ import annotations

from dataclasses import replace

from spec.batch import PAD_BLOCK, BatchMetadata, GroupLayout

Tables = tuple[tuple[int, ...], ...]


def pad_tables(tables: Tables, width: int) -> Tables:
    """Each row padded with ``PAD_BLOCK`` to ``width`` (a wider row is left as it is).

    >>> pad_tables(((3, 1), (2, -1)), 4)
    ((3, 1, -1, -1), (2, -1, -1, -1))
    """
    return tuple(row + (PAD_BLOCK,) * (width - len(row)) for row in tables)


def widen(batch: BatchMetadata, width: int | None) -> BatchMetadata:
    """``batch`` with every group's tables at least ``width`` wide (``None``: unchanged).

    >>> b = BatchMetadata(4, (0,), (0, 5), (5,), ((3, 1),), (0, 1, 2, 3, 4), (0, 1, 2, 3, 4))
    >>> widen(b, 6).block_tables
    ((3, 1, -1, -1, -1, -1),)
    """
    if width is None:
        return batch
    return replace(
        batch,
        block_tables=pad_tables(batch.block_tables, width),
        extra_groups=tuple(
            GroupLayout(pad_tables(e.block_tables, width), e.slot_mapping)
            for e in batch.extra_groups
        ),
    )
