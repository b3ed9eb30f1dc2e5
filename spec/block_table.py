"""Block tables, the queries that read them, and the sliding window that releases their heads.

Token ``p`` lives in slot ``table[p // B] * B + p % B`` of the pool (:func:`slot_range`);
the rules that change tables (:mod:`spec.block_manager`) build on :class:`BlockTables`.

**Sliding window.** A manager made with ``window=w`` serves layers whose
queries see only the last ``w`` positions (``p - w < k <= p``). A block
whose every slot is older than the window of the sequence's earliest query
still to run is *released* as the sequence advances: its table entry becomes
:data:`PAD_BLOCK` (positions keep indexing the same way) and the block loses
this holder. The earliest query still to run is the first token not yet laid
out in a step (``num_committed``), so a step's queries never lose a key; the
release happens when the sequence next grows (:meth:`BlockManager.append_slots`),
after the step that computed those tokens has run. A decoding sequence then
holds at most ``ceil(w / B) + 1`` blocks, and a step that appends ``q``
tokens at most ``cdiv(w + q - 2, B) + 1``: a chunk's own keys must all be
written before its later queries read them.

>>> from spec.block_manager import BlockManager
>>> w = BlockManager(num_blocks=8, block_size=4, window=4)
>>> w.add_sequence(0, []), len(w.append_slots(0, list(range(10))))
(0, 10)
>>> w.take_copies(); w.append_slots(0, [10])        # the query at 10 sees 7..10: block 0 goes
[]
[10]
>>> w.block_table(0), w.pool.num_held
((-1, 1, 2), 2)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from spec.block_pool import BlockHash, BlockPool
from spec.errors import ArgumentValueError, DuplicateSequenceError, UnknownSequenceError
from spec.kv_budget import cdiv
from spec.validate import check_int, check_positive, is_int

PAD_SLOT = -1
"""A slot-mapping entry that names no slot: a KV write skips it."""

PAD_BLOCK = -1
"""A block-table entry that names no block: table padding, or a block a window released."""


def slot_range(table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The slots of positions ``start .. end - 1``: ``table[p // B] * B + p % B`` for each.

    The paging formula, computed one block's run of positions at a time (a
    long prefill has many positions and few blocks).

    >>> slot_range([7, 2], 2, 6, block_size=4)      # positions 2, 3 in block 7; 4, 5 in block 2
    [30, 31, 8, 9]
    """
    out: list[int] = []
    p = start
    while p < end:
        i, offset = divmod(p, block_size)
        n = min(end - p, block_size - offset)
        base = table[i] * block_size + offset
        out.extend(range(base, base + n))
        p += n
    return out


@dataclass
class _Sequence:
    table: list[int] = field(default_factory=list)  # physical block ids, in logical order
    tokens: list[int] = field(default_factory=list)  # every token that has a slot
    hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of full blocks (caching)
    extra_keys: tuple[Hashable, ...] = ()  # mixed into every block hash (a LoRA adapter, ...)
    num_committed: int = 0  # tokens laid out in a step already: their KV is (being) written
    released: int = 0  # leading table entries a sliding window gave back (PAD_BLOCK)
    num_draft: int = 0  # trailing tokens that are drafts in flight (spec.speculative)

    @property
    def num_verified(self) -> int:
        """Tokens that are not drafts: the sequence a rollback returns to."""
        return len(self.tokens) - self.num_draft

    @property
    def num_uncommitted(self) -> int:
        """Tokens appended since the sequence was last laid out in a batch (KV not yet written)."""
        return len(self.tokens) - self.num_committed

    @property
    def earliest_query(self) -> int:
        """The first position whose query may still run: not laid out yet, or a draft."""
        return min(self.num_committed, self.num_verified)


class BlockTables:
    """Every sequence's table over one :class:`BlockPool`, and the questions that read them.

    Invariant: a sequence's table has ``ceil(t / B)`` entries for its ``t``
    tokens; the first ``released`` are :data:`PAD_BLOCK`, the rest are blocks
    it holds. The window's release is the one change made here.
    """

    pool: BlockPool  # the blocks every table points into
    block_size: int  # tokens per block, B
    window: int | None  # a sliding window of this many positions; None: full attention
    _seqs: dict[int, _Sequence]  # seq id -> its table and tokens

    def sequence_ids(self) -> list[int]:
        return list(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        """Whether ``seq_id`` names a held sequence (anything but an int names none)."""
        return is_int(seq_id) and int(seq_id) in self._seqs  # type: ignore[call-overload]

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        """The sequence's table: one entry per ``B`` tokens, :data:`PAD_BLOCK` where released."""
        return tuple(self._get("seq_id", seq_id).table)

    def held_blocks(self, seq_id: int) -> tuple[int, ...]:
        """The blocks the sequence holds: its table without the released entries."""
        seq = self._get("seq_id", seq_id)
        return tuple(seq.table[seq.released :])

    def num_tokens(self, seq_id: int) -> int:
        return len(self._get("seq_id", seq_id).tokens)

    def tokens(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._get("seq_id", seq_id).tokens)

    def layout_row(self, seq_id: int) -> tuple[tuple[int, ...], int, int]:
        """``(block table, tokens, tokens not yet laid out)``: what a step's layout reads."""
        seq = self._get("seq_id", seq_id)
        return tuple(seq.table), len(seq.tokens), seq.num_uncommitted

    def num_uncommitted(self, seq_id: int) -> int:
        """Tokens appended since the sequence was last laid out in a batch (KV not yet written)."""
        return self._get("seq_id", seq_id).num_uncommitted

    def num_drafts(self, seq_id: int) -> int:
        """Draft tokens in flight at the end of the sequence: 0 unless it speculates."""
        return self._get("seq_id", seq_id).num_draft

    def slot(self, seq_id: int, position: int) -> int:
        """The physical slot of logical position ``position``: the paging formula."""
        seq = self._get("seq_id", seq_id)
        p = check_int("position", position)
        if not 0 <= p < len(seq.tokens):
            raise ArgumentValueError(
                f"position must be in 0..{len(seq.tokens) - 1} (the tokens of sequence "
                f"{seq_id}), got {p}"
            )
        if p // self.block_size < seq.released:
            raise ArgumentValueError(
                f"position {p} of sequence {seq_id} is in a block its window released"
            )
        return slot_range(seq.table, p, p + 1, self.block_size)[0]

    def tail_waste(self, seq_id: int) -> int:
        """Slots allocated to the sequence that hold no token: at most ``B - 1``."""
        seq = self._get("seq_id", seq_id)
        return len(seq.table) * self.block_size - len(seq.tokens)

    # -- the sliding window ---------------------------------------------------

    def held_from(self, num_computed: int) -> int:
        """The first table entry a sequence with ``num_computed`` tokens computed still needs.

        0 without a window. With a window of ``w``, the block of position
        ``num_computed - w + 1``: the first key the next query (at position
        ``num_computed``) sees; every entry before it can be released.

        >>> from spec.block_manager import BlockManager
        >>> BlockManager(4, 4, window=6).held_from(12)   # the query at 12 sees 7..12
        1
        """
        c = check_int("num_computed", num_computed, low=0)
        if self.window is None:
            return 0
        return max(0, c - self.window + 1) // self.block_size

    def max_blocks(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """The most blocks one sequence of up to ``num_tokens`` tokens holds at once.

        ``ceil(t / B)`` without a window. With a window of ``w``, when no step
        appends more than ``max_chunk`` tokens to it, at most
        ``cdiv(w + q - 2, B) + 1`` for a step of ``q`` tokens: the positions
        from the window of its first query to its last token.

        >>> from spec.block_manager import BlockManager
        >>> m = BlockManager(4, 16, window=1024)
        >>> m.max_blocks(32_768, max_chunk=1), m.max_blocks(32_768, max_chunk=512)
        (65, 97)
        """
        t = check_int("num_tokens", num_tokens, low=0)
        full = cdiv(t, self.block_size)
        if self.window is None or t == 0:
            return full
        q = t if max_chunk is None else min(t, check_positive("max_chunk", max_chunk))
        return min(full, cdiv(self.window + q - 2, self.block_size) + 1)

    def blocks_reclaimed(self, seq_id: int) -> int:
        """Blocks the next append gives back to the pool: out of the window, no other holder."""
        return self._reclaimable(self._get("seq_id", seq_id))

    def release_expired(self, seq_id: int) -> int:
        """Release now what the window no longer needs (the next append would); return how many.

        Always possible: it only gives blocks back. Several KV cache groups
        over one pool release first, then allocate, so that a block one
        group gives back can serve another in the same step.
        """
        return self._release(self._get("seq_id", seq_id))

    def _reclaimable(self, seq: _Sequence) -> int:
        """Expired blocks nobody else holds: the pool gets them back when they are released."""
        if self.window is None:
            return 0
        return sum(self.pool.ref_count(b) == 1 for b in self._expired(seq))

    def _expired(self, seq: _Sequence) -> list[int]:
        """Held blocks wholly before the window of the sequence's earliest query still to run."""
        return seq.table[seq.released : self.held_from(seq.earliest_query)]

    def _release(self, seq: _Sequence) -> int:
        """Give back the expired blocks, oldest first; their table entries become PAD_BLOCK.

        Expiry is measured from the earliest query still to run, which is
        never past the verified tokens: drafts may be rejected, and the query
        after a rollback still needs the keys before it.

        They are full and already laid out, so a registered one keeps its hash
        and stays findable (cached) until evicted: a later prompt with the
        same prefix can still hit it.
        """
        end = self.held_from(seq.earliest_query)
        count = max(0, end - seq.released)
        for i in range(seq.released, end):
            self.pool.decref(seq.table[i])
            seq.table[i] = PAD_BLOCK
        seq.released += count
        return count

    # -- sequence ids ---------------------------------------------------------

    def _get(self, name: str, seq_id: object) -> _Sequence:
        """The held sequence that the argument ``name`` names."""
        sid = check_int(name, seq_id, low=0)
        if sid not in self._seqs:
            raise UnknownSequenceError(
                f"{name} must name a sequence the manager holds, got {sid} (never added, or freed)"
            )
        return self._seqs[sid]

    def _new_id(self, name: str, seq_id: object) -> int:
        """The argument ``name`` as the id of a sequence about to start."""
        sid = check_int(name, seq_id, low=0)
        if sid in self._seqs:
            raise DuplicateSequenceError(
                f"{name} must be a new sequence id, got {sid}: that sequence already exists"
            )
        return sid
