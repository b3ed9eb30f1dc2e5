"""Stateful property tests of the block manager, its KV memory, and batch layout.

A Hypothesis state machine interleaves add (with prefix-cache hits), append,
multi-sequence steps, fork, free, cache reset and invalid operations, and
checks after every step that:

* every block is free, cached or held, never two at once, and reference
  counts equal the holders (``BlockManager.check_integrity``);
* each sequence holds ``ceil(t / B)`` blocks and wastes at most ``B - 1`` slots;
* gathering a sequence through its table returns, token by token, exactly the
  KV that belongs to its tokens. Each token's KV is a function of the whole
  prefix up to it, so a prefix-cache hit, a fork, or a copy-on-write that
  serves the wrong content is caught;
* a failed operation changes nothing;
* a sequence freed before its step is laid out leaves no unwritten block in the cache;
* once every sequence is freed and the cache reset, every block is free.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import assume, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from spec.batch import build_batch
from spec.block_manager import BlockManager, cdiv
from spec.errors import (
    DoubleFreeError,
    DuplicateSequenceError,
    InvalidRequestError,
    OutOfBlocksError,
    UnknownBlockError,
    UnknownSequenceError,
)
from spec.kv_memory import KVMemory

VOCAB = st.integers(0, 2)  # a tiny vocabulary, so prompts share prefixes often


def token_kv(prefix: tuple[int, ...]) -> np.ndarray:
    """The KV of the last token of ``prefix``: a function of everything before it."""
    digest = hashlib.sha256(repr(prefix).encode()).digest()
    return np.array([[int.from_bytes(digest[i : i + 6], "little") / 2**48 for i in (0, 6)]])


def snapshot(m: BlockManager) -> tuple[object, ...]:
    seqs = tuple((s, m.block_table(s), m.tokens(s)) for s in sorted(m.sequence_ids()))
    blocks = tuple((m.pool.ref_count(b), m.pool.block_hash(b)) for b in range(m.pool.num_blocks))
    stats = (m.prefix_stats.queried_tokens, m.prefix_stats.hit_tokens)
    return (seqs, blocks, m.pool.num_free, m.pool.num_cached, stats, m.pending_copies())


class BlockManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 3, 4, 16]),
        prefix_caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.m = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.mem = KVMemory(1, num_blocks, block_size, num_kv_heads=1, head_dim=2)
        self.next_id = 0
        self.freed: list[int] = []
        self.histories: list[tuple[int, ...]] = []  # tokens of freed sequences: prompts to hit

    # -- helpers ------------------------------------------------------------

    def _write(self, seq_id: int, slots: list[int]) -> None:
        """Execute pending copies, then write the new tokens' KV through their slots."""
        self.mem.copy_blocks(self.m.take_copies())
        tokens = self.m.tokens(seq_id)
        start = len(tokens) - len(slots)
        kv = np.stack([token_kv(tokens[: p + 1]) for p in range(start, len(tokens))])
        self.mem.write(0, kv, kv, slots)

    def _expect_unchanged(self, before: tuple[object, ...]) -> None:
        assert snapshot(self.m) == before, "a failed operation changed state"

    # -- rules ----------------------------------------------------------------

    @rule(target=seqs, prompt=st.lists(VOCAB, min_size=1, max_size=40), data=st.data())
    def add(self, prompt: list[int], data: st.DataObject) -> int:
        if data.draw(st.booleans()) and self.histories:  # extend a sequence seen before
            prompt = [*data.draw(st.sampled_from(self.histories)), *prompt[:3]]
        seq_id, self.next_id = self.next_id, self.next_id + 1
        predicted = self.m.cached_prefix(prompt)
        cached = self.m.add_sequence(seq_id, prompt)
        assert cached == predicted
        assert cached % self.m.block_size == 0 and cached < len(prompt)
        if not self.m.enable_prefix_caching:
            assert cached == 0
        before = snapshot(self.m)
        try:
            slots = self.m.append_slots(seq_id, prompt[cached:])
        except OutOfBlocksError:
            self._expect_unchanged(before)
            self.m.free(seq_id)
            self.freed.append(seq_id)
            return seq_id
        self._write(seq_id, slots)
        return seq_id

    @rule(seq=seqs, new=st.lists(VOCAB, min_size=1, max_size=20))
    def append(self, seq: int, new: list[int]) -> None:
        assume(seq in self.m)
        before = snapshot(self.m)
        needed = self.m.blocks_needed(seq, len(new))
        try:
            slots = self.m.append_slots(seq, new)
        except OutOfBlocksError:
            assert needed > self.m.pool.num_available
            self._expect_unchanged(before)
            return
        assert len(slots) == len(new)
        self._write(seq, slots)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One scheduler-like step: several sequences grow, then one batch is built."""
        live = sorted(self.m.sequence_ids())
        assume(live)
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
        scheduled = []
        for seq in chosen:
            new = data.draw(st.lists(VOCAB, min_size=1, max_size=5))
            if not self.m.can_append(seq, len(new)):
                continue
            self.m.append_slots(seq, new)
            scheduled.append((seq, len(new)))
        assume(scheduled)
        batch = build_batch(self.m, scheduled)
        srcs = {s for s, _ in batch.copies}
        assert not srcs & {d for _, d in batch.copies}, "a block is both src and dst"
        self.mem.copy_blocks(batch.copies)
        for i, seq in enumerate(batch.seq_ids):
            tokens = self.m.tokens(seq)
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            assert list(batch.positions[start:end]) == list(
                range(len(tokens) - (end - start), len(tokens))
            )
            assert batch.seq_lens[i] == len(tokens)
            kv = np.stack([token_kv(tokens[: p + 1]) for p in batch.positions[start:end]])
            self.mem.write(0, kv, kv, batch.slot_mapping[start:end])

    @rule(target=seqs, parent=seqs)
    def fork(self, parent: int) -> int:
        assume(parent in self.m)
        child, self.next_id = self.next_id, self.next_id + 1
        held = self.m.pool.num_held
        self.m.fork(parent, child)
        assert self.m.pool.num_held == held, "a fork allocates nothing"
        assert self.m.block_table(child) == self.m.block_table(parent)
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq: int) -> None:
        assume(seq in self.m)
        self.histories.append(self.m.tokens(seq))
        self.m.free(seq)
        self.freed.append(seq)

    @rule(seq=consumes(seqs), new=st.lists(VOCAB, min_size=1, max_size=20))
    def abandon(self, seq: int, new: list[int]) -> None:
        """Append tokens, then free the sequence before its step is laid out (an abort).

        Their KV is never written: a block they filled must not stay findable in the cache.
        """
        assume(seq in self.m)
        if self.m.can_append(seq, len(new)):
            self.m.append_slots(seq, new)
        self.histories.append(self.m.tokens(seq))
        self.m.free(seq)
        self.freed.append(seq)

    @rule()
    def reset_cache(self) -> None:
        self.m.reset_prefix_cache()
        assert self.m.pool.num_cached == 0

    # -- invalid operations: the specific error, and nothing changes -----------

    @precondition(lambda self: bool(self.freed))
    @rule(data=st.data())
    def invalid_on_freed_sequence(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.freed))
        before = snapshot(self.m)
        with pytest.raises(UnknownSequenceError):
            self.m.free(seq)
        with pytest.raises(UnknownSequenceError):
            self.m.fork(seq, self.next_id)
        with pytest.raises(UnknownSequenceError):
            self.m.append_slots(seq, [0])
        self._expect_unchanged(before)

    @rule(seq=seqs)
    def invalid_duplicate_ids(self, seq: int) -> None:
        assume(seq in self.m)
        before = snapshot(self.m)
        with pytest.raises(DuplicateSequenceError):
            self.m.add_sequence(seq, [0])
        others = [s for s in self.m.sequence_ids() if s != seq]
        if others:
            with pytest.raises(DuplicateSequenceError):
                self.m.fork(seq, others[0])
        with pytest.raises(InvalidRequestError):
            self.m.slot(seq, self.m.num_tokens(seq))
        self._expect_unchanged(before)

    @rule(block=st.integers(-3, 40))
    def invalid_block_ops(self, block: int) -> None:
        before = snapshot(self.m)
        if not 0 <= block < self.m.pool.num_blocks:
            with pytest.raises(UnknownBlockError):
                self.m.pool.decref(block)
        elif self.m.pool.ref_count(block) == 0:
            with pytest.raises(DoubleFreeError):
                self.m.pool.decref(block)
        self._expect_unchanged(before)

    # -- invariants -----------------------------------------------------------

    @invariant()
    def tables_and_pool_are_consistent(self) -> None:
        self.m.check_integrity()
        for seq in self.m.sequence_ids():
            t = self.m.num_tokens(seq)
            assert len(self.m.block_table(seq)) == cdiv(t, self.m.block_size)
            assert 0 <= self.m.tail_waste(seq) <= self.m.block_size - 1

    @invariant()
    def gather_returns_each_sequences_own_tokens(self) -> None:
        for seq in self.m.sequence_ids():
            tokens = self.m.tokens(seq)
            k, v = self.mem.gather(0, self.m.block_table(seq), len(tokens))
            for p in range(len(tokens)):
                expected = token_kv(tokens[: p + 1])
                assert np.array_equal(k[p], expected), f"sequence {seq}, token {p}: K differs"
                assert np.array_equal(v[p], expected), f"sequence {seq}, token {p}: V differs"

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for seq in self.m.sequence_ids():
            self.m.free(seq)
        self.m.reset_prefix_cache()
        note(f"pool after teardown: {self.m.pool.num_free} free")
        assert self.m.pool.num_free == self.m.pool.num_blocks, "blocks leaked"
        self.m.check_integrity()


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(
    max_examples=max(300, settings().max_examples), stateful_step_count=30
)
