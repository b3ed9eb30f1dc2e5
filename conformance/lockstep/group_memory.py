"""The spec's memory side for a workload whose layers form several KV cache groups.

A workload with :attr:`~conformance.lockstep.workload.WorkloadConfig.group_windows`
(say a full-attention group and a sliding-window group) is driven through the
spec's :class:`~spec.cache_manager.CacheManager`, the way a scheduler drives
it: ask, then command. Every group has its own block table per sequence over
one shared pool; a windowed group releases the blocks its queries no longer
see (their table entries become :data:`~spec.batch.PAD_BLOCK`). The lockstep
(:mod:`conformance.lockstep.driver`) sees the same operations as with one group:

* :meth:`GroupMemory.add` starts a sequence on the prefix every group can
  supply, with no slot yet: :meth:`CacheManager.admit` with an empty first
  chunk. (An admission's first chunk must run in the step it is admitted in,
  since laying out a step commits every sequence's tokens; the suite's steps
  say later which tokens run, so the chunk comes with them.)
* :meth:`GroupMemory.append` gives a step's tokens their slots in every group
  at once (:meth:`CacheManager.grow`: windows release first), or, when the
  pool cannot, changes nothing in any group (checked);
* :meth:`GroupMemory.owners` names the live token of each slot of one group:
  a block a window released belongs to nobody in that group.

>>> from spec.backend import KVGeometry
>>> from spec.attention import AttentionVariant
>>> g = KVGeometry(2, 12, 2, 1, 8, layer_groups=(0, 1))
>>> config = WorkloadConfig(g, 1, 0.3, 0, variants=(AttentionVariant(), AttentionVariant(2)),
...                         group_windows=(None, 2))
>>> memory = GroupMemory(config)
>>> memory.add(0, [5, 6, 7, 8, 9])                  # no prefix hit
0
>>> memory.append(0, [5, 6, 7, 8, 9])
True
>>> batch = memory.layout([(0, 5)]); batch.tables(0), batch.tables(1)
(((0, 1, 2),), ((3, 4, 5),))
>>> memory.append(0, [1]), memory.layout([(0, 1)]).tables(1)    # the query at 5 sees 4..5
(True, ((-1, -1, 5),))
>>> sorted(memory.owners(1).items()), memory.released             # slots 10, 11: block 5
([(10, (0, 4)), (11, (0, 5))], 2)
"""

from __future__ import annotations

from collections.abc import Sequence

from conformance.lockstep.workload import WorkloadConfig
from spec.batch import PAD_BLOCK, BatchMetadata
from spec.block_manager import BlockManager, slot_range
from spec.cache_manager import CacheManager
from spec.errors import OutOfBlocksError

_Snapshot = tuple[int, tuple[tuple[tuple[int, ...], int], ...]]


class GroupMemory:
    """A :class:`CacheManager` over the workload's groups, driven by the lockstep's operations.

    Invariant: every group holds the same sequences with the same tokens
    (:meth:`CacheManager.check_integrity`); a failed growth changes nothing.
    """

    def __init__(self, config: WorkloadConfig) -> None:
        g = config.geometry
        self.cache = CacheManager(
            g.num_blocks,
            g.block_size,
            enable_prefix_caching=config.prefix_caching,
            groups=config.kv_cache_groups(),
        )
        self.released = 0  # table entries the windows released, over the workload

    @property
    def manager(self) -> BlockManager:
        """Group 0's block manager: the sequences, their tokens, the pool (read-only use)."""
        return self.cache.manager

    @property
    def managers(self) -> tuple[BlockManager, ...]:
        """Every group's block manager, in batch-group order (read-only use)."""
        return self.cache.managers

    def add(self, seq_id: int, prompt: Sequence[int]) -> int:
        """Start ``seq_id`` on its prefix hits in every group (the prefix all of them can
        supply, :meth:`CacheManager.cached_tokens`); return how many prompt tokens that is.

        Never fails for want of blocks: a hit shares a resident block, and the
        step that first runs the sequence asks for its fresh blocks.
        """
        cached = self.cache.cached_tokens(prompt)
        for m in self.managers:  # every group's hits, as CacheManager.admit takes them
            m.add_sequence(seq_id, prompt, max_cached=cached)
        return cached

    def append(self, seq_id: int, tokens: Sequence[int], num_draft: int = 0) -> bool:
        """Give slots to a step's ``tokens`` of ``seq_id``, in every group; False when the pool
        cannot, and then nothing changed in any group. The last ``num_draft`` are drafts."""
        before, released = self._snapshot(), self._released(seq_id)
        try:
            self.cache.grow(seq_id, tokens, num_draft=num_draft)
        except OutOfBlocksError:
            assert self._snapshot() == before, f"internal error: a failed growth changed {seq_id}"
            return False
        self.released += self._released(seq_id) - released
        return True

    def fork(self, parent_id: int, child_id: int) -> None:
        self.cache.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        self.cache.release(seq_id)

    def layout(self, scheduled: Sequence[tuple[int, int]]) -> BatchMetadata:
        """The step's batch: one table and slot mapping per group, and the step's copies."""
        return self.cache.layout(scheduled)

    def check_integrity(self) -> None:
        """The spec's invariants over every group and the shared pool."""
        self.cache.check_integrity()

    def held(self, group: int, seq_id: int) -> tuple[tuple[int, ...], int]:
        """Group ``group``'s table of ``seq_id`` and its first position in a held block (0
        unless a window released the blocks before it)."""
        m = self.managers[group]
        table = m.block_table(seq_id)
        return table, (len(table) - len(m.held_blocks(seq_id))) * m.block_size

    def owners(self, group: int) -> dict[int, tuple[int, int]]:
        """Slot -> (sequence, token) of every live token of group ``group`` (the lowest
        sequence id if shared); the slots of released blocks have no owner."""
        m = self.managers[group]
        out: dict[int, tuple[int, int]] = {}
        for seq_id in sorted(m.sequence_ids()):
            table, start = self.held(group, seq_id)
            slots = slot_range(table, start, m.num_tokens(seq_id), m.block_size)
            for pos, slot in enumerate(slots, start):
                out.setdefault(slot, (seq_id, pos))
        return out

    def _snapshot(self) -> _Snapshot:
        """The pool's available blocks and every group's tables and token counts."""
        rows = tuple(
            (m.block_table(s), m.num_tokens(s)) for m in self.managers for s in m.sequence_ids()
        )
        return self.cache.pool.num_available, rows

    def _released(self, seq_id: int) -> int:
        """Table entries of ``seq_id`` that a window released, over every group."""
        return sum(len(m.block_table(seq_id)) - len(m.held_blocks(seq_id)) for m in self.managers)


def describe_groups(config: WorkloadConfig) -> str:
    """How reports name a workload's KV cache groups.

    >>> from spec.backend import KVGeometry
    >>> g = KVGeometry(3, 8, 4, 1, 8, layer_groups=(1, 0, 1))
    >>> describe_groups(WorkloadConfig(g, 1, 0.3, 0, group_windows=(None, None)))
    'full attention (layer 1) + full attention (layers 0, 2)'
    """
    g = config.geometry
    parts = []
    for group, kind in enumerate(config.kv_cache_groups()):
        layers = [str(x) for x in range(g.num_layers) if g.group_of(x) == group]
        parts.append(f"{kind.name} (layer{'s' if len(layers) > 1 else ''} {', '.join(layers)})")
    return " + ".join(parts)


def released_rows(batch: BatchMetadata) -> int:
    """Table rows of ``batch``, over its groups, that start with entries a window released."""
    return sum(
        1
        for group in range(batch.num_groups)
        for row in batch.tables(group)
        if row[:1] == (PAD_BLOCK,)
    )
