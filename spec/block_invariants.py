"""The invariants of block tables: what every rule of the block manager keeps true.

One pass asserts them all; the tests run it after every step, so a broken rule shows there.
"""

from __future__ import annotations

from collections.abc import Iterable

from spec.block_table import PAD_BLOCK, BlockTables
from spec.kv_budget import cdiv


class BlockInvariants(BlockTables):
    """The checks of :class:`~spec.block_manager.BlockManager`'s invariants."""

    enable_prefix_caching: bool  # full blocks of verified tokens are named (hashed)
    _copies: dict[int, int]  # dst -> src, in the order the copies were made
    _pins: dict[int, int]  # src -> how many pending copies read it

    def check_integrity(self, others: Iterable[BlockInvariants] = ()) -> None:
        """Assert every invariant of the tables and the pool (tests call this every step).

        Linear in what it checks (table entries, pending copies, pool blocks):
        it runs after every step of the stateful tests, whatever their size.

        ``others`` are the managers that share this one's pool: their holders
        count too (call it on one of them, or on each: the same checks).
        """
        b = self.block_size
        for seq_id, seq in self._seqs.items():
            assert len(seq.table) == cdiv(len(seq.tokens), b), (
                f"sequence {seq_id}: {len(seq.tokens)} tokens in {len(seq.table)} blocks"
            )
            held = seq.table[seq.released :]
            assert all(x == PAD_BLOCK for x in seq.table[: seq.released]), (
                f"sequence {seq_id}: a released entry names a block"
            )
            assert seq.released <= self.held_from(seq.earliest_query), (
                f"sequence {seq_id}: {seq.released} entries released, but a query still needs "
                f"entry {self.held_from(seq.earliest_query)} on"
            )
            assert PAD_BLOCK not in held and len(set(held)) == len(held), (
                f"sequence {seq_id}: aliased table"
            )
            named = seq.num_verified // b if self.enable_prefix_caching else 0
            assert len(seq.hashes) == named, (
                f"sequence {seq_id}: {len(seq.hashes)} hashes, {named} full blocks"
            )
            assert 0 <= seq.num_committed <= len(seq.tokens), (
                f"sequence {seq_id}: {seq.num_committed} of {len(seq.tokens)} tokens committed"
            )
            assert 0 <= seq.num_draft < max(1, len(seq.tokens)), (
                f"sequence {seq_id}: {seq.num_draft} drafts in {len(seq.tokens)} tokens"
            )
            for i in range(max(seq.released, seq.num_verified // b), len(seq.table)):
                assert self.pool.block_hash(seq.table[i]) is None, (
                    f"sequence {seq_id}: block {seq.table[i]} holds an unverified token or is "
                    "partly filled, but has a prefix-cache hash"
                )
        pins: dict[int, int] = {}
        in_tables = self._table_holders()
        sources = set(self._copies.values())  # a set: linear in the pending copies, not quadratic
        for dst, src in self._copies.items():
            pins[src] = pins.get(src, 0) + 1
            assert dst not in sources, f"block {dst} is src and dst"
            assert in_tables.get(dst, 0) > 0, f"pending copy into block {dst}, which nobody holds"
        assert pins == self._pins, f"pins {self._pins} do not count the pending copies {pins}"
        holders: dict[int, int] = {}
        for m in (self, *others):
            for block, count in m._holders().items():
                holders[block] = holders.get(block, 0) + count
        self.pool.check_integrity(holders)

    def _table_holders(self) -> dict[int, int]:
        holders: dict[int, int] = {}
        for seq in self._seqs.values():
            for block in seq.table[seq.released :]:
                holders[block] = holders.get(block, 0) + 1
        return holders

    def _holders(self) -> dict[int, int]:
        """References this manager explains: table entries, plus pending copies' pins."""
        holders = self._table_holders()
        for src, count in self._pins.items():
            holders[src] = holders.get(src, 0) + count
        return holders
