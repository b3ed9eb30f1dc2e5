"""KV cache groups behind the memory side: stateful properties, with the KV and state checked.

A Hypothesis state machine drives a :class:`CacheManager` whose model has a
full-attention group, one or two sliding-window groups and maybe a
fixed-size state group, through admissions (with prefix hits), growth (with
copy-on-write after forks), steps, forks, preemption by recompute and by
swap, swap-ins and releases at any moment (mid-step too). Every command is
asked first; it must succeed exactly when its query said yes, and a refused
command must change nothing in any group. After every rule:

* the shared pool's counts match every group's tables, every group holds the
  same sequences, each with exactly one state slot (``check_integrity``);
* a windowed sequence holds at most ``cdiv(w + q - 2, B) + 1`` blocks, where
  ``q`` is what it appended since its last step, so ``ceil(w / B) + 1`` when
  it decodes (pending copies pin their sources outside the tables);
* every held position of every group holds that group's KV of that token
  (each token's KV is a function of its group and its whole prefix, so a hit,
  a fork, a copy, a swap or a release that serves the wrong block is caught),
  and every state slot holds the state of exactly the tokens before the
  sequence's next query;
* at the end, with everything released, every block and slot is back.
"""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from spec.batch import BatchMetadata
from spec.cache_manager import FIXED_STATE, FULL_ATTENTION, CacheManager, sliding_window
from spec.errors import OutOfBlocksError, StepBoundaryError
from spec.kv_budget import cdiv
from spec.kv_memory import KVMemory
from spec.swap import SwapIn, SwapOut

VOCAB = st.integers(0, 1)  # prompts share prefixes often


def token_kv(group: int, prefix: tuple[int, ...]) -> np.ndarray:
    """Group ``group``'s KV of the last token of ``prefix``: [1 head, 2]."""
    digest = hashlib.sha256(repr((group, prefix)).encode()).digest()
    return np.array([[int.from_bytes(digest[i : i + 6], "little") / 2**48 for i in (0, 6)]])


def snapshot(c: CacheManager) -> object:
    groups = tuple(
        tuple((s, m.block_table(s), m.tokens(s)) for s in sorted(m.sequence_ids()))
        for m in c.managers
    )
    pool = c.pool
    blocks = tuple((pool.ref_count(b), pool.block_hash(b)) for b in range(pool.num_blocks))
    state = None
    if c.state is not None:
        slots = {s: c.state.slot(s) for s in c.state.sequence_ids()}
        state = (slots, c.state.pending_copies(), c.state.pool.num_free)
    host = {s: c.host_blocks(s) for s in c.swapped_ids()}
    copies = tuple(m.pending_copies() for m in c.managers)
    return groups, blocks, state, host, copies, c.host.num_free


class GroupsMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.sampled_from([1, 2, 4]),
        windows=st.lists(st.integers(1, 9), min_size=1, max_size=2),
        state_slots=st.none() | st.integers(1, 4),
        host_blocks=st.integers(0, 30),
        host_state_slots=st.integers(0, 4),
        caching=st.booleans(),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        windows: list[int],
        state_slots: int | None,
        host_blocks: int,
        host_state_slots: int,
        caching: bool,
    ) -> None:
        groups = [FULL_ATTENTION, *(sliding_window(w) for w in windows)]
        if state_slots is not None:
            groups.append(FIXED_STATE)
        self.c = CacheManager(
            num_blocks,
            block_size,
            num_host_blocks=host_blocks,
            enable_prefix_caching=caching,
            groups=groups,
            num_state_slots=state_slots or 0,
            num_host_state_slots=host_state_slots,
        )
        self.b = block_size
        self.windows = [None, *windows]
        self.mem = KVMemory(len(self.windows), num_blocks, block_size, num_kv_heads=1, head_dim=2)
        self.host_kv: dict[int, np.ndarray] = {}  # host block -> [layers, 2, B, 1, 2]
        self.states: dict[int, tuple[int, ...]] = {}  # state slot -> the tokens it summarises
        self.host_states: dict[int, tuple[int, ...]] = {}
        self.tokens: dict[int, list[int]] = {}  # device or host sequences' tokens (with slots)
        self.swapped: dict[int, int] = {}  # seq -> tokens swapped out
        self.q: dict[int, int] = {}  # tokens appended since the sequence's last step
        self.history: list[tuple[int, ...]] = []
        self.next_id = 0
        self.hit_this_step = False  # a hit may be on a block this step is still to write

    # -- helpers ----------------------------------------------------------------

    def attempt(self, predicted: bool, command: object, *args: object) -> bool:
        """Run ``command``: it must succeed iff ``predicted``, and change nothing when it fails."""
        before = snapshot(self.c)
        try:
            self.result = command(*args)  # type: ignore[operator]
        except OutOfBlocksError:
            assert not predicted, "the query said yes, the command failed"
            assert snapshot(self.c) == before, "a refused command changed a group"
            return False
        assert predicted, "the query said no, the command succeeded"
        return True

    def device(self) -> list[int]:
        return sorted(self.c.manager.sequence_ids())

    def fresh(self, data: st.DataObject, n: int) -> list[int]:
        return data.draw(st.lists(VOCAB, min_size=n, max_size=n), label="tokens")

    # -- rules ------------------------------------------------------------------

    @rule(data=st.data(), chunk=st.integers(1, 4), reuse=st.booleans())
    def admit(self, data: st.DataObject, chunk: int, reuse: bool) -> None:
        if reuse and self.history:
            old = data.draw(st.sampled_from(self.history), label="earlier prompt")
            prompt = list(old) + self.fresh(data, data.draw(st.integers(0, 3)))
        else:
            prompt = self.fresh(data, data.draw(st.integers(1, 8), label="prompt length"))
        if not prompt:
            return
        seq, self.next_id = self.next_id, self.next_id + 1
        cached = self.c.cached_tokens(prompt)
        if self.attempt(self.c.can_admit(prompt, chunk), self.c.admit, seq, prompt, chunk):
            n = cached + min(len(prompt) - cached, chunk)
            self.tokens[seq] = prompt[:n]
            self.q[seq] = n - cached
            note(f"admit {seq}: {len(prompt)} tokens, {cached} cached, {n - cached} new")
            self.hit_this_step |= cached > 0

    @precondition(lambda self: self.c.manager.sequence_ids())
    @rule(data=st.data(), k=st.integers(1, 4))
    def grow(self, data: st.DataObject, k: int) -> None:
        seq = data.draw(st.sampled_from(self.device()), label="seq")
        new = self.fresh(data, k)
        if self.attempt(self.c.can_grow(seq, k), self.c.grow, seq, new):
            self.tokens[seq] += new
            self.q[seq] = self.c.manager.num_uncommitted(seq)

    @precondition(lambda self: self.c.manager.sequence_ids())
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        """Each sequence laid out already gets one more token if the pool allows; then a step."""
        m = self.c.manager
        for seq in self.device():
            if not m.num_uncommitted(seq) and self.c.can_grow(seq, 1):
                new = self.fresh(data, 1)
                self.c.grow(seq, new)
                self.tokens[seq] += new
                self.q[seq] = 1
        self.step()

    @rule()
    def step(self) -> None:
        """Lay out every sequence's uncommitted tokens and execute the step, as an engine would."""
        m = self.c.manager
        rows = [(s, m.num_uncommitted(s)) for s in self.device() if m.num_uncommitted(s)]
        batch = self.c.layout(rows)
        batch.validate(self.c.pool.num_blocks, num_state_slots=self.state_slots())
        self.execute(batch)
        self.hit_this_step = False

    def between_steps(self, seq: int) -> None:
        """Run the step first if ``seq`` is mid-step and this step had prefix hits.

        A hit may share a block that ``seq``'s tokens of this step are still to
        write; dropping ``seq`` now would leave the hit unwritten. A scheduler
        drops sequences between steps (an abort), or ones already laid out (a
        preemption victim), so it never does; without hits, mid-step drops are
        exercised here.
        """
        if self.hit_this_step and self.c.manager.num_uncommitted(seq):
            self.step()

    def execute(self, batch: BatchMetadata) -> None:
        self.mem.copy_blocks(batch.copies)
        if batch.state is not None:
            for src, dst in batch.state.copies:
                self.states[dst] = self.states[src]
        for i, seq in enumerate(batch.seq_ids):
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            first = batch.positions[start]
            toks = tuple(self.tokens[seq])
            for g in range(len(self.windows)):
                kv = np.stack([token_kv(g, toks[: p + 1]) for p in batch.positions[start:end]])
                self.mem.write(g, kv, kv, batch.slots(g)[start:end])
            if batch.state is not None:
                slot = batch.state.slots[i]
                before = () if first == 0 else self.states[slot]
                assert before == toks[:first], f"sequence {seq}: state {before} at {first}"
                self.states[slot] = toks[: batch.seq_lens[i]]

    def state_slots(self) -> int | None:
        return None if self.c.state is None else self.c.state.pool.num_slots

    @precondition(lambda self: self.c.manager.sequence_ids())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.device()), label="parent")
        child, self.next_id = self.next_id, self.next_id + 1
        if self.c.manager.num_uncommitted(parent):
            try:
                self.c.fork(parent, child)
            except (StepBoundaryError, OutOfBlocksError):  # whichever is checked first
                return
            raise AssertionError("a fork mid-step was allowed")
        if self.attempt(self.c.can_fork(parent), self.c.fork, parent, child):
            self.tokens[child] = list(self.tokens[parent])
            self.q[child] = self.q[parent]

    @precondition(lambda self: self.c.manager.sequence_ids())
    @rule(data=st.data(), swap=st.booleans())
    def preempt(self, data: st.DataObject, swap: bool) -> None:
        seq = data.draw(st.sampled_from(self.device()), label="victim")
        self.between_steps(seq)
        if swap and self.c.manager.num_uncommitted(seq):
            swap = False  # a scheduler swaps out only sequences laid out already
        if swap and not self.c.can_swap_out(seq):
            return
        out = self.c.preempt(seq, swap=swap)
        if out is None:
            self.forget(seq)
            return
        self.swap_out(out)
        self.swapped[seq] = out.num_tokens

    def swap_out(self, out: SwapOut) -> None:
        """Read the device blocks now, as the step's first act would."""
        for dev, host in zip(out.device_blocks, out.host_blocks, strict=True):
            layers = range(len(self.windows))
            self.host_kv[host] = np.stack(
                [np.stack([self.mem.k[g][dev], self.mem.v[g][dev]]) for g in layers]
            )
        if out.state is not None:
            self.host_states[out.state[1]] = self.states[out.state[0]]

    @precondition(lambda self: self.c.manager.sequence_ids())
    @rule(data=st.data(), fork=st.booleans(), k=st.integers(0, 2))
    def swap_round_trip(self, data: st.DataObject, fork: bool, k: int) -> None:
        """Swap a laid-out sequence out (a fork of it, just made, if ``fork``), step, bring it back.

        A fork's state copy is still pending when the child is swapped out:
        the swap must read the parent's state, not the child's empty slot.
        """
        m = self.c.manager
        ready = [s for s in self.device() if not m.num_uncommitted(s)]
        if not ready:
            return
        seq = data.draw(st.sampled_from(ready), label="swapped out")
        if fork:
            child, self.next_id = self.next_id, self.next_id + 1
            if not self.attempt(self.c.can_fork(seq), self.c.fork, seq, child):
                return
            self.tokens[child], self.q[child], seq = list(self.tokens[seq]), self.q[seq], child
        if not self.c.can_swap_out(seq):
            return
        out = self.c.preempt(seq, swap=True)
        assert out is not None
        self.swap_out(out)
        self.swapped[seq] = out.num_tokens
        self.step()
        self.swap_in(data, k, seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), k=st.integers(0, 3))
    def swap_in(self, data: st.DataObject, k: int, seq: int | None = None) -> None:
        if seq is None:
            seq = data.draw(st.sampled_from(sorted(self.swapped)), label="swapped")
        toks = self.tokens[seq] + self.fresh(data, k)
        if not self.attempt(self.c.can_swap_in(seq, k), self.c.swap_in, seq, toks, k):
            return
        back = self.result
        assert isinstance(back, SwapIn)
        b = self.b
        for i, slot in enumerate(back.slots):
            if slot == -1:
                continue
            saved = self.host_kv[back.host_blocks[i // b]]
            for g in range(len(self.windows)):
                row = saved[g, :, i % b][:, None]  # [2 (k, v), 1, 1, 2]
                self.mem.write(g, row[0], row[1], [slot])
        if back.state is not None:
            self.states[back.state[1]] = self.host_states[back.state[0]]
        self.tokens[seq] = toks
        self.q[seq] = k
        del self.swapped[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)), label="released")
        if seq not in self.swapped:
            self.between_steps(seq)
        self.c.release(seq)
        self.forget(seq)

    def forget(self, seq: int) -> None:
        self.history.append(tuple(self.tokens.pop(seq)))
        self.swapped.pop(seq, None)
        self.q.pop(seq, None)

    # -- invariants -------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "c"):
            return
        self.c.check_integrity()

    @invariant()
    def windows_bound_memory(self) -> None:
        if not hasattr(self, "c"):
            return
        b = self.b
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            m = self.c.managers[g]
            for seq in m.sequence_ids():
                held, q = len(m.held_blocks(seq)), max(1, self.q[seq])
                assert held <= cdiv(w + q - 2, b) + 1, f"group {g}: {seq} holds {held}, q={q}"
                if q == 1:
                    assert held <= cdiv(w, b) + 1

    @invariant()
    def kv_and_state_are_right(self) -> None:
        if not hasattr(self, "c"):
            return
        m = self.c.manager
        for seq in m.sequence_ids():
            if not m.num_uncommitted(seq):
                self.check_kv(seq)
        if self.c.state is not None:
            for seq in self.c.state.sequence_ids():
                if not m.num_uncommitted(seq):
                    slot = self.c.state.slot(seq)
                    pending = {d: s for s, d in self.c.state.pending_copies()}
                    summary = self.states.get(pending.get(slot, slot))
                    assert summary == tuple(self.tokens[seq]), f"state of {seq}: {summary}"

    def check_kv(self, seq: int) -> None:
        """Every held, written position of every group holds that group's KV of the token."""
        toks = tuple(self.tokens[seq])
        c = self.c.manager.num_tokens(seq) - self.c.manager.num_uncommitted(seq)
        for g, mg in enumerate(self.c.managers):
            table = mg.block_table(seq)
            released = len(table) - len(mg.held_blocks(seq))
            start = released * self.b
            copies = {d: s for s, d in mg.pending_copies()}
            for p in range(start, c):
                block = table[p // self.b]
                block = copies.get(block, block)  # a pending copy: its source holds it now
                got = self.mem.k[g][block, p % self.b]
                assert np.array_equal(got, token_kv(g, toks[: p + 1])), (
                    f"group {g}, sequence {seq}, position {p}: wrong KV"
                )

    def teardown(self) -> None:
        if not hasattr(self, "c"):
            return
        for seq in list(self.tokens):
            self.c.release(seq)
        self.c.layout([])  # takes whatever copies were pending
        self.c.check_integrity()
        assert self.c.pool.num_held == 0, "blocks left held"
        assert self.c.host.num_free == self.c.host.num_blocks
        if self.c.state is not None:
            assert self.c.state.pool.num_free == self.c.state.pool.num_slots, "state slots left"


TestGroups = GroupsMachine.TestCase
TestGroups.settings = settings(
    max_examples=max(300, settings().max_examples), stateful_step_count=50
)
