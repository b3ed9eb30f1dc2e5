"""Batch metadata: one step's work, flattened into a single super-sequence.

Continuous batching runs prefill chunks and single-token decodes in one forward
pass. There is no padded ``[batch, max_len]`` matrix: every scheduled token of
every sequence is laid end to end, and a few small arrays tell the kernels
where each sequence's tokens begin, how long its context is, and where its KV
lives. This is the whole contract between the scheduler and a backend.

Fields, for a step with ``S`` sequences and ``T`` scheduled tokens (dtypes are
what a tensor backend should use):

* ``seq_ids`` (S): which sequence each row describes.
* ``query_start_loc`` (S + 1, int32): sequence ``i``'s new tokens are rows
  ``query_start_loc[i] .. query_start_loc[i + 1] - 1`` of the flattened batch.
* ``seq_lens`` (S, int32): sequence ``i``'s context length *including* its
  new tokens. Its new tokens sit at the last ``query_len`` positions.
* ``block_tables`` (S x max_blocks, int32): each sequence's block table, padded
  with :data:`PAD_BLOCK`. Entries past ``ceil(seq_len / B)`` must never be read.
* ``slot_mapping`` (T, int64): the slot each new token's K and V go to.
* ``positions`` (T, int64): each new token's position in its sequence.
* ``copies`` (pairs of int): copy-on-write copies ``(src, dst)`` to execute,
  for K and V of every layer, *before* this step's KV writes.

Query token ``j`` of sequence ``i``, at position ``p = seq_len - query_len + j``,
attends to that sequence's keys at positions ``0 .. p``.

>>> from spec.block_manager import BlockManager
>>> m = BlockManager(num_blocks=8, block_size=4)
>>> _ = m.add_sequence(7, [0] * 6); _ = m.append_slots(7, [0] * 6)   # a 6-token prefill
>>> _ = m.add_sequence(9, [0] * 2); _ = m.append_slots(9, [0] * 2)
>>> batch = build_batch(m, [(7, 6), (9, 2)])
>>> batch.query_start_loc, batch.seq_lens, batch.block_tables
((0, 6, 8), (6, 2), ((0, 1), (2, -1)))
>>> batch.slot_mapping, batch.positions
((0, 1, 2, 3, 4, 5, 8, 9), (0, 1, 2, 3, 4, 5, 0, 1))
>>> _ = m.append_slots(9, [5])                                       # next step: one decode
>>> build_batch(m, [(9, 1)]).slot_mapping
(10,)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spec.block_manager import BlockManager, cdiv
from spec.errors import InvalidRequestError

PAD_BLOCK = -1
"""Block-table padding. A kernel that dereferences it reads outside the pool."""


@dataclass(frozen=True)
class BatchMetadata:
    """The flattened layout of one step; see the module docstring for each field."""

    block_size: int
    seq_ids: tuple[int, ...]
    query_start_loc: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    slot_mapping: tuple[int, ...]
    positions: tuple[int, ...]
    copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    @property
    def max_query_len(self) -> int:
        return max((self.query_len(i) for i in range(self.num_seqs)), default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len <= 1


def build_batch(manager: BlockManager, scheduled: Sequence[tuple[int, int]]) -> BatchMetadata:
    """Lay out one step: ``scheduled`` lists ``(seq_id, num_new_tokens)``.

    The new tokens must already have slots (:meth:`BlockManager.append_slots`):
    they are each sequence's last ``num_new_tokens`` tokens. Takes the
    manager's pending copy-on-write copies into the batch.
    """
    seen: set[int] = set()
    starts, lens, tables, slots, positions = [0], [], [], [], []
    b = manager.block_size
    for seq_id, n in scheduled:
        if seq_id in seen:
            raise InvalidRequestError(f"sequence {seq_id} is scheduled twice in one step")
        seen.add(seq_id)
        total = manager.num_tokens(seq_id)
        if not 1 <= n <= total:
            raise InvalidRequestError(
                f"sequence {seq_id}: {n} new tokens, but it holds {total} (need 1..{total})"
            )
        table = manager.block_table(seq_id)
        assert len(table) == cdiv(total, b)
        starts.append(starts[-1] + n)
        lens.append(total)
        tables.append(table)
        for p in range(total - n, total):
            positions.append(p)
            slots.append(table[p // b] * b + p % b)
    width = max((len(t) for t in tables), default=0)
    return BatchMetadata(
        block_size=b,
        seq_ids=tuple(s for s, _ in scheduled),
        query_start_loc=tuple(starts),
        seq_lens=tuple(lens),
        block_tables=tuple(t + (PAD_BLOCK,) * (width - len(t)) for t in tables),
        slot_mapping=tuple(slots),
        positions=tuple(positions),
        copies=tuple(manager.take_copies()),
    )
