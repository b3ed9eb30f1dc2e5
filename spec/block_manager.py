"""Block tables: each sequence's map from logical token positions to physical blocks.

A sequence with ``t`` tokens holds exactly ``ceil(t / B)`` blocks. Token ``p``
lives in slot ``table[p // B] * B + p % B`` of the flattened pool. The table
grows one block at a time, when its last block fills, so a sequence wastes at
most ``B - 1`` slots, in its last block.

The classic pitfall, with B = 16: a request that ends at 20 tokens holds two
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

>>> w = BlockManager(num_blocks=8, block_size=4, window=4)
>>> w.add_sequence(0, []), len(w.append_slots(0, list(range(10))))
(0, 10)
>>> w.take_copies(); w.append_slots(0, [10])        # the query at 10 sees 7..10: block 0 goes
[]
[10]
>>> w.block_table(0), w.pool.num_held
((-1, 1, 2), 2)

A sequence id is an ``int`` (a Python int or a numpy integer, never a bool) that
is ``>= 0``: the same rule as a block id, so that ``True`` never names sequence 1
and ``-1`` stays free to mean padding in a batch. Token ids are ints ``>= 0``.
Every operation checks all of its arguments (:mod:`spec.validate`) before it
changes anything.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from spec.block_pool import BlockHash, BlockPool
from spec.errors import (
    ArgumentValueError,
    DuplicateSequenceError,
    OutOfBlocksError,
    SpeculationError,
    StepBoundaryError,
    UnknownSequenceError,
)
from spec.kv_budget import cdiv as cdiv  # re-exported: blocks for t tokens, ceil(t / B)
from spec.prefix_cache import prompt_block_hashes
from spec.validate import (
    check_bool,
    check_instance,
    check_int,
    check_keys,
    check_positive,
    check_token_ids,
    is_int,
)

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
    def earliest_query(self) -> int:
        """The first position whose query may still run: not laid out yet, or a draft."""
        return min(self.num_committed, self.num_verified)


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were found."""

    queried_tokens: int = 0  # prompt tokens looked up, cumulative
    hit_tokens: int = 0  # of those, found resident

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

    Several managers may share one ``pool`` (the KV cache groups of one
    model, :mod:`spec.cache_manager`): a block is then held by one group at a
    time, and ``group_key`` keeps each group's prefix-cache names apart, since
    equal tokens give different KV in different layers.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = False,
        window: int | None = None,
        pool: BlockPool | None = None,
        group_key: Hashable | None = None,
    ):
        caching = check_bool("enable_prefix_caching", enable_prefix_caching)
        self.window = None if window is None else check_positive("window", window)
        if pool is None:
            self.pool = BlockPool(num_blocks, block_size)
        else:
            self.pool = check_instance("pool", pool, BlockPool)
            shape = (
                check_positive("num_blocks", num_blocks),
                check_positive("block_size", block_size),
            )
            if shape != (pool.num_blocks, pool.block_size):
                raise ArgumentValueError(
                    f"pool has {pool.num_blocks} blocks of {pool.block_size}, but num_blocks, "
                    f"block_size are {shape}"
                )
        self.block_size = self.pool.block_size
        self.enable_prefix_caching = caching
        self.prefix_stats = PrefixCacheStats()
        self._group_keys: tuple[Hashable, ...] = (
            () if group_key is None else check_keys("group_key", [("kv cache group", group_key)])
        )
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
        return tuple(seq.table), len(seq.tokens), len(seq.tokens) - seq.num_committed

    def num_uncommitted(self, seq_id: int) -> int:
        """Tokens appended since the sequence was last laid out in a batch (KV not yet written)."""
        seq = self._get("seq_id", seq_id)
        return len(seq.tokens) - seq.num_committed

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

    def held_from(self, num_computed: int) -> int:
        """The first table entry a sequence with ``num_computed`` tokens computed still needs.

        0 without a window. With a window of ``w``, the block of position
        ``num_computed - w + 1``: the first key the next query (at position
        ``num_computed``) sees; every entry before it can be released.

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

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Fresh blocks that appending ``num_new_tokens`` would take from the pool."""
        seq = self._get("seq_id", seq_id)
        return self._blocks_needed(seq, check_int("num_new_tokens", num_new_tokens, low=0))

    def blocks_reclaimed(self, seq_id: int) -> int:
        """Blocks the next append gives back to the pool: out of the window, no other holder."""
        return self._reclaimable(self._get("seq_id", seq_id))

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        seq = self._get("seq_id", seq_id)
        needed = self._blocks_needed(seq, check_int("num_new_tokens", num_new_tokens, low=0))
        return needed - self._reclaimable(seq) <= self.pool.num_available

    def cached_prefix(
        self,
        prompt: Sequence[int],
        extra_keys: Sequence[Hashable] = (),
        *,
        limit: int | None = None,
    ) -> int:
        """How many prompt tokens :meth:`add_sequence` would take from the cache (a pure query).

        With ``limit``, the most it would take when told ``max_cached=limit``.
        """
        tokens = check_token_ids("prompt", prompt)
        hits = self._cache_hits(tokens, self._keys(extra_keys), self._limit(limit))
        return len(hits) * self.block_size

    def blocks_to_admit(
        self,
        prompt: Sequence[int],
        num_new: int,
        *,
        extra_keys: Sequence[Hashable] = (),
        max_cached: int | None = None,
    ) -> int:
        """Available blocks :meth:`add_sequence` then ``num_new`` appended tokens would consume.

        A prefix hit on a block nobody holds (cached, evictable) takes it out
        of the available count just like an allocation, so it counts.
        """
        tokens = check_token_ids("prompt", prompt)
        hits = self._cache_hits(tokens, self._keys(extra_keys), self._limit(max_cached))
        evictable = sum(b != PAD_BLOCK and self.pool.ref_count(b) == 0 for _, b in hits)
        cached = len(hits) * self.block_size
        n = check_int("num_new", num_new, low=0, high=len(tokens) - cached)
        return evictable + cdiv(cached + n, self.block_size) - len(hits)

    def blocks_to_restore(self, num_tokens: int, num_new: int) -> int:
        """Blocks :meth:`restore` of ``num_tokens`` tokens then ``num_new`` more would take."""
        t = check_int("num_tokens", num_tokens, low=0)
        n = check_int("num_new", num_new, low=0)
        return cdiv(t + n, self.block_size) - self.held_from(t)

    def pending_copies(self) -> tuple[tuple[int, int], ...]:
        """The copies ``(src, dst)`` recorded and not yet taken, oldest first (a pure query)."""
        return tuple((src, dst) for dst, src in self._copies.items())

    # -- lifecycle ------------------------------------------------------------

    def add_sequence(
        self,
        seq_id: int,
        prompt: Sequence[int],
        *,
        extra_keys: Sequence[Hashable] = (),
        max_cached: int | None = None,
    ) -> int:
        """Start a sequence; return how many of its prompt tokens the prefix cache supplies.

        With prefix caching on, the prompt's leading full blocks that are
        resident are shared (reference count up) instead of recomputed. At
        least one prompt token is always left to compute, because its output
        (the next token's logits) is needed. The caller then appends slots for
        the remaining prompt tokens, ``prompt[returned:]``. ``max_cached``
        caps the tokens taken from the cache (the KV cache groups of one model
        must agree on one prefix).

        With a window, a hit needs only the blocks that the first computed
        query sees: the entries before them are released from the start, so
        a hit does not need them to be resident.
        """
        sid = self._new_id("seq_id", seq_id)
        tokens = check_token_ids("prompt", prompt)
        seq = _Sequence(extra_keys=self._keys(extra_keys))
        hits = self._cache_hits(tokens, seq.extra_keys, self._limit(max_cached))
        seq.released = self.held_from(len(hits) * self.block_size)
        for h, block in hits:
            if block != PAD_BLOCK:
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

    def append_slots(
        self, seq_id: int, token_ids: Sequence[int], *, num_draft: int = 0
    ) -> list[int]:
        """Give slots to the next tokens of a sequence and return them, in order.

        Releases what the window no longer needs first, then copies the last
        block if it is shared (copy-on-write), then grows the table one block
        at a time. Raises :class:`OutOfBlocksError` and changes nothing (but
        count the failure) if the pool cannot supply every block needed.

        With ``num_draft = k > 0`` the last ``k`` tokens are drafts
        (:mod:`spec.speculative`): they get slots like any token (lookahead
        slots, every block they touch counted by :meth:`blocks_needed`), but
        no block holding one is named for the prefix cache until
        :meth:`verify` accepts it. At least one token before the drafts (the
        last verified one) must be in the same append, and no drafts may be
        in flight already.
        """
        seq = self._get("seq_id", seq_id)
        tokens = check_token_ids("token_ids", token_ids)
        k = check_int("num_draft", num_draft, low=0)
        if k and k >= len(tokens):
            raise ArgumentValueError(
                f"num_draft must be below the {len(tokens)} tokens appended (the last verified "
                f"token comes before the drafts), got {k}"
            )
        if tokens and seq.num_draft:
            raise SpeculationError(
                f"seq_id {seq_id} has {seq.num_draft} drafts in flight: verify or roll them "
                "back before appending"
            )
        needed = self._blocks_needed(seq, len(tokens))
        reclaimed = self._reclaimable(seq)
        if needed - reclaimed > self.pool.num_available:
            self.pool.num_allocation_failures += 1
            released = f" ({reclaimed} released by its window)" if reclaimed else ""
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {needed} blocks for {len(tokens)} tokens, "
                f"{self.pool.num_available} available{released}"
            )
        if self.window is not None:
            self._release(seq)
        if tokens and self._needs_copy(seq):
            self._copy_on_write(seq)
        start = len(seq.tokens)
        while len(seq.table) < cdiv(start + len(tokens), self.block_size):
            seq.table.append(self.pool.allocate())
        seq.tokens.extend(tokens)
        seq.num_draft = k
        self._name_full_blocks(seq)
        b = self.block_size
        return slot_range(seq.table, start, len(seq.tokens), b)

    def verify(self, seq_id: int, num_accepted: int) -> list[int]:
        """Accept the first ``num_accepted`` drafts of ``seq_id``; reject the rest.

        The drafts must be laid out (their step ran: :meth:`take_copies`). The
        sequence keeps ``num_verified + num_accepted`` tokens; blocks that held
        only rejected tokens go back to the pool at once (the policy of
        :mod:`spec.speculative`); full blocks now made only of verified tokens
        are named for the prefix cache. Returns the rejected tokens' slots,
        whose K/V must never be read: the next step overwrites them.
        """
        check_int("num_accepted", num_accepted, low=0)
        seq = self._drafting(seq_id)
        a = check_int("num_accepted", num_accepted, low=0, high=seq.num_draft)
        pending = len(seq.tokens) - seq.num_committed
        if pending:
            raise StepBoundaryError(
                f"seq_id {seq_id} has {pending} tokens not laid out yet: verify after its "
                "step's batch is built and run (or roll the drafts back)"
            )
        return self._truncate(seq, seq.num_verified + a)

    def rollback(self, seq_id: int) -> list[int]:
        """Reject every draft in flight of ``seq_id``, laid out or not; return their slots.

        What a preemption, or a step that will not run its drafts, does: the
        sequence returns to its verified tokens exactly as :meth:`verify` with
        no draft accepted would leave it.
        """
        seq = self._drafting(seq_id)
        return self._truncate(seq, seq.num_verified)

    def release_expired(self, seq_id: int) -> int:
        """Release now what the window no longer needs (the next append would); return how many.

        Always possible: it only gives blocks back. Several KV cache groups
        over one pool release first, then allocate, so that a block one
        group gives back can serve another in the same step.
        """
        return self._release(self._get("seq_id", seq_id))

    def restore(
        self, seq_id: int, tokens: Sequence[int], *, extra_keys: Sequence[Hashable] = ()
    ) -> list[int]:
        """Start ``seq_id`` holding ``tokens`` whose KV is written back from elsewhere (a swap-in).

        Fresh blocks for the entries the sequence still needs (with a window,
        only the window's), every token counted as laid out, since the
        swap-in, not the batch, writes their KV. Returns the slots of the
        positions held, ``held_from(len(tokens)) * B`` onwards, in order.
        """
        sid = self._new_id("seq_id", seq_id)
        toks = check_token_ids("tokens", tokens)
        seq = _Sequence(tokens=list(toks), extra_keys=self._keys(extra_keys))
        seq.released = self.held_from(len(toks))
        need = cdiv(len(toks), self.block_size) - seq.released
        if need > self.pool.num_available:
            self.pool.num_allocation_failures += 1
            raise OutOfBlocksError(
                f"sequence {sid} needs {need} blocks to restore {len(toks)} tokens, "
                f"{self.pool.num_available} available"
            )
        seq.table = [PAD_BLOCK] * seq.released + [self.pool.allocate() for _ in range(need)]
        self._name_full_blocks(seq)
        seq.num_committed = len(toks)
        self._seqs[sid] = seq
        b = self.block_size
        return slot_range(seq.table, seq.released * b, len(toks), b)

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
        Released entries stay released in the child: it shares only what the
        parent holds.

        A fork happens between steps: every token of the parent must already be
        laid out in a batch (:meth:`take_copies`), because a copy runs before
        its step's KV writes and would miss the parent's tokens of that step.
        """
        parent = self._get("parent_id", parent_id)
        cid = self._new_id("child_id", child_id)
        if parent.num_draft:
            raise SpeculationError(
                f"parent_id {parent_id} has {parent.num_draft} drafts in flight: fork after "
                "they are verified or rolled back, so the child starts from verified tokens"
            )
        pending = len(parent.tokens) - parent.num_committed
        if pending:
            raise StepBoundaryError(
                f"parent_id must name a sequence with no tokens in the current step, got "
                f"sequence {parent_id}, which has {pending} tokens appended in the current "
                "step: fork after the step's batch is built"
            )
        for block in parent.table[parent.released :]:
            self.pool.incref(block)
        self._seqs[cid] = _Sequence(
            list(parent.table),
            list(parent.tokens),
            list(parent.hashes),
            parent.extra_keys,
            parent.num_committed,
            parent.released,
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
        for i in range(seq.released, len(seq.table)):
            block = seq.table[i]
            if self.pool.ref_count(block) - self._pins.get(block, 0) == 1:
                if block in self._copies:
                    self._drop_copy(block)
                if (i + 1) * b > seq.num_committed:
                    self.pool.unregister(block)
        for block in reversed(seq.table[seq.released :]):
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

    def check_integrity(self, others: Iterable[BlockManager] = ()) -> None:
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

    # -- internals ------------------------------------------------------------

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

    def _keys(self, extra_keys: Sequence[Hashable]) -> tuple[Hashable, ...]:
        return self._group_keys + check_keys("extra_keys", extra_keys)

    def _limit(self, limit: int | None) -> int | None:
        return None if limit is None else check_int("max_cached", limit, low=0)

    def _blocks_needed(self, seq: _Sequence, num_new_tokens: int) -> int:
        grow = cdiv(len(seq.tokens) + num_new_tokens, self.block_size) - len(seq.table)
        return grow + int(num_new_tokens > 0 and self._needs_copy(seq))

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

    def _cache_hits(
        self, tokens: tuple[int, ...], extra_keys: tuple[Hashable, ...], limit: int | None = None
    ) -> list[tuple[BlockHash, int]]:
        """The prompt's leading cached full blocks, as ``(hash, block)``.

        One rule for :meth:`cached_prefix`, :meth:`blocks_to_admit` and
        :meth:`add_sequence`: at least one token is left to compute, and at
        most ``limit`` tokens come from the cache. Without a window every
        block of the prefix must be resident, so the first miss ends the run
        (hashes are chained, so nothing after a miss can hit). With a window,
        ``k`` blocks hit when the ones the query at ``k * B`` sees are
        resident; the blocks before them come back as :data:`PAD_BLOCK`.
        """
        if not self.enable_prefix_caching or not tokens:
            return []
        b = self.block_size
        usable = (len(tokens) - 1) // b  # leave >= 1 token to compute
        if limit is not None:
            usable = min(usable, limit // b)
        hashes = prompt_block_hashes(tokens[: usable * b], b, extra_keys)
        blocks = [self.pool.cached_block(h) for h in hashes]
        best, run = 0, 0
        for j, block in enumerate(blocks):
            run = run + 1 if block is not None else 0
            if self.window is None and block is None:
                break
            if run >= j + 1 - self.held_from((j + 1) * b):
                best = j + 1
        first = self.held_from(best * b)
        return [
            (h, PAD_BLOCK if i < first or x is None else x)
            for i, (h, x) in enumerate(zip(hashes[:best], blocks, strict=False))
        ]

    def _drafting(self, seq_id: object) -> _Sequence:
        """The held sequence ``seq_id``, which must have drafts in flight."""
        seq = self._get("seq_id", seq_id)
        if not seq.num_draft:
            raise SpeculationError(
                f"seq_id {seq_id} has no drafts in flight (never drafted, or already "
                "verified or rolled back)"
            )
        return seq

    def _truncate(self, seq: _Sequence, length: int) -> list[int]:
        """Drop the tokens from ``length`` on (drafts only), their blocks, and return their slots.

        The dropped blocks were allocated fresh for drafts (a copy-on-write
        copy is only ever made for the block of the first token appended,
        which is verified), so they hold no hash and no pending copy, and
        this sequence is their one holder: each goes straight back to the pool.
        """
        b = self.block_size
        rejected = slot_range(seq.table, length, len(seq.tokens), b)
        keep = cdiv(length, b)
        for block in reversed(seq.table[keep:]):
            self.pool.decref(block)
        del seq.table[keep:], seq.tokens[length:]
        seq.num_draft = 0
        seq.num_committed = min(seq.num_committed, length)
        self._name_full_blocks(seq)
        return rejected

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
        """Hash the blocks that have just filled, and offer the held ones to the prefix cache.

        Without prefix caching nothing is named: no lookup could use the names.
        Only verified tokens are named: a block holding a draft may yet lose it.
        """
        if not self.enable_prefix_caching:
            return
        b, first = self.block_size, len(seq.hashes)
        parent = seq.hashes[-1] if seq.hashes else None
        new = seq.tokens[first * b : seq.num_verified // b * b]
        seq.hashes.extend(prompt_block_hashes(new, b, seq.extra_keys, parent=parent))
        for i in range(max(first, seq.released), len(seq.hashes)):
            self.pool.register(seq.table[i], seq.hashes[i])
