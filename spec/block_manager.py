"""Block tables: each sequence's map from logical token positions to physical blocks.

A sequence with ``t`` tokens holds exactly ``ceil(t / B)`` blocks. Token ``p``
lives in slot ``table[p // B] * B + p % B`` of the flattened pool. The table
grows one block at a time, when its last block fills, so a sequence wastes at
most ``B - 1`` slots, in its last block.

The seeds' pitfall, with B = 16: a request that ends at 20 tokens holds two
blocks and wastes 12 slots.

>>> m = BlockManager(num_blocks=10, block_size=16)
>>> m.add_sequence(0, prompt=list(range(20)))   # nothing cached yet
0
>>> slots = m.append_slots(0, list(range(20)))  # make room for all 20 prompt tokens
>>> m.block_table(0), slots[15:18]
((0, 1), [15, 16, 17])
>>> m.tail_waste(0)
12

Once the step that computes those 20 tokens is laid out (:meth:`BlockManager.take_copies`
marks that boundary; :func:`spec.batch.build_batch` calls it), forking the
sequence into a beam of width 4 before any divergence shares both blocks:
2 physical blocks are held, where cloning would take 8.

>>> m.take_copies()              # the step's batch is built: nothing to copy this time
[]
>>> for child in (1, 2, 3):
...     m.fork(0, child)
>>> m.pool.num_held, sum(len(m.block_table(s)) for s in m.sequence_ids())
(2, 8)

The first write into the shared, partly filled block copies it first:

>>> m.append_slots(1, [99])     # token 20 of beam 1 goes into a fresh copy of block 1
[36]
>>> m.block_table(1), m.take_copies()
((0, 2), [(1, 2)])

A sequence id is an ``int`` (a Python int or a numpy integer, never a bool) that
is ``>= 0``: the same rule as a block id, so that ``True`` never names sequence 1
and ``-1`` stays free to mean padding in a batch. Token ids are ints ``>= 0``.
Every operation checks all of its arguments (:mod:`spec.validate`) before it
changes anything.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from spec.block_pool import BlockHash, BlockPool
from spec.errors import (
    ArgumentValueError,
    DuplicateSequenceError,
    OutOfBlocksError,
    StepBoundaryError,
    UnknownSequenceError,
)
from spec.kv_budget import cdiv as cdiv  # re-exported: blocks for t tokens, ceil(t / B)
from spec.prefix_cache import block_hash, prompt_block_hashes
from spec.validate import check_bool, check_int, check_keys, check_token_ids, is_int

PAD_SLOT = -1
"""A slot-mapping entry that names no slot: a KV write skips it."""


@dataclass
class _Sequence:
    table: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # every token that has a slot
    hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of full blocks
    extra_keys: tuple[Hashable, ...] = ()
    num_committed: int = 0  # tokens laid out in a step already: their KV is (being) written


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were found."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    """Block tables for many sequences over one :class:`BlockPool`.

    Every operation either completes or raises before changing anything.
    Copy-on-write copies are recorded, not executed: a backend executes the
    list returned by :meth:`take_copies` before the step's KV writes. Until
    then each pending copy holds a reference to its source block, so the
    source cannot be reallocated (and overwritten) before it has been read.

    Pending copies are indexed twice, so that no operation scans them: by
    destination (which copy fills this block) and by source (how many copies
    still read this block, its *pins*). An append and a free cost O(1) and
    O(blocks of the sequence) however many copies the step has made.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False):
        caching = check_bool("enable_prefix_caching", enable_prefix_caching)
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = self.pool.block_size
        self.enable_prefix_caching = caching
        self.prefix_stats = PrefixCacheStats()
        self._seqs: dict[int, _Sequence] = {}
        self._copies: dict[int, int] = {}  # dst -> src, in the order the copies were made
        self._pins: dict[int, int] = {}  # src -> how many pending copies read it

    # -- queries --------------------------------------------------------------

    def sequence_ids(self) -> list[int]:
        return list(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        """Whether ``seq_id`` names a held sequence (anything but an int names none)."""
        return is_int(seq_id) and int(seq_id) in self._seqs  # type: ignore[call-overload]

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._get("seq_id", seq_id).table)

    def num_tokens(self, seq_id: int) -> int:
        return len(self._get("seq_id", seq_id).tokens)

    def tokens(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._get("seq_id", seq_id).tokens)

    def num_uncommitted(self, seq_id: int) -> int:
        """Tokens appended since the sequence was last laid out in a batch (KV not yet written)."""
        seq = self._get("seq_id", seq_id)
        return len(seq.tokens) - seq.num_committed

    def slot(self, seq_id: int, position: int) -> int:
        """The physical slot of logical position ``position``: the paging formula."""
        seq = self._get("seq_id", seq_id)
        p = check_int("position", position)
        if not 0 <= p < len(seq.tokens):
            raise ArgumentValueError(
                f"position must be in 0..{len(seq.tokens) - 1} (the tokens of sequence "
                f"{seq_id}), got {p}"
            )
        b = self.block_size
        return seq.table[p // b] * b + p % b

    def tail_waste(self, seq_id: int) -> int:
        """Slots allocated to the sequence that hold no token: at most ``B - 1``."""
        seq = self._get("seq_id", seq_id)
        return len(seq.table) * self.block_size - len(seq.tokens)

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Fresh blocks that appending ``num_new_tokens`` would take from the pool."""
        seq = self._get("seq_id", seq_id)
        return self._blocks_needed(seq, check_int("num_new_tokens", num_new_tokens, low=0))

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_new_tokens) <= self.pool.num_available

    def cached_prefix(self, prompt: Sequence[int], extra_keys: Sequence[Hashable] = ()) -> int:
        """How many prompt tokens :meth:`add_sequence` would take from the cache (a pure query)."""
        tokens = check_token_ids("prompt", prompt)
        hits = self._cache_hits(tokens, check_keys("extra_keys", extra_keys))
        return len(hits) * self.block_size

    def pending_copies(self) -> tuple[tuple[int, int], ...]:
        """The copies ``(src, dst)`` recorded and not yet taken, oldest first (a pure query)."""
        return tuple((src, dst) for dst, src in self._copies.items())

    # -- lifecycle ------------------------------------------------------------

    def add_sequence(
        self, seq_id: int, prompt: Sequence[int], *, extra_keys: Sequence[Hashable] = ()
    ) -> int:
        """Start a sequence; return how many of its prompt tokens the prefix cache supplies.

        With prefix caching on, the prompt's leading full blocks that are
        resident are shared (reference count up) instead of recomputed. At
        least one prompt token is always left to compute, because its output
        (the next token's logits) is needed. The caller then appends slots for
        the remaining prompt tokens, ``prompt[returned:]``.
        """
        sid = self._new_id("seq_id", seq_id)
        tokens = check_token_ids("prompt", prompt)
        seq = _Sequence(extra_keys=check_keys("extra_keys", extra_keys))
        for h, block in self._cache_hits(tokens, seq.extra_keys):
            self.pool.incref(block)
            seq.table.append(block)
            seq.hashes.append(h)
        seq.tokens = list(tokens[: len(seq.table) * self.block_size])
        if self.enable_prefix_caching and tokens:
            self.prefix_stats.queried_tokens += len(tokens)
            self.prefix_stats.hit_tokens += len(seq.tokens)
        seq.num_committed = len(seq.tokens)  # cached blocks already hold their KV
        self._seqs[sid] = seq
        return len(seq.tokens)

    def append_slots(self, seq_id: int, token_ids: Sequence[int]) -> list[int]:
        """Give slots to the next tokens of a sequence and return them, in order.

        Copies the last block first if it is shared (copy-on-write), then grows
        the table one block at a time. Raises :class:`OutOfBlocksError` and
        changes nothing (but count the failure) if the pool cannot supply
        every block needed.
        """
        seq = self._get("seq_id", seq_id)
        tokens = check_token_ids("token_ids", token_ids)
        needed = self._blocks_needed(seq, len(tokens))
        if needed > self.pool.num_available:
            self.pool.num_allocation_failures += 1
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {needed} blocks for {len(tokens)} tokens, "
                f"{self.pool.num_available} available"
            )
        if tokens and self._needs_copy(seq):
            self._copy_on_write(seq)
        start = len(seq.tokens)
        while len(seq.table) < cdiv(start + len(tokens), self.block_size):
            seq.table.append(self.pool.allocate())
        seq.tokens.extend(tokens)
        self._name_full_blocks(seq)
        b = self.block_size
        return [seq.table[p // b] * b + p % b for p in range(start, len(seq.tokens))]

    def mark_written(self, seq_id: int) -> None:
        """Count every token of ``seq_id`` as laid out: a swap-in restores their KV this step.

        Tokens appended by :meth:`append_slots` are otherwise written by the
        step that schedules them (:func:`spec.batch.build_batch` checks that).
        """
        seq = self._get("seq_id", seq_id)
        seq.num_committed = len(seq.tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all its blocks.

        Nothing is copied now; each shared block gains a holder. A later write
        into a shared block copies that one block (see :meth:`append_slots`).

        A fork happens between steps: every token of the parent must already be
        laid out in a batch (:meth:`take_copies`), because a copy runs before
        its step's KV writes and would miss the parent's tokens of that step.
        """
        parent = self._get("parent_id", parent_id)
        cid = self._new_id("child_id", child_id)
        pending = len(parent.tokens) - parent.num_committed
        if pending:
            raise StepBoundaryError(
                f"parent_id must name a sequence with no tokens in the current step, got "
                f"sequence {parent_id}, which has {pending} tokens appended in the current "
                "step: fork after the step's batch is built"
            )
        for block in parent.table:
            self.pool.incref(block)
        self._seqs[cid] = _Sequence(
            list(parent.table),
            list(parent.tokens),
            list(parent.hashes),
            parent.extra_keys,
            parent.num_committed,
        )

    def free(self, seq_id: int) -> None:
        """Drop a sequence. Its blocks lose a holder each, last block first.

        Releasing the tail first puts the end of a cached chain ahead of its
        beginning in the eviction order: the shared beginning is the part most
        likely to be reused, and a chain's end is useless without it.

        Where the sequence is the last table holding a block, two promises of
        the current step are withdrawn: a pending copy into the block is
        dropped (nobody will read it), and a block whose content this step
        was to write loses its hash (it will never be written, so it must
        never be found).
        """
        seq = self._get("seq_id", seq_id)
        b = self.block_size
        for i, block in enumerate(seq.table):
            if self.pool.ref_count(block) - self._pins.get(block, 0) == 1:
                if block in self._copies:
                    self._drop_copy(block)
                if (i + 1) * b > seq.num_committed:
                    self.pool.unregister(block)
        for block in reversed(seq.table):
            self.pool.decref(block)
        del self._seqs[int(seq_id)]

    def take_copies(self) -> list[tuple[int, int]]:
        """Hand over the pending copy-on-write copies ``(src, dst)`` and release their sources.

        The caller must execute them (for K and V of every layer) before this
        step's KV writes. Sources are never destinations in the same list, so
        the copies may run in any order, or all at once. They come in the
        order they were made, so a run is reproducible.
        """
        copies = list(self.pending_copies())
        self._copies, self._pins = {}, {}
        for src, _ in copies:
            self.pool.decref(src)
        for seq in self._seqs.values():
            seq.num_committed = len(seq.tokens)
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (held blocks stay held, but are no longer findable)."""
        self.pool.reset_cache()

    # -- invariants ------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert every invariant of the tables and the pool (tests call this every step)."""
        holders: dict[int, int] = {}
        b = self.block_size
        for seq_id, seq in self._seqs.items():
            assert len(seq.table) == cdiv(len(seq.tokens), b), (
                f"sequence {seq_id}: {len(seq.tokens)} tokens in {len(seq.table)} blocks"
            )
            assert len(set(seq.table)) == len(seq.table), f"sequence {seq_id}: aliased table"
            assert len(seq.hashes) == len(seq.tokens) // b, (
                f"sequence {seq_id}: {len(seq.hashes)} hashes, {len(seq.tokens) // b} full blocks"
            )
            assert 0 <= seq.num_committed <= len(seq.tokens), (
                f"sequence {seq_id}: {seq.num_committed} of {len(seq.tokens)} tokens committed"
            )
            for block in seq.table:
                holders[block] = holders.get(block, 0) + 1
        pins: dict[int, int] = {}
        for dst, src in self._copies.items():
            pins[src] = pins.get(src, 0) + 1
            assert dst not in self._copies.values(), f"block {dst} is src and dst"
            assert holders.get(dst, 0) > 0, f"pending copy into block {dst}, which nobody holds"
        assert pins == self._pins, f"pins {self._pins} do not count the pending copies {pins}"
        for src, count in pins.items():
            holders[src] = holders.get(src, 0) + count
        self.pool.check_integrity(holders)

    # -- internals ------------------------------------------------------------

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

    def _blocks_needed(self, seq: _Sequence, num_new_tokens: int) -> int:
        grow = cdiv(len(seq.tokens) + num_new_tokens, self.block_size) - len(seq.table)
        return grow + int(num_new_tokens > 0 and self._needs_copy(seq))

    def _cache_hits(
        self, tokens: tuple[int, ...], extra_keys: tuple[Hashable, ...]
    ) -> list[tuple[BlockHash, int]]:
        """The prompt's leading resident full blocks, as ``(hash, block)``.

        One rule for :meth:`cached_prefix` and :meth:`add_sequence`: at least
        one token is left to compute, and the first miss ends the run (hashes
        are chained, so nothing after a miss can hit).
        """
        if not self.enable_prefix_caching or not tokens:
            return []
        usable = (len(tokens) - 1) // self.block_size  # leave >= 1 token to compute
        hits = []
        for h in prompt_block_hashes(
            tokens[: usable * self.block_size], self.block_size, extra_keys
        ):
            block = self.pool.cached_block(h)
            if block is None:
                break
            hits.append((h, block))
        return hits

    def _needs_copy(self, seq: _Sequence) -> bool:
        """The next token lands in the last block, and another *table* also holds that block.

        A pending copy's reference (a pin) does not count: once every other
        writer has moved to its own copy, the last one writes in place.
        """
        if len(seq.tokens) % self.block_size == 0:
            return False
        last = seq.table[-1]
        return self.pool.ref_count(last) - self._pins.get(last, 0) > 1

    def _copy_on_write(self, seq: _Sequence) -> None:
        src = seq.table[-1]
        dst = self.pool.allocate()
        self._copies[dst] = src  # the writer's reference moves to the copy: a pin
        self._pins[src] = self._pins.get(src, 0) + 1
        seq.table[-1] = dst

    def _drop_copy(self, dst: int) -> None:
        """Forget the pending copy into ``dst``, and release its pin on the source."""
        src = self._copies.pop(dst)
        self._pins[src] -= 1
        if not self._pins[src]:
            del self._pins[src]
        self.pool.decref(src)

    def _name_full_blocks(self, seq: _Sequence) -> None:
        """Hash the blocks that have just filled, and offer them to the prefix cache."""
        b = self.block_size
        while len(seq.hashes) < len(seq.tokens) // b:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            h = block_hash(parent, seq.tokens[i * b : (i + 1) * b], seq.extra_keys)
            seq.hashes.append(h)
            if self.enable_prefix_caching:
                self.pool.register(seq.table[i], h)
