"""Speculative decoding in the spec: a Hypothesis state machine over the memory side.

The machine drives a :class:`~spec.cache_manager.CacheManager` (one full-attention
group with prefix caching, or a sliding window beside it, or a fixed-size state group)
through admissions, plain decodes, drafts of ``k`` tokens, steps, verification of a
drawn ``a``, rollbacks (before and after the step ran), forks, frees, preemption by
swap and by recompute, swap-ins, and invalid calls. It plays the engine too: each
step executes the copies, writes every new token's KV and advances the state, in a
model where a slot's content is the very token prefix it was computed from.

After every rule:

* the integrity check holds (no block lost or double-owned, refcounts equal holders,
  no block holding a draft or a partly filled block has a prefix-cache hash, a window
  released nothing a query at the verified length needs);
* every laid-out token's slot, in every paged group, holds the KV of its own prefix
  (so rejected K/V never survives in a slot a verified token reads);
* every block the prefix cache can serve holds, slot for slot, the KV of a prefix
  that was verified (never one with a rejected draft);
* a step reads each state from a slot that holds exactly the state after the
  sequence's tokens before the step, and after verification the sequence's slot
  holds the state after its verified tokens; after a rollback, the slot its state
  is in right now (``StateManager.source``: its own, or while a fork's copy into
  it is pending, the copy's source) holds the state after the tokens it consumed.

An invalid call raises its specific error, naming the argument, and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from spec.block_manager import PAD_BLOCK, PAD_SLOT, BlockManager
from spec.cache_manager import CacheManager
from spec.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    OutOfBlocksError,
    SpecError,
    SpeculationError,
    StepBoundaryError,
)
from spec.kv_groups import FIXED_STATE, FULL_ATTENTION, sliding_window
from spec.prefix_cache import prompt_block_hashes
from spec.speculative import accepted_prefix
from spec.swap import SwapIn, SwapOut

VOCAB = st.integers(0, 2)  # a tiny vocabulary: drafts often equal later verified tokens
Prefix = tuple[int, ...]
NOT_AN_INT: Any = 1.0


class SpeculativeMachine(RuleBasedStateMachine):
    """The memory side under speculation, with an engine that writes what each step computes."""

    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4]),
        kind=st.sampled_from(["full", "window", "state"]),
        window=st.integers(1, 6),
        num_blocks=st.integers(6, 16),
    )
    def setup(self, block_size: int, kind: str, window: int, num_blocks: int) -> None:
        self.build(block_size, kind, window, num_blocks)
        note(f"B={block_size} groups={[g.name for g in self.cache.groups]} blocks={num_blocks}")

    def build(self, block_size: int, kind: str, window: int, num_blocks: int) -> None:
        groups = {
            "full": (FULL_ATTENTION,),
            "window": (FULL_ATTENTION, sliding_window(window)),
            "state": (FULL_ATTENTION, FIXED_STATE),
        }[kind]
        self.b = block_size
        self.cache = CacheManager(
            num_blocks,
            block_size,
            num_host_blocks=num_blocks,
            enable_prefix_caching=kind != "state",
            groups=groups,
            num_state_slots=8,
            num_host_state_slots=4,
        )
        self.num_paged = len(self.cache.managers)
        self.kv: list[dict[int, Prefix]] = [{} for _ in range(self.num_paged)]  # slot -> prefix
        self.host: dict[int, list[list[Prefix | None]]] = {}  # host block -> layer -> offset
        self.state: dict[int, Prefix] = {}  # state slot -> the prefix it has consumed
        self.host_state: dict[int, Prefix] = {}
        self.tokens: dict[int, list[int]] = {}  # swapped-out sequences' tokens
        self.verified: list[dict[bytes, Prefix]] = [{} for _ in range(self.num_paged)]
        self.next_id = 0

    # -- helpers ------------------------------------------------------------------------

    @property
    def m(self) -> BlockManager:
        return self.cache.manager

    def running(self) -> list[int]:
        return sorted(self.m.sequence_ids())

    def laid_out(self, s: int) -> bool:
        return self.m.num_uncommitted(s) == 0

    def snapshot(self) -> Any:
        c = self.cache
        seqs = {
            s: (
                tuple(m.tokens(s) for m in c.managers),
                tuple(m.block_table(s) for m in c.managers),
                self.m.num_drafts(s),
                self.m.num_uncommitted(s),
                None if c.state is None else (c.state.slot(s), c.state.lookahead(s)),
            )
            for s in self.running()
        }
        pool = c.pool
        hashes = tuple(pool.block_hash(x) for x in range(pool.num_blocks))
        copies = tuple(pair for m in c.managers for pair in m.pending_copies())
        return seqs, pool.num_free, pool.num_cached, hashes, copies

    def refused(self, call: Callable[[], object], error: type[SpecError], name: str) -> None:
        before = self.snapshot()
        with pytest.raises(error) as info:
            call()
        assert name in str(info.value), f"{info.value} does not name {name}"
        assert self.snapshot() == before, "a refused call changed the state"

    def next_seq(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    # -- rules: sequences come and go -----------------------------------------------------

    @precondition(lambda self: all(self.laid_out(s) for s in self.running()))
    @rule(prompt=st.lists(VOCAB, min_size=1, max_size=9))
    def admit(self, prompt: list[int]) -> None:
        """Between steps only: a prefix hit then shares only blocks whose KV is written."""
        if not self.cache.can_admit(prompt, chunk_limit=len(prompt)):
            return
        self.cache.admit(self.next_seq(), prompt, chunk_limit=len(prompt))

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.cache.release(data.draw(st.sampled_from(self.running())))

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.running()))
        child = self.next_seq()
        if self.m.num_drafts(parent):
            self.refused(lambda: self.cache.fork(parent, child), SpeculationError, "parent_id")
        elif not self.laid_out(parent):
            self.refused(lambda: self.cache.fork(parent, child), StepBoundaryError, "parent_id")
        elif self.cache.can_fork(parent):
            self.cache.fork(parent, child)

    # -- rules: growth, drafts, the step ---------------------------------------------------

    def growable(self) -> list[int]:
        return [s for s in self.running() if self.laid_out(s) and not self.m.num_drafts(s)]

    @precondition(lambda self: self.growable())
    @rule(data=st.data(), token=VOCAB)
    def decode(self, data: st.DataObject, token: int) -> None:
        s = data.draw(st.sampled_from(self.growable()))
        if self.cache.can_grow(s, 1):
            self.cache.grow(s, [token])

    @precondition(lambda self: self.growable())
    @rule(data=st.data(), tokens=st.lists(VOCAB, min_size=2, max_size=6))
    def draft(self, data: st.DataObject, tokens: list[int]) -> None:
        """The last verified token and ``k = len(tokens) - 1`` drafts: lookahead slots."""
        s = data.draw(st.sampled_from(self.growable()))
        k = len(tokens) - 1
        if not self.cache.can_grow(s, 1 + k, num_draft=k):
            self.refused(lambda: self.cache.grow(s, tokens, num_draft=k), OutOfBlocksError, "")
            return
        held = self.cache.pool.num_held
        need = sum(m.blocks_needed(s, 1 + k) - m.blocks_reclaimed(s) for m in self.cache.managers)
        slots = self.cache.grow(s, tokens, num_draft=k)
        assert len(slots) == 1 + k and PAD_SLOT not in slots
        assert self.cache.pool.num_held - held == need, "the lookahead took uncounted blocks"
        assert self.m.num_drafts(s) == k

    @precondition(lambda self: any(not self.laid_out(s) for s in self.running()))
    @rule()
    def step(self) -> None:
        """Lay out every pending token and execute the step as an engine would."""
        rows = [(s, self.m.num_uncommitted(s)) for s in self.running() if not self.laid_out(s)]
        batch = self.cache.layout(rows)
        batch.validate(self.cache.pool.num_blocks)
        for src, dst in batch.copies:
            for kv in self.kv:
                for off in range(self.b):
                    if src * self.b + off in kv:
                        kv[dst * self.b + off] = kv[src * self.b + off]
        if batch.state is not None:
            for src, dst in batch.state.copies:
                self.state[dst] = self.state[src]
        for i, s in enumerate(batch.seq_ids):
            tokens = self.m.tokens(s)
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            for g, kv in enumerate(self.kv):
                for j in range(start, end):
                    p = batch.positions[j]
                    kv[batch.slots(g)[j]] = tuple(tokens[: p + 1])
            if batch.state is not None:
                self._advance_state(batch.state, i, tokens, batch.seq_lens[i], end - start)

    def _advance_state(self, layout: Any, i: int, tokens: tuple[int, ...], n: int, q: int) -> None:
        slot = layout.slots[i]
        read = () if n == q else self.state.get(slot)  # position 0 starts from an empty state
        assert read == tokens[: n - q], (
            f"row {i} reads state {read}, not the state after {tokens[: n - q]}"
        )
        ahead = layout.lookahead[i] if layout.lookahead else ()
        if not ahead:
            self.state[slot] = tokens[:n]
            return
        k = len(ahead) - 1
        for j, x in enumerate(ahead):  # the checkpoint stays; the states after 1 + j tokens
            self.state[x] = tokens[: n - k + j]

    @precondition(lambda self: any(self.m.num_drafts(s) for s in self.running()))
    @rule(data=st.data())
    def verify(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from([s for s in self.running() if self.m.num_drafts(s)]))
        k = self.m.num_drafts(s)
        if not self.laid_out(s):
            self.refused(lambda: self.cache.verify(s, 0), StepBoundaryError, "seq_id")
            return
        a = data.draw(st.integers(0, k))
        n = self.m.num_tokens(s)
        self.cache.verify(s, a)
        assert self.m.num_tokens(s) == n - k + a and not self.m.num_drafts(s)
        self.refused(lambda: self.cache.verify(s, 0), SpeculationError, "seq_id")  # twice
        if self.cache.state is not None:
            assert self.state[self.cache.state.slot(s)] == self.m.tokens(s)

    @precondition(lambda self: any(self.m.num_drafts(s) for s in self.running()))
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        self.roll_back(
            data.draw(st.sampled_from([s for s in self.running() if self.m.num_drafts(s)]))
        )

    def roll_back(self, s: int) -> None:
        """Reject every draft of ``s``; its state is then the one after the tokens it consumed."""
        ran, n, k = self.laid_out(s), self.m.num_tokens(s), self.m.num_drafts(s)
        rejected = self.cache.rollback(s)
        assert len(rejected) == k and self.m.num_tokens(s) == n - k
        self.refused(lambda: self.cache.rollback(s), SpeculationError, "seq_id")
        if self.cache.state is not None:
            consumed = self.m.tokens(s)[: self.m.num_tokens(s) - self.m.num_uncommitted(s)]
            assert ran == (consumed == self.m.tokens(s))
            # a child forked since the last step: its state is still the pending copy's source
            assert self.state.get(self.cache.state.source(s)) == consumed

    # -- rules: preemption -----------------------------------------------------------------

    @precondition(lambda self: any(self.laid_out(s) for s in self.running()))
    @rule(data=st.data(), swap=st.booleans())
    def preempt(self, data: st.DataObject, swap: bool) -> None:
        s = data.draw(st.sampled_from([s for s in self.running() if self.laid_out(s)]))
        swap = swap and self.cache.can_swap_out(s)
        k = self.m.num_drafts(s)
        tokens = list(self.m.tokens(s)[: self.m.num_tokens(s) - k])
        out = self.cache.preempt(s, swap=swap)
        if out is None:
            return
        assert out.num_tokens == len(tokens), "a swap moved drafts"
        self._swap_out(out)
        self.tokens[s] = tokens

    def _swap_out(self, out: SwapOut) -> None:
        for d, h in zip(out.device_blocks, out.host_blocks, strict=True):
            self.host[h] = [[kv.get(d * self.b + off) for off in range(self.b)] for kv in self.kv]
        if out.state is not None:
            self.host_state[out.state[1]] = self.state[out.state[0]]

    @precondition(lambda self: self.cache.swapped_ids())
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.cache.swapped_ids())))
        if not self.cache.can_swap_in(s, 0):
            return
        back = self.cache.swap_in(s, self.tokens.pop(s), 0)
        self._swap_in(back)

    def _swap_in(self, back: SwapIn) -> None:
        for i, slot in enumerate(back.slots):
            if slot != PAD_SLOT:
                values = self.host[back.host_blocks[i // self.b]]
                for g, kv in enumerate(self.kv):
                    value = values[g][i % self.b]
                    if value is not None:
                        kv[slot] = value
        if back.state is not None:
            self.state[back.state[1]] = self.host_state[back.state[0]]

    # -- rules: bad input ------------------------------------------------------------------

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def invalid_call(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self.running()))
        k = self.m.num_drafts(s)
        calls: list[tuple[Callable[[], object], type[SpecError], str]] = [
            (lambda: self.cache.grow(s, [0, 0], num_draft=-1), ArgumentValueError, "num_draft"),
            (lambda: self.cache.grow(s, [0], num_draft=True), ArgumentTypeError, "num_draft"),
            (lambda: self.cache.verify(s, NOT_AN_INT), ArgumentTypeError, "num_accepted"),
        ]
        if k and self.laid_out(s):
            calls.append((lambda: self.cache.verify(s, k + 1), ArgumentValueError, "num_accepted"))
            calls.append((lambda: self.cache.verify(s, -1), ArgumentValueError, "num_accepted"))
        if k:
            calls.append((lambda: self.cache.grow(s, [0, 0], num_draft=1), SpeculationError, ""))
        else:
            calls.append((lambda: self.cache.verify(s, 0), SpeculationError, "seq_id"))
            calls.append((lambda: self.cache.rollback(s), SpeculationError, "seq_id"))
            calls.append((lambda: self.cache.grow(s, [0, 0], num_draft=2), ArgumentValueError, ""))
        call, error, name = data.draw(st.sampled_from(calls))
        self.refused(call, error, name)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_integrity()

    @invariant()
    def every_laid_out_token_holds_its_kv(self) -> None:
        if not hasattr(self, "cache") or any(not self.laid_out(s) for s in self.running()):
            return  # a prefix hit may share a block whose KV this very step writes
        for g, m in enumerate(self.cache.managers):
            for s in m.sequence_ids():
                tokens, table = m.tokens(s), m.block_table(s)
                for p in range(m.num_tokens(s) - m.num_uncommitted(s)):
                    if table[p // self.b] == PAD_BLOCK:
                        continue  # released by the window: no query reads it
                    slot = table[p // self.b] * self.b + p % self.b
                    assert self.kv[g].get(slot) == tokens[: p + 1], (
                        f"group {g} sequence {s} position {p}: slot {slot} holds "
                        f"{self.kv[g].get(slot)}, not the KV of {tokens[: p + 1]}"
                    )

    @invariant()
    def the_prefix_cache_serves_only_verified_prefixes(self) -> None:
        if not hasattr(self, "cache") or self.cache.state is not None:
            return
        # Verified prefixes are recorded after every rule, mid-step too: one verified while
        # another sequence awaits its step, then freed, stays cached after its sequence ends.
        for g, m in enumerate(self.cache.managers):
            keys = () if self.num_paged == 1 else (("kv cache group", g),)
            for s in m.sequence_ids():
                verified = m.tokens(s)[: m.num_tokens(s) - m.num_drafts(s)]
                for i, h in enumerate(prompt_block_hashes(verified, self.b, keys)):
                    self.verified[g][h] = verified[: (i + 1) * self.b]
        if any(not self.laid_out(s) for s in self.running()):
            return  # a block is named when its tokens have slots; its KV comes with the step
        pool = self.cache.pool
        for block in range(pool.num_blocks):
            name = pool.block_hash(block)
            if name is None:
                continue
            owner = [g for g in range(self.num_paged) if name in self.verified[g]]
            assert owner, f"block {block} has a hash of no verified prefix"
            prefix = self.verified[owner[0]][name]
            for off in range(self.b):
                p = len(prefix) - self.b + off
                got = self.kv[owner[0]].get(block * self.b + off)
                assert got == prefix[: p + 1], (
                    f"cached block {block} slot {off}: {got}, not the KV of {prefix[: p + 1]}"
                )


SpeculativeMachine.TestCase.settings = settings(
    settings(), max_examples=max(15, settings().max_examples // 2), stateful_step_count=40
)
test_speculative_rules = SpeculativeMachine.TestCase


# -- worked cases -----------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_lookahead_counts_every_block_the_step_touches(block_size: int) -> None:
    """For every offset in the last block and every k, the allocation is exactly the blocks
    positions ``t - 1 .. t - 1 + k`` newly need: a one-token allocation under-counts."""
    for t in range(1, 2 * block_size + 2):
        for k in range(0, 2 * block_size + 1):
            m = BlockManager(num_blocks=64, block_size=block_size)
            m.add_sequence(0, [])
            m.append_slots(0, [0] * (t - 1))
            m.take_copies()
            need = -(-(t + k) // block_size) - -(-(t - 1) // block_size)
            assert m.blocks_needed(0, 1 + k) == need
            free = m.pool.num_free
            m.append_slots(0, [0] * (1 + k), num_draft=k)
            assert free - m.pool.num_free == need


def test_copy_on_write_of_a_shared_last_block_is_counted() -> None:
    m = BlockManager(num_blocks=6, block_size=4)
    m.add_sequence(0, [])
    m.append_slots(0, [1, 2, 3, 4, 5])
    m.take_copies()
    m.fork(0, 1)
    assert m.blocks_needed(1, 1 + 3) == 1 + 1  # the copy of block 1, and block 2 for two drafts
    m.append_slots(1, [6, 7, 8, 9], num_draft=3)
    assert m.take_copies() == [(1, 2)] and m.block_table(0) == (0, 1)


def test_a_tight_pool_refuses_the_lookahead_whole() -> None:
    """One block free, a draft of 4 after 3 tokens needs 2: refused, nothing taken."""
    m = BlockManager(num_blocks=2, block_size=2)
    m.add_sequence(0, [])
    m.append_slots(0, [1, 2])
    m.take_copies()
    assert not m.can_append(0, 4)
    with pytest.raises(OutOfBlocksError):
        m.append_slots(0, [3, 4, 5, 6], num_draft=3)
    assert m.tokens(0) == (1, 2) and m.pool.num_free == 1 and m.num_drafts(0) == 0


def test_a_window_releases_by_verified_length_never_by_drafts() -> None:
    """Window 2, B 1: 5 tokens, then token 5 and drafts at 6, 7, 8. Once the step ran, the
    earliest query still to run is at 6 (the first draft): it sees 5 and 6, so only block 4
    may go, not the 4 blocks that the drafted length 9 would release."""
    m = BlockManager(num_blocks=16, block_size=1, window=2)
    m.add_sequence(0, [])
    m.append_slots(0, [0] * 5)
    m.take_copies()
    m.append_slots(0, [1, 2, 3, 4], num_draft=3)
    m.take_copies()  # laid out: 9 tokens written
    assert m.blocks_reclaimed(0) == 1
    m.rollback(0)
    assert m.release_expired(0) == 1
    assert m.block_table(0)[:5] == (PAD_BLOCK,) * 5 and len(m.held_blocks(0)) == 1


def test_a_rollback_reaching_into_a_block_leaves_it_unnamed_and_a_hit_gets_only_verified() -> None:
    m = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    m.add_sequence(0, [1, 2])
    m.append_slots(0, [1, 2])
    m.take_copies()
    m.append_slots(0, [3, 4, 5], num_draft=2)  # token 3, drafts 4, 5: blocks (3, 4) and (5)
    m.take_copies()
    assert m.cached_prefix([1, 2, 3, 4, 5, 0]) == 2  # only the verified block is named
    m.verify(0, 1)  # 4 tokens: the block (3, 4) is full of verified tokens now
    assert m.cached_prefix([1, 2, 3, 4, 5, 0]) == 4
    assert m.cached_prefix([1, 2, 3, 5, 9]) == 2


def test_accepted_prefix_gives_greedy_output() -> None:
    assert accepted_prefix([], [3]) == (0, (3,))
    assert accepted_prefix([1, 2], [0, 2, 2]) == (0, (0,))


@pytest.mark.parametrize("kind", ["state", "window"])
def test_machine_runs_each_kind(kind: str) -> None:
    """A fixed walk through every rule, for each group kind: drafts are verified and rolled back."""
    machine = SpeculativeMachine()
    machine.build(block_size=2, kind=kind, window=3, num_blocks=12)
    machine.cache.admit(machine.next_seq(), [1, 2, 0], chunk_limit=3)
    machine.step()
    machine.cache.grow(0, [1, 1, 2], num_draft=2)
    machine.step()
    machine.cache.verify(0, 1)
    machine.cache.grow(0, [0, 2], num_draft=1)
    machine.cache.rollback(0)  # before the step ran: the last verified token is still to compute
    machine.step()
    machine.cache.grow(0, [2, 2, 2], num_draft=2)
    machine.step()
    machine.cache.rollback(0)  # after it ran: the state after the verified token is kept
    machine.integrity()
    machine.every_laid_out_token_holds_its_kv()
    if machine.cache.state is not None:
        assert machine.state[machine.cache.state.slot(0)] == machine.m.tokens(0)


def test_a_fork_mid_step_or_mid_speculation_is_refused_before_the_state_pool_is_asked() -> None:
    """A misuse names ``parent_id`` even when the state pool is full, and changes nothing:
    mid-step (the parent's token is not laid out), then mid-speculation (its lookahead
    state slots are what fills the pool)."""
    cache = CacheManager(6, 1, groups=(FULL_ATTENTION, FIXED_STATE), num_state_slots=3)
    state = cache.state
    assert state is not None

    def refused(error: type[SpecError]) -> None:
        before = cache.pool.num_held, cache.manager.tokens(0), state.pool.num_free
        with pytest.raises(error, match="parent_id"):
            cache.fork(0, 3)
        assert (cache.pool.num_held, cache.manager.tokens(0), state.pool.num_free) == before
        assert not cache.holds(3) and state.pending_copies() == ()
        cache.check_integrity()

    cache.admit(0, [0], chunk_limit=1)
    cache.layout([(0, 1)])
    cache.admit(1, [0], chunk_limit=1)
    cache.admit(2, [0], chunk_limit=1)
    cache.grow(0, [1])  # mid-step, and every state slot is held
    assert state.pool.num_free == 0
    refused(StepBoundaryError)
    cache.release(1)
    cache.release(2)
    cache.layout([(0, 1)])
    cache.grow(0, [1, 2], num_draft=1)  # the checkpoint and 2 lookahead slots fill the pool
    assert state.pool.num_free == 0
    refused(SpeculationError)


def test_a_rollback_before_the_step_leaves_a_forked_child_state_in_the_copy_source() -> None:
    """A child forked and drafting before any step has run: its slot awaits the fork's copy,
    so after a rollback its state (the parent's) is in the copy's source, and the next step
    copies it in before reading the checkpoint."""
    machine = SpeculativeMachine()
    machine.build(block_size=1, kind="state", window=6, num_blocks=6)
    machine.cache.admit(machine.next_seq(), [0], chunk_limit=1)
    machine.step()
    machine.cache.fork(0, machine.next_seq())
    machine.cache.grow(1, [1, 0], num_draft=1)
    machine.roll_back(1)
    state = machine.cache.state
    assert state is not None and state.source(1) == state.slot(0) != state.slot(1)
    assert state.pending_copies() == ((state.slot(0), state.slot(1)),)
    machine.step()  # reads the checkpoint after the copy: the state after (0,)
    assert machine.state[state.slot(1)] == machine.m.tokens(1) == (0, 1)


def test_a_prefix_verified_while_another_sequence_awaits_its_step_stays_known_when_freed() -> None:
    """Sequence 0 verifies its draft while sequence 1 awaits its first step, then finishes:
    its last block stays cached, named for a verified prefix the model must have recorded."""
    machine = SpeculativeMachine()
    machine.build(block_size=1, kind="full", window=1, num_blocks=6)
    machine.cache.admit(machine.next_seq(), [0], chunk_limit=1)
    machine.step()
    machine.cache.grow(0, [0, 0], num_draft=1)
    machine.step()
    machine.cache.admit(machine.next_seq(), [0], chunk_limit=1)
    machine.cache.verify(0, 1)
    machine.the_prefix_cache_serves_only_verified_prefixes()  # sequence 1 is not laid out
    machine.cache.release(0)
    machine.step()
    assert machine.cache.pool.num_cached == 3  # the KV of (0,), (0, 0) and (0, 0, 0)
    machine.the_prefix_cache_serves_only_verified_prefixes()
