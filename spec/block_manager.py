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

Here: growth, fork and copy-on-write, a sequence's start and end, drafts'
verify or rollback. Queries and windows: :mod:`spec.block_table`; prefix hits:
:mod:`spec.prefix_hits`; invariants: :mod:`spec.block_invariants`.

A sequence id is an ``int`` (a Python int or a numpy integer, never a bool) that
is ``>= 0``: the same rule as a block id, so that ``True`` never names sequence 1
and ``-1`` stays free to mean padding in a batch. Token ids are ints ``>= 0``.
Every operation checks all of its arguments (:mod:`spec.validate`) before it
changes anything.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace

from spec.block_invariants import BlockInvariants
from spec.block_pool import BlockPool
from spec.block_table import PAD_BLOCK as PAD_BLOCK
from spec.block_table import PAD_SLOT as PAD_SLOT
from spec.block_table import _Sequence as _Sequence
from spec.block_table import slot_range as slot_range
from spec.errors import ArgumentValueError, OutOfBlocksError, SpeculationError, StepBoundaryError
from spec.kv_budget import cdiv as cdiv  # re-exported: blocks for t tokens, ceil(t / B)
from spec.prefix_hits import PrefixCacheStats as PrefixCacheStats
from spec.prefix_hits import PrefixHits
from spec.validate import (
    check_bool,
    check_instance,
    check_int,
    check_keys,
    check_positive,
    check_token_ids,
)


def check_num_draft(num_draft: int, num_tokens: int) -> None:
    """Drafts come after the last verified token, which the same append must carry."""
    if num_draft and num_draft >= num_tokens:
        raise ArgumentValueError(
            f"num_draft must be below the {num_tokens} tokens appended (the last verified "
            f"token comes before the drafts), got {num_draft}"
        )


class BlockManager(PrefixHits, BlockInvariants):
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
    time.
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
        self._group_keys = (
            () if group_key is None else check_keys("group_key", [("kv cache group", group_key)])
        )
        self._seqs = {}
        self._copies = {}
        self._pins = {}

    # -- growth ---------------------------------------------------------------

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Fresh blocks that appending ``num_new_tokens`` would take from the pool."""
        seq = self._get("seq_id", seq_id)
        return self._blocks_needed(seq, check_int("num_new_tokens", num_new_tokens, low=0))

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        """Could the pool supply what appending would take, less what the window gives back?"""
        needed = self.blocks_needed(seq_id, num_new_tokens)
        return needed - self.blocks_reclaimed(seq_id) <= self.pool.num_available

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
        check_num_draft(k, len(tokens))
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

    def _blocks_needed(self, seq: _Sequence, num_new_tokens: int) -> int:
        grow = cdiv(len(seq.tokens) + num_new_tokens, self.block_size) - len(seq.table)
        return grow + int(num_new_tokens > 0 and self._needs_copy(seq))

    # -- fork and copy-on-write ----------------------------------------------

    def pending_copies(self) -> tuple[tuple[int, int], ...]:
        """The copies ``(src, dst)`` recorded and not yet taken, oldest first (a pure query)."""
        return tuple((src, dst) for dst, src in self._copies.items())

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

    def fork(self, parent_id: int, child_id: int) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all its blocks.

        Nothing is copied now; each shared block gains a holder. A later write
        into a shared block copies that one block (see :meth:`append_slots`).
        Released entries stay released in the child: it shares only what the
        parent holds.

        A fork happens between steps, with no drafts in flight (:meth:`check_fork`).
        """
        parent = self._get("parent_id", parent_id)
        cid = self._new_id("child_id", child_id)
        self.check_fork(parent_id)
        for block in parent.table[parent.released :]:
            self.pool.incref(block)
        self._seqs[cid] = replace(
            parent, table=list(parent.table), tokens=list(parent.tokens), hashes=list(parent.hashes)
        )

    def check_fork(self, parent_id: int) -> None:
        """Raise, naming ``parent_id``, unless that sequence may fork now (a pure check).

        A fork happens between steps: every token of the parent must already be
        laid out in a batch (:meth:`take_copies`), because a copy runs before
        its step's KV writes and would miss the parent's tokens of that step.
        And no drafts may be in flight, so the child starts from verified tokens.
        These are misuses, not a lack of memory: a caller with pools to ask
        (:meth:`spec.cache_manager.CacheManager.fork`) checks them first.
        """
        parent = self._get("parent_id", parent_id)
        if parent.num_draft:
            raise SpeculationError(
                f"parent_id {parent_id} has {parent.num_draft} drafts in flight: fork after "
                "they are verified or rolled back, so the child starts from verified tokens"
            )
        pending = parent.num_uncommitted
        if pending:
            raise StepBoundaryError(
                f"parent_id must name a sequence with no tokens in the current step, got "
                f"sequence {parent_id}, which has {pending} tokens appended in the current "
                "step: fork after the step's batch is built"
            )

    def _needs_copy(self, seq: _Sequence) -> bool:
        """The next token lands in the last block, and another *table* also holds that block.

        A pending copy's reference (a pin) does not count: once every other
        writer has moved to its own copy, the last one writes in place.
        """
        if len(seq.tokens) % self.block_size == 0:
            return False
        return self._tables_holding(seq.table[-1]) > 1

    def _tables_holding(self, block: int) -> int:
        """How many tables hold ``block``: its references less the pending copies that read it."""
        return self.pool.ref_count(block) - self._pins.get(block, 0)

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

    # -- the start and the end of a sequence ----------------------------------

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

    def blocks_to_restore(self, num_tokens: int, num_new: int) -> int:
        """Blocks :meth:`restore` of ``num_tokens`` tokens then ``num_new`` more would take."""
        t = check_int("num_tokens", num_tokens, low=0)
        n = check_int("num_new", num_new, low=0)
        return cdiv(t + n, self.block_size) - self.held_from(t)

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
            if self._tables_holding(block) == 1:
                if block in self._copies:
                    self._drop_copy(block)
                if (i + 1) * b > seq.num_committed:
                    self.pool.unregister(block)
        for block in reversed(seq.table[seq.released :]):
            self.pool.decref(block)
        del self._seqs[int(seq_id)]

    # -- drafts: verify or roll back ------------------------------------------

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
        pending = seq.num_uncommitted
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
