"""KV cache groups: a model's memory as groups of layers, each with its own lifecycle.

A hybrid model does not keep one kind of memory. Each group of layers keeps
the kind its attention needs, and the memory side (:mod:`spec.cache_manager`)
keeps one table (or one slot) per sequence per group:

* **full attention**: paged blocks that grow with the sequence, one block
  per ``B`` tokens, all kept until the sequence ends;
* **sliding window** of ``w`` tokens: paged blocks, but a block wholly older
  than the window of every query still to run is released as the sequence
  advances (:class:`~spec.block_manager.BlockManager` with ``window=w``), so
  a decoding sequence holds at most ``ceil(w / B) + 1`` blocks however long it
  grows;
* **fixed-size state** (linear attention, DeltaNet, Mamba): one state slot
  per sequence, whatever its length, from a separate :class:`StatePool`;
  taken at admission, freed at finish, copied on fork (a fork needs its own
  state to continue), dropped on preemption by recompute or swapped to a
  host slot, and never shared through the prefix cache, since the state after
  a prefix is not kept.

The paged groups share one pool of blocks; the state slots are a second pool
with a different lifecycle. Why, and what each costs in bytes, is in
:mod:`spec.cache_manager`.

>>> groups = (FULL_ATTENTION, sliding_window(1024), FIXED_STATE)
>>> [g.name for g in groups]
['full attention', 'sliding window 1024', 'fixed-size state']
>>> [g.paged for g in groups]
[True, True, False]

A state pool hands out slots; a fork gets its own slot and a pending copy of
the parent's state, which pins the parent's slot until the step's layout
takes the copy:

>>> states = StateManager(StatePool(3))
>>> states.add(0)
0
>>> states.fork(0, 1); states.slot(1), states.pending_copies()
(1, ((0, 1),))
>>> states.free(0); states.pool.num_free          # slot 0 is still read by the copy
1
>>> states.take_copies(), states.pool.num_free
([(0, 1)], 2)

**Speculation.** State cannot be truncated: the state after 1 + a tokens
cannot be recovered from the state after 1 + k. So the spec keeps the
sequence's own slot as a *checkpoint* that a speculative step only reads,
and gives the step ``1 + k`` *lookahead* slots: slot ``j`` receives the state
after the last verified token and ``j`` drafts. Verifying ``a`` drafts makes
lookahead slot ``a`` the sequence's slot and frees the rest with the old
checkpoint; a rollback frees the lookahead slots and the checkpoint is still
exact. A speculating sequence holds ``2 + k`` slots until its verification:

>>> states = StateManager(StatePool(6))
>>> states.add(0), states.draft(0, 2)              # the checkpoint, then 1 + 2 lookahead slots
(0, (1, 2, 3))
>>> states.verify(0, 1); states.slot(0), states.pool.num_free   # 1 draft accepted
(2, 5)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from spec.errors import (
    ArgumentValueError,
    DoubleFreeError,
    DuplicateSequenceError,
    OutOfBlocksError,
    SpeculationError,
    UnknownBlockError,
    UnknownSequenceError,
)
from spec.validate import check_choice, check_int, is_int

__all__ = [
    "FIXED_STATE",
    "FULL_ATTENTION",
    "KVCacheGroup",
    "StateManager",
    "StatePool",
    "sliding_window",
]

GroupKind = Literal["full", "window", "state"]


@dataclass(frozen=True)
class KVCacheGroup:
    """A group's kind of memory: ``"full"``, ``"window"`` (``window`` tokens), ``"state"``."""

    kind: GroupKind  # "full", "window" or "state"
    window: int | None = None  # tokens a query sees, for kind "window" only

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, ("full", "window", "state"))
        if self.kind == "window":
            object.__setattr__(self, "window", check_int("window", self.window, low=1))
        elif self.window is not None:
            raise ArgumentValueError(
                f"window is only for a sliding-window group, got kind {self.kind!r}"
            )

    @property
    def name(self) -> str:
        """How messages and reports name the group."""
        if self.kind == "window":
            return f"sliding window {self.window}"
        return "full attention" if self.kind == "full" else "fixed-size state"

    @property
    def paged(self) -> bool:
        """Whether the group keeps block tables (full attention, sliding window)."""
        return self.kind != "state"


FULL_ATTENTION = KVCacheGroup("full")
"""Paged blocks that grow with the sequence: today's behaviour, the default group."""

FIXED_STATE = KVCacheGroup("state")
"""One fixed-size state slot per sequence (linear attention, DeltaNet, Mamba)."""


def sliding_window(window: int) -> KVCacheGroup:
    """Paged blocks of a sliding window of ``window`` tokens, released as the sequence advances."""
    return KVCacheGroup("window", window)


class StatePool:
    """``num_slots`` fixed-size state slots: a free list and reference counts.

    A slot's holders are its sequence and the pending fork copies that read
    it. Invariant: ``num_free + num_held == num_slots``.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = check_int("num_state_slots", num_slots, low=0)
        self._refs = [0] * self.num_slots
        self._free: deque[int] = deque(range(self.num_slots))
        self.num_allocation_failures = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self.num_slots - self.num_free

    def allocate(self) -> int:
        """Take a slot (reference count 1), or raise and take none."""
        if not self._free:
            self.num_allocation_failures += 1
            raise OutOfBlocksError(f"state pool: all {self.num_slots} state slots are held")
        slot = self._free.popleft()
        self._refs[slot] = 1
        return slot

    def incref(self, slot: int) -> None:
        s = self._slot(slot)
        if not self._refs[s]:
            raise DoubleFreeError(f"state slot {s} is free: allocate it, do not share it")
        self._refs[s] += 1

    def decref(self, slot: int) -> None:
        s = self._slot(slot)
        if not self._refs[s]:
            raise DoubleFreeError(f"state slot {s} is already free")
        self._refs[s] -= 1
        if not self._refs[s]:
            self._free.append(s)

    def check_integrity(self, holders: dict[int, int]) -> None:
        """Assert reference counts equal ``holders`` and every unheld slot is free, once."""
        free = set(self._free)
        assert len(free) == len(self._free), "a state slot appears twice in the free list"
        for s in range(self.num_slots):
            assert self._refs[s] == holders.get(s, 0), (
                f"state slot {s}: reference count {self._refs[s]}, but {holders.get(s, 0)} holders"
            )
            assert (s in free) == (self._refs[s] == 0), f"state slot {s} is lost"

    def _slot(self, slot: object) -> int:
        s = check_int("slot", slot)
        if not 0 <= s < self.num_slots:
            raise UnknownBlockError(
                f"slot must be a state slot in 0..{self.num_slots - 1}, got {s}"
            )
        return s


class StateManager:
    """Which state slot each sequence holds, and the fork copies the next step must execute.

    Invariant: every sequence it holds has exactly one slot, and no two share one.
    Like copy-on-write copies, a fork's state copy ``(src, dst)`` is recorded
    and executed by the engine before the step's forward pass; until the
    layout takes it, it holds a reference to ``src``.
    """

    def __init__(self, pool: StatePool) -> None:
        self.pool = pool
        self._slots: dict[int, int] = {}
        self._copies: dict[int, int] = {}  # dst -> src, oldest first
        self._lookahead: dict[int, tuple[int, ...]] = {}  # seq id -> its speculative step's slots

    def __contains__(self, seq_id: object) -> bool:
        """Whether ``seq_id`` holds a slot (anything but an int, ``False`` say, holds none)."""
        return is_int(seq_id) and int(seq_id) in self._slots  # type: ignore[call-overload]

    def sequence_ids(self) -> list[int]:
        return list(self._slots)

    def slot(self, seq_id: int) -> int:
        return self._slots[self._held(seq_id)]

    def pending_copies(self) -> tuple[tuple[int, int], ...]:
        return tuple((src, dst) for dst, src in self._copies.items())

    def lookahead(self, seq_id: int) -> tuple[int, ...]:
        """The lookahead slots of a speculating sequence (empty when it has no drafts)."""
        return self._lookahead.get(self._held(seq_id), ())

    def can_draft(self, num_draft: int) -> bool:
        """Are there ``1 + num_draft`` free slots for a speculative step's lookahead states?"""
        return 1 + check_int("num_draft", num_draft, low=0) <= self.pool.num_free

    def draft(self, seq_id: int, num_draft: int) -> tuple[int, ...]:
        """Give ``seq_id`` ``1 + num_draft`` lookahead slots; its own slot becomes a checkpoint."""
        sid = self._held(seq_id)
        k = check_int("num_draft", num_draft, low=1)
        if sid in self._lookahead:
            raise SpeculationError(f"seq_id {sid} has drafts in flight: verify or roll back first")
        if not self.can_draft(k):
            self.pool.num_allocation_failures += 1
            raise OutOfBlocksError(
                f"state pool: {1 + k} lookahead slots wanted for seq_id {sid}, "
                f"{self.pool.num_free} free"
            )
        self._lookahead[sid] = tuple(self.pool.allocate() for _ in range(1 + k))
        return self._lookahead[sid]

    def verify(self, seq_id: int, num_accepted: int) -> None:
        """Keep the state after ``num_accepted`` drafts: lookahead slot ``num_accepted``."""
        sid = self._drafting(seq_id)
        slots = self._lookahead[sid]
        a = check_int("num_accepted", num_accepted, low=0, high=len(slots) - 1)
        del self._lookahead[sid]
        for s in (self._slots[sid], *slots[:a], *slots[a + 1 :]):
            self.pool.decref(s)
        self._slots[sid] = slots[a]

    def rollback(self, seq_id: int) -> None:
        """Drop the lookahead slots of a step that did not run: the checkpoint is the state.

        (After the step ran, the last verified token's state is lookahead slot
        0: a rollback then is ``verify(seq_id, 0)``.)
        """
        for s in self._lookahead.pop(self._drafting(seq_id)):
            self.pool.decref(s)

    def source(self, seq_id: int) -> int:
        """The slot that holds the sequence's state right now: its own, or, while a fork's copy
        into it is pending, that copy's source (a swap-out reads it before any copy runs)."""
        slot = self.slot(seq_id)
        return self._copies.get(slot, slot)

    def add(self, seq_id: int) -> int:
        """Give a new sequence a slot (its state starts empty: its first position is 0)."""
        sid = self._new(seq_id)
        self._slots[sid] = self.pool.allocate()
        return self._slots[sid]

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` a slot of its own and record the copy of the parent's state into it.

        A parent forked in this same step has a pending copy into its own
        slot: the child copies from that copy's source, which holds the same
        state, so that no slot is both a source and a destination.
        """
        src = self._slots[self._held(parent_id)]
        if parent_id in self._lookahead:
            raise SpeculationError(
                f"parent_id {parent_id} has drafts in flight: fork after they are verified"
            )
        src = self._copies.get(src, src)
        cid = self._new(child_id)
        dst = self.pool.allocate()
        self.pool.incref(src)
        self._slots[cid] = dst
        self._copies[dst] = src

    def free(self, seq_id: int) -> None:
        """Drop a sequence's slot (and a pending copy into it: nobody will read it)."""
        sid = self._held(seq_id)
        for s in self._lookahead.pop(sid, ()):
            self.pool.decref(s)
        slot = self._slots.pop(sid)
        src = self._copies.pop(slot, None)
        if src is not None:
            self.pool.decref(src)
        self.pool.decref(slot)

    def take_copies(self) -> list[tuple[int, int]]:
        """Hand over the pending state copies ``(src, dst)`` and release their sources."""
        copies = list(self.pending_copies())
        self._copies = {}
        for src, _ in copies:
            self.pool.decref(src)
        return copies

    def check_integrity(self, live: Iterable[int] | None = None) -> None:
        """Assert one slot per sequence, distinct, copies into held slots; with ``live``, that
        exactly those sequences hold a slot."""
        slots = list(self._slots.values()) + [s for ls in self._lookahead.values() for s in ls]
        assert len(set(slots)) == len(slots), (
            f"two sequences share a state slot: {self._slots}, lookahead {self._lookahead}"
        )
        assert set(self._lookahead) <= set(self._slots), "lookahead slots of an unheld sequence"
        if live is not None:
            assert set(live) == set(self._slots), (
                f"sequences {sorted(live)} hold KV, but {sorted(self._slots)} hold state slots"
            )
        holders = dict.fromkeys(slots, 1)
        for dst, src in self._copies.items():
            assert dst in holders, f"pending state copy into slot {dst}, which nobody holds"
            holders[src] = holders.get(src, 0) + 1
        self.pool.check_integrity(holders)

    def _held(self, seq_id: object) -> int:
        sid = check_int("seq_id", seq_id, low=0)
        if sid not in self._slots:
            raise UnknownSequenceError(f"sequence {sid} holds no state slot")
        return sid

    def _drafting(self, seq_id: object) -> int:
        sid = self._held(seq_id)
        if sid not in self._lookahead:
            raise SpeculationError(f"seq_id {sid} has no drafts in flight")
        return sid

    def _new(self, seq_id: object) -> int:
        sid = check_int("seq_id", seq_id, low=0)
        if sid in self._slots:
            raise DuplicateSequenceError(f"sequence {sid} already holds a state slot")
        return sid
