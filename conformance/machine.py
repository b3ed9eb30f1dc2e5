"""The Hypothesis state machine that drives a :class:`~conformance.lockstep.Lockstep`.

Each example draws a workload configuration, then a random program of rules:
add sequences (prompt lengths 1, B-1, B, B+1, 2B+1, and prompts that share an
earlier prompt's prefix, so the prefix cache hits; in a long-context workload,
first a prompt of 300 to 1100 tokens prefilled in chunks of up to 1024, then
decoded, so that sequences pass the 64-key tiles and the 256/512/1024-key
switch points of a kernel), run steps (whole or
chunked prefills, decodes, any subset of the live sequences), fork (so the
next write into a shared block copies it), free (so blocks are reused), and
ask for more blocks than are left (so allocation fails and must change
nothing). The lockstep compares both sides after every step; Hypothesis then
shrinks a failing program to a minimal one.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conformance.lockstep import ConformanceFailure, Lockstep
from conformance.plan import Plan
from conformance.variants import label
from conformance.workload import LONG_PROMPTS, WorkloadConfig
from spec.backend import Backend

MAX_SEQS = 4
"""Live sequences at most: enough for batching, forks and sharing; small enough to shrink."""
VOCAB = 64
_SEED = st.integers(0, 2**16)
_PICK = st.integers(0, 63)
_LONG_CHUNKS = (256, 128, 512, 1024)
"""Prefill chunk sizes of a long prompt: large, as a serving engine would schedule them."""
MAX_LONG_PROMPTS = 2
"""Long prompts per workload at most: each costs seconds on an interpreted kernel."""


@dataclass
class RunStats:
    """What a run exercised: examples, steps, rules applied, checks made."""

    examples: int = 0
    steps: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    configs: Counter[str] = field(default_factory=Counter)
    longest: int = 0  # the most tokens any sequence held when a step ran
    first_failure_example: int | None = None  # examples run when the first failure appeared

    def note_failure(self) -> None:
        if self.first_failure_example is None:
            self.first_failure_example = self.examples


def _tokens(seed: int, length: int, offset: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [offset + int(t) for t in rng.integers(0, VOCAB, length)]


@dataclass(frozen=True)
class LongPrompt:
    """A long prompt: its length, prefill chunk, decodes after, and whether chunks batch decodes.

    With ``with_decodes``, each chunk shares its step with one decode of every
    finished sequence (a mixed batch), as a continuous-batching engine runs them.
    """

    length: int
    chunk: int
    with_decodes: bool
    decodes: int
    seed: int
    token: int


_LONG_LENGTHS = st.one_of(st.sampled_from((300, 1100, 1025, 513)), st.integers(*LONG_PROMPTS))
"""Long prompt lengths: often just past 512 or 1024, or at the limit; they shrink to 300."""
_LONG = st.builds(
    LongPrompt,
    _LONG_LENGTHS,
    st.sampled_from(_LONG_CHUNKS),
    st.booleans(),
    st.integers(1, 3),
    _SEED,
    _PICK,
)


class LockstepMachine(RuleBasedStateMachine):
    """Random workloads against the spec and one backend, compared after every step."""

    def __init__(
        self, backend: Backend, plan: Plan, stats: RunStats, on_example: Callable[[], None]
    ) -> None:
        super().__init__()
        self.backend = backend
        self.plan = plan
        self.stats = stats
        self.on_example = on_example
        self.lockstep: Lockstep | None = None
        self.pending: dict[int, list[int]] = {}  # live sequence -> prompt tokens still to run
        self.prompts: list[list[int]] = []
        self.computed: list[list[int]] = []  # prompts whose prefill has completed
        self.next_id = 0
        self.long_prompts = 0
        stats.examples += 1

    @property
    def ls(self) -> Lockstep:
        assert self.lockstep is not None, "the initialize rule runs first"
        return self.lockstep

    @property
    def block_size(self) -> int:
        return self.ls.config.geometry.block_size

    def _count(self, name: str) -> None:
        self.stats.rules[name] += 1

    # -- rules ------------------------------------------------------------------------

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        config: WorkloadConfig = data.draw(self.plan.configs(), label="config")
        g = config.geometry
        long = " long-context" if config.long_context else ""
        self.stats.configs[
            f"{g.dtype} B={g.block_size} H={config.num_heads}/{g.num_kv_heads} D={g.head_dim}{long}"
            + label(config)  # fp8 KV and attention variants, if any
        ] += 1
        try:
            self.lockstep = Lockstep(self.backend, config, self.stats.checks)
        except ConformanceFailure:
            self.stats.note_failure()
            raise
        if config.long_context:  # every long-context workload starts with a long prompt
            self.add_long(data.draw(_LONG, label="long prompt"))

    @precondition(lambda self: len(self.pending) < MAX_SEQS)
    @rule(length=st.integers(0, 5), seed=_SEED, then_step=st.booleans(), token=_PICK)
    def add(self, length: int, seed: int, then_step: bool, token: int) -> None:
        """A new sequence; with ``then_step``, a step of every live sequence follows."""
        b = self.block_size
        n = (1, max(1, b - 1), b, b + 1, 2 * b + 1, 5)[length]
        self._count(f"add (prompt length {('1', 'B-1', 'B', 'B+1', '2B+1', '5')[length]})")
        self._start(_tokens(seed, n))
        if then_step:
            self.step_all(token)

    @precondition(lambda self: bool(self.prompts) and len(self.pending) < MAX_SEQS)
    @rule(
        which=_PICK,
        blocks=st.integers(1, 3),
        tail=st.integers(1, 3),
        seed=_SEED,
        then_step=st.booleans(),
        token=_PICK,
    )
    def add_shared_prefix(
        self, which: int, blocks: int, tail: int, seed: int, then_step: bool, token: int
    ) -> None:
        """A prompt that repeats an earlier one's first blocks (computed ones preferred)."""
        pool = self.computed or self.prompts
        earlier = pool[which % len(pool)]
        prompt = earlier[: blocks * self.block_size] + _tokens(seed, tail)
        self._count("add (sharing an earlier prompt's prefix)")
        self._start(prompt)
        if then_step:
            self.step_all(token)

    @precondition(lambda self: self._long_room() >= LONG_PROMPTS[0])
    @rule(long=_LONG)
    def add_long(self, long: LongPrompt) -> None:
        """A long prompt prefilled in large chunks, then decodes of every finished sequence."""
        n = min(long.length, self._long_room())
        self.long_prompts += 1
        self._count(f"add (long prompt, {LONG_PROMPTS[0]}..{LONG_PROMPTS[1]} tokens)")
        seq_id = self.next_id
        self._start(_tokens(long.seed, n))
        while self.pending.get(seq_id):
            todo = self.pending[seq_id]
            done = [s for s, rest in sorted(self.pending.items()) if not rest]
            token = long.token
            decoding = [(s, [(token + 7 * s) % VOCAB]) for s in done] if long.with_decodes else []
            if not self._run([(seq_id, todo[: long.chunk]), *decoding]):
                break  # the pool ran out: the sequence stays pending for later steps
        for i in range(long.decodes):
            if any(not rest for rest in self.pending.values()):
                self.decode((long.token + i) % VOCAB)

    @precondition(lambda self: bool(self.pending))
    @rule(subset=st.integers(0, 2**MAX_SEQS - 1), chunk=st.integers(0, 4), token=_PICK)
    def step(self, subset: int, chunk: int, token: int) -> None:
        live = sorted(self.pending)
        chosen = [s for i, s in enumerate(live) if subset >> i & 1] or live
        b = self.block_size
        limit = (None, 1, max(1, b - 1), b, b + 1)[chunk]
        schedule = []
        for seq_id in chosen:
            todo = self.pending[seq_id]
            new = todo[:limit] if todo else [(token + 7 * seq_id) % VOCAB]
            schedule.append((seq_id, new))
        self._run(schedule)

    @precondition(lambda self: any(not todo for todo in self.pending.values()))
    @rule(token=_PICK)
    def decode(self, token: int) -> None:
        """One new token for every sequence whose prompt is done."""
        done = [s for s, todo in sorted(self.pending.items()) if not todo]
        self._run([(s, [(token + 7 * s) % VOCAB]) for s in done])

    @precondition(lambda self: bool(self.pending))
    @rule(token=_PICK)
    def step_all(self, token: int) -> None:
        """Every live sequence at once: a chunk of at most B prompt tokens, or a decode."""
        b = self.block_size
        schedule = [
            (s, todo[:b] if todo else [(token + 7 * s) % VOCAB])
            for s, todo in sorted(self.pending.items())
        ]
        self._run(schedule)

    @precondition(
        lambda self: self.plan.copy_on_write and len(self.pending) < MAX_SEQS and self._forkable()
    )
    @rule(which=_PICK, write=st.booleans(), token=_PICK)
    def fork(self, which: int, write: bool, token: int) -> None:
        """Share a sequence's blocks with a new child; with ``write``, both decode at once."""
        parents = self._forkable()
        parent = parents[which % len(parents)]
        child = self._new_id()
        self.ls.fork(parent, child)
        self.pending[child] = []
        self._count("fork")
        if write:
            self._run([(child, [token]), (parent, [(token + 1) % VOCAB])])

    @precondition(lambda self: len(self.pending) >= 2 or (bool(self.pending) and self._half_full()))
    @rule(which=_PICK)
    def free(self, which: int) -> None:
        live = sorted(self.pending)
        seq_id = live[which % len(live)]
        self.ls.free(seq_id)
        del self.pending[seq_id]
        self._count("free")

    @precondition(lambda self: len(self.pending) < MAX_SEQS and self._half_full())
    @rule(seed=_SEED)
    def allocation_failure(self, seed: int) -> None:
        """A prompt one block larger than what is left: the step must leave it out."""
        m = self.ls.manager
        prompt = _tokens(seed, (m.pool.num_available + 1) * self.block_size, offset=VOCAB)
        seq_id = self._new_id()
        self.ls.add(seq_id, prompt)
        ran = self.ls.step([(seq_id, prompt)])
        assert not ran, "internal error: an allocation larger than the pool succeeded"
        self.ls.free(seq_id)
        self._count("allocation failure (prompt larger than the free pool)")

    @invariant()
    def spec_is_consistent(self) -> None:
        if self.lockstep is not None:
            self.lockstep.manager.check_integrity()
            self.stats.checks["spec block-table and pool invariants"] += 1

    def teardown(self) -> None:
        if self.lockstep is not None:
            pool = self.lockstep.manager.pool
            self.stats.rules["prefix-cache evictions (spec pool)"] += pool.num_evictions
        self.on_example()

    # -- internals --------------------------------------------------------------------

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _start(self, prompt: list[int]) -> None:
        seq_id = self._new_id()
        cached = self.ls.add(seq_id, prompt)
        if cached:
            self._count("prefix-cache hit")
        self.pending[seq_id] = prompt[cached:]
        self.prompts.append(prompt)

    def _run(self, schedule: list[tuple[int, list[int]]]) -> bool:
        """Run one step; True when the first sequence of ``schedule`` ran."""
        before = {s: self.ls.manager.num_tokens(s) for s, _ in schedule}
        try:
            ran = set(self.ls.step(schedule))
        except ConformanceFailure:
            self.stats.note_failure()
            raise
        self.stats.steps += 1
        for seq_id, new in schedule:
            self._count_step(seq_id, new, before[seq_id], seq_id in ran)
        if ran:
            longest = max(self.ls.manager.num_tokens(s) for s in ran)
            self.stats.longest = max(self.stats.longest, longest)
        return bool(schedule) and schedule[0][0] in ran

    def _long_room(self) -> int:
        """Tokens a new long prompt may have: 0 unless long-context and a sequence slot is free."""
        long_ok = self.ls.config.long_context and self.long_prompts < MAX_LONG_PROMPTS
        if not long_ok or len(self.pending) >= MAX_SEQS:
            return 0
        room = (self.ls.manager.pool.num_available - 1) * self.block_size
        return min(room, LONG_PROMPTS[1])

    def _half_full(self) -> bool:
        pool = self.ls.manager.pool
        return 2 * pool.num_available < pool.num_blocks

    def _forkable(self) -> list[int]:
        m = self.ls.manager
        return [s for s in sorted(self.pending) if not self.pending[s] and m.num_tokens(s) > 0]

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


def timed_progress(
    stats: RunStats, report: Callable[[str], None] | None, every_s: float = 5.0
) -> Callable[[], None]:
    """A callback for the end of each example that reports progress every ``every_s`` seconds."""
    start = last = time.monotonic()

    def tick() -> None:
        nonlocal last
        now = time.monotonic()
        if report is not None and now - last >= every_s:
            last = now
            phase = "" if stats.first_failure_example is None else "shrinking a failure: "
            report(f"{phase}{stats.examples} examples, {stats.steps} steps, {now - start:.0f} s")

    return tick
