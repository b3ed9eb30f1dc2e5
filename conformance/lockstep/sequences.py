"""The live sequences of one example, and the low-level moves every rule makes on them.

The state machine keeps, beside its lockstep, which sequences are live and
what each still has to prefill (``pending``), the prompts seen and those whose
prefill completed (for prefix hits), the forks, and the ids given so far. A
step runs through :meth:`LiveSequences._run`, which respects the backend's
limits (prefill chunks no longer than ``max_query_len``, whole prompts without
``chunked_prefill``, no sequence past ``max_context_len``) and counts what ran.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from hypothesis import strategies as st

from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.pairs import split_keys
from conformance.lockstep.plan import (
    Plan,
)
from conformance.lockstep.run_stats import RunStats
from conformance.lockstep.spec_side import SpecSide

VOCAB = 64
SEED = st.integers(0, 2**16)
PICK = st.integers(0, 63)
MAX_LONG_PROMPTS = 2
"""Long prompts per workload at most: each costs seconds on an interpreted kernel."""


def draw_tokens(seed: int, length: int, offset: int = 0) -> list[int]:
    """``length`` tokens of the vocabulary, from ``seed``."""
    rng = np.random.default_rng(seed)
    return [offset + int(t) for t in rng.integers(0, VOCAB, length)]


class LiveSequences:
    """An example's sequences (the state the machine's rules share) and the moves on them."""

    plan: Plan
    stats: RunStats
    lockstep: Lockstep | SpecSide | None
    pending: dict[int, list[int]]  # live sequence -> prompt tokens still to run
    prompts: list[list[int]]
    computed: list[list[int]]  # prompts whose prefill has completed
    parent_of: dict[int, int]  # forks: child -> parent
    next_id: int
    long_prompts: int
    defer_failure: bool  # a shard's example: draw to the end, then fail
    deferred: ConformanceFailure | None
    on_found: Callable[[ConformanceFailure], None] | None

    @property
    def ls(self) -> Lockstep | SpecSide:
        assert self.lockstep is not None, "the initialize rule runs first"
        return self.lockstep

    @property
    def block_size(self) -> int:
        return self.ls.config.geometry.block_size

    @property
    def _split_keys(self) -> int:
        """The visible context of a decode the suite draws as split-KV (:func:`split_keys`)."""
        return split_keys(self.plan.caps, self.plan.envelope.device)

    def _count(self, name: str) -> None:
        self.stats.rules[name] += 1

    def _room(self, more: int = 1) -> bool:
        return len(self.pending) + more <= self.plan.max_live

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _make_room(self, more: int, keep: int | None = None) -> None:
        """Free the oldest live sequences (not ``keep``) until ``more`` new ones fit."""
        while not self._room(more):
            oldest = min(s for s in self.pending if s != keep)
            self._free(oldest)
            self._count("free (the oldest, to make room for a new sequence)")

    def _prompt_length(self, kind: int) -> int:
        b = self.block_size
        return self._fit_length((1, max(1, b - 1), b, b + 1, 2 * b + 1, 5)[kind])

    def _fit_length(self, n: int) -> int:
        limit = self.plan.caps.max_context_len
        return n if limit is None else max(1, min(n, limit - 1))

    def _fit_prompt(self, prompt: list[int]) -> list[int]:
        return prompt[: self._fit_length(len(prompt))]

    def _chunk_limit(self, limit: int | None) -> int | None:
        """A prefill chunk size the backend can attend: capped by ``max_query_len`` (when > 1),
        and whole prompts when it has no chunked prefill."""
        caps = self.plan.caps
        if not caps.chunked_prefill:
            return None
        if caps.max_query_len is not None and caps.max_query_len > 1:
            return caps.max_query_len if limit is None else min(limit, caps.max_query_len)
        return limit

    def _start(self, prompt: list[int]) -> None:
        seq_id = self._new_id()
        cached = self.ls.add(seq_id, prompt)
        if cached:
            self._count("prefix-cache hit")
        self.pending[seq_id] = prompt[cached:]
        self.prompts.append(prompt)

    def _fork(self, parent: int) -> int:
        child = self._new_id()
        self.ls.fork(parent, child)
        self.pending[child] = []
        self.parent_of[child] = parent
        return child

    def _free(self, seq_id: int) -> None:
        self.ls.free(seq_id)
        del self.pending[seq_id]

    def _run(
        self, schedule: list[tuple[int, list[int]]], drafts: dict[int, int] | None = None
    ) -> bool:
        """Run one step; True when the first sequence of ``schedule`` ran.

        ``drafts`` names the speculative rows and their draft counts.
        """
        schedule = self._within_context(schedule)
        if not schedule:
            return False
        before = {s: self.ls.manager.num_tokens(s) for s, _ in schedule}
        try:
            ran = set(self.ls.step(schedule, drafts))
        except ConformanceFailure as failure:
            self._found(failure)
            if not self.defer_failure:
                raise
            ran = self._defer(failure, before)
        self.stats.steps += 1
        for seq_id, new in schedule:
            self._count_step(seq_id, new, before[seq_id], seq_id in ran)
        if ran:
            longest = max(self.ls.manager.num_tokens(s) for s in ran)
            self.stats.longest = max(self.stats.longest, longest)
        return schedule[0][0] in ran

    def _found(self, failure: ConformanceFailure) -> None:
        """A failure: counted; the run's first is told at once (shrinking may never end)."""
        first = self.stats.first_failure_example is None
        self.stats.note_failure()
        if first and self.on_found is not None:
            self.on_found(failure)

    def _defer(self, failure: ConformanceFailure, before: dict[int, int]) -> set[int]:
        """Keep ``failure`` for the teardown; go on through the spec alone; the step's sequences.

        A shard's example draws as the same example drawn through the spec
        alone on another shard (:mod:`conformance.run.shard`): Hypothesis
        requires one sequence of choices to draw the same way every time. The
        spec has given the step's tokens their slots and laid it out before
        any backend call, so its state is the one that example would have.
        """
        ls = self.ls
        assert isinstance(ls, Lockstep), "a failure comes from the backend's lockstep"
        self.deferred = failure
        self.lockstep = SpecSide(ls.config, ls.groups, ls.manager)
        return {s for s, n in before.items() if ls.manager.num_tokens(s) > n}

    def _within_context(self, schedule: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
        """Leave out sequences that would grow past ``max_context_len``."""
        limit = self.plan.caps.max_context_len
        if limit is None:
            return schedule
        kept = [
            (s, new) for s, new in schedule if self.ls.manager.num_tokens(s) + len(new) <= limit
        ]
        for _ in range(len(schedule) - len(kept)):
            self._count("left out of a step: it would pass max_context_len")
        return kept

    def _long_room(self) -> int:
        """Tokens a new long prompt may have: 0 unless long-context and a sequence slot is free."""
        long_ok = self.plan.long_context and self.long_prompts < MAX_LONG_PROMPTS
        if not long_ok or not self._room():
            return 0
        room = (self.ls.manager.pool.num_available - 1) * self.block_size
        return self._fit_length(min(room, self.plan.envelope.long_prompts[1]))

    def _half_full(self) -> bool:
        pool = self.ls.manager.pool
        return 2 * pool.num_available < pool.num_blocks

    def _forkable(self) -> list[int]:
        m = self.ls.manager
        return [s for s in sorted(self.pending) if not self.pending[s] and m.num_tokens(s) > 0]

    def _chain_middles(self) -> list[int]:
        """Live sequences with a live parent and a live child: the middle of a chain of forks."""
        live = self.pending
        parents = {p for c, p in self.parent_of.items() if c in live}
        return sorted(s for s in parents if s in live and self.parent_of.get(s) in live)

    def _can_evict(self) -> bool:
        """Short examples with prefix caching, a cached block, and a prompt that would hit it."""
        if self.plan.kind not in ("short", "large pool") or not self._room(2):
            return False
        m = self.ls.manager
        if not self.ls.config.prefix_caching or m.pool.num_cached == 0:
            return False
        return any(m.cached_prefix(p) > 0 for p in self.computed)

    def _count_step(self, seq_id: int, new: list[int], start: int, ran: bool) -> None:
        if not ran:
            self._count("allocation failure (sequence left out of a step)")
        elif self.pending[seq_id]:
            self.pending[seq_id] = self.pending[seq_id][len(new) :]
            if not self.pending[seq_id]:
                self.computed.append(list(self.ls.manager.tokens(seq_id)))
            kind = "prefill chunk starting mid-sequence" if start else "prefill from position 0"
            self._count(kind if len(new) > 1 else f"{kind} (1 token)")
        else:
            self._count("decode")
