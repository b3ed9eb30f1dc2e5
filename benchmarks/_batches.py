"""One step's layout for benchmarks and tests: sequences with cached context and new tokens."""

from __future__ import annotations

from collections.abc import Sequence

from spec.batch import BatchMetadata, build_batch
from spec.block_manager import BlockManager


def context_step(
    manager: BlockManager, work: Sequence[tuple[int, int]]
) -> tuple[BatchMetadata, list[list[int]]]:
    """Sequence ``i`` of ``work[i] = (context, new)``: ``context`` tokens from earlier steps, then
    ``new`` tokens scheduled now. Returns the step's batch and each sequence's context slots
    (where the caller writes the earlier steps' KV).

    >>> batch, context = context_step(BlockManager(4, 2), [(3, 1), (0, 2)])
    >>> batch.query_start_loc, batch.seq_lens, context
    ((0, 1, 3), (4, 2), [[0, 1, 2], []])
    """
    context_slots = []
    for seq, (context, new) in enumerate(work):
        manager.add_sequence(seq, [0] * (context + new))
        context_slots.append(manager.append_slots(seq, [0] * context))
        manager.mark_written(seq)  # the context's KV was written by earlier steps
        manager.append_slots(seq, [0] * new)
    return build_batch(manager, [(seq, new) for seq, (_, new) in enumerate(work)]), context_slots
