"""The Hypothesis state machine that drives a :class:`~conformance.lockstep.driver.Lockstep`.

Each example draws a workload configuration, then a random program of rules:
add sequences (prompt lengths 1, B-1, B, B+1, 2B+1, and prompts that share an
earlier prompt's prefix, so the prefix cache hits), run steps (whole or
chunked prefills, decodes, any subset of the live sequences), fork (so the
next write into a shared block copies it), free (so blocks are reused), and
ask for more blocks than are left (so allocation fails and must change
nothing). Some rules reach rare states on purpose: a prefix-cache eviction
followed by the prompt that would have hit the evicted block, forks of forks
that then all write, and a free in the middle of a chain of forks.

What an example starts with depends on its pass: the openings of
:mod:`conformance.lockstep.openings`.

Speculative rules (:mod:`spec.speculative`, when the backend's capabilities allow
rows of ``1 + k`` tokens): a decoding sequence drafts ``k`` tokens into
lookahead slots, alone or beside a decode of every other finished sequence;
the step runs on both sides; then ``a`` drafts are verified (a drawn count)
or all rolled back, and sometimes the same sequence decodes at once (its
query must see none of the rejected K/V still in its last block), or a new
prompt repeats the drafted tokens (the prefix cache must not serve a block
that held a rejected draft). Drafts are never left in flight past the rule,
so every other rule (forks, frees, prefix hits, windows) meets sequences
whose tokens are all verified, and mixes with speculation from one rule to
the next.

Steps respect the backend's capabilities: prefill chunks no longer than
``max_query_len`` (when it is above 1), whole prompts when ``chunked_prefill``
is false, no sequence grown past ``max_context_len``; the lockstep splits or
skips, and reports, whatever attention a step still holds that the backend
cannot run. The lockstep compares both sides after every step and at the end
of the example; Hypothesis then shrinks a failing program to a minimal one.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conformance.bounds.checker import BoundsChecker
from conformance.judges.oracle import OracleChoice
from conformance.lockstep.configs import OPENS_WITH_PAIRS, configs
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.openings import Openings, long_prompts
from conformance.lockstep.pairs import planned_pairs, split_keys
from conformance.lockstep.plan import MAX_DRAFT, Plan
from conformance.lockstep.run_stats import RunStats, _shape, drawn_names
from conformance.lockstep.sequences import PICK, SEED, VOCAB, draw_tokens
from conformance.lockstep.spec_side import SpecSide
from conformance.lockstep.workload import WorkloadConfig
from spec.backend import Backend

_SUBSET = st.integers(0, 2**64 - 1)
"""A subset of the live sequences, as bits (0: all of them)."""


class LockstepMachine(Openings, RuleBasedStateMachine):
    """Random workloads against the spec and one backend, compared after every step."""

    def __init__(
        self,
        backend: Backend,
        plan: Plan,
        stats: RunStats,
        on_example: Callable[[], None],
        bounds: BoundsChecker | None = None,
        *,
        draw_only: bool = False,
        defer_failure: bool = False,
        oracle: OracleChoice | None = None,
        on_found: Callable[[ConformanceFailure], None] | None = None,
    ) -> None:
        super().__init__()
        self.on_found = on_found  # told of the run's first failure, before any shrinking
        self.oracle = oracle  # the run's reference settings (None: the backend device's default)
        self.backend = backend
        self.draw_only = draw_only  # another shard's example: the spec's bookkeeping alone
        self.defer_failure = defer_failure  # a shard's example: draw to the end, then fail
        self.deferred: ConformanceFailure | None = None
        self.bounds = bounds  # the run's bounds checker, shared by its examples
        self.plan = plan
        self.stats = stats
        self.on_example = on_example
        self.lockstep: Lockstep | SpecSide | None = None
        self.pending: dict[int, list[int]] = {}  # live sequence -> prompt tokens still to run
        self.prompts: list[list[int]] = []
        self.computed: list[list[int]] = []  # prompts whose prefill has completed
        self.parent_of: dict[int, int] = {}  # forks: child -> parent
        self.next_id = 0
        self.long_prompts = 0

    # -- rules ------------------------------------------------------------------------

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        paths = self.stats.coverage.paths
        if not paths.planned:
            caps, device = self.plan.caps, self.plan.envelope.device
            wanted, why = planned_pairs(caps, device)
            how = "" if caps.decode_split is None else caps.decode_split.describe()
            paths.plan(wanted, why, split_keys(caps, device), how)
        config: WorkloadConfig = data.draw(configs(self.plan), label="config")
        self.stats.examples += 1  # one the backend can run (a draw its limits rule out is not)
        self.stats.configs[_shape(config, self.plan.kind)] += 1
        self.stats.drawn.update(drawn_names(config))
        if self.draw_only:
            self.lockstep = SpecSide(config)
        else:
            self.lockstep = self._lockstep(config)
        if self.plan.kind == "split":
            seed, token = data.draw(SEED, label="seed"), data.draw(PICK, label="token")
            chunk = data.draw(st.sampled_from(self.plan.envelope.long_chunks), label="chunk")
            self._start_split(seed, chunk, token)
        elif self.plan.long_context:  # every long-context workload starts with a long prompt
            self._add_long(data.draw(long_prompts(self.plan.envelope), label="long prompt"))
        elif self.plan.wide:
            self._start_wide(data)
        elif self.plan.kind == "groups":
            self._start_groups(data)
        elif self.plan.kind in OPENS_WITH_PAIRS:
            self._start_pairs(data.draw(SEED, label="seed"), data.draw(PICK, label="token"))
        else:  # a first sequence, so that every rule can run from the first step on
            self.add(data.draw(st.integers(0, 5), label="length"), data.draw(SEED), False, 0)

    def _lockstep(self, config: WorkloadConfig) -> Lockstep | SpecSide:
        """The example's lockstep of the spec and the backend (created here: it may fail)."""
        try:
            return Lockstep(
                self.backend,
                config,
                self.stats.checks,
                skips=self.stats.skips,
                coverage=self.stats.coverage,
                margins=self.stats.margins,
                bounds=self.bounds,
                oracle=self.oracle,
                call_seconds=self.stats.call_seconds,
            )
        except ConformanceFailure as failure:
            self._found(failure)
            if not self.defer_failure:
                raise
            self.deferred = failure
            return SpecSide(config)

    @rule(length=st.integers(0, 5), seed=SEED, then_step=st.booleans(), token=PICK)
    def add(self, length: int, seed: int, then_step: bool, token: int) -> None:
        """A new sequence; with ``then_step``, a step of every live sequence follows."""
        self._make_room(1)
        self._count(f"add (prompt length {('1', 'B-1', 'B', 'B+1', '2B+1', '5')[length]})")
        self._start(draw_tokens(seed, self._prompt_length(length)))
        if then_step:
            self.step_all(token)

    @precondition(lambda self: bool(self.prompts))
    @rule(
        which=PICK,
        blocks=st.integers(1, 3),
        tail=st.integers(1, 3),
        seed=SEED,
        then_step=st.booleans(),
        token=PICK,
    )
    def add_shared_prefix(
        self, which: int, blocks: int, tail: int, seed: int, then_step: bool, token: int
    ) -> None:
        """A prompt that repeats an earlier one's first blocks (computed ones preferred)."""
        self._make_room(1)
        pool = self.computed or self.prompts
        earlier = pool[which % len(pool)]
        prompt = earlier[: blocks * self.block_size] + draw_tokens(seed, tail)
        self._count("add (sharing an earlier prompt's prefix)")
        self._start(self._fit_prompt(prompt))
        if then_step:
            self.step_all(token)

    @precondition(lambda self: bool(self.pending))
    @rule(subset=_SUBSET, chunk=st.integers(0, 4), token=PICK)
    def step(self, subset: int, chunk: int, token: int) -> None:
        live = sorted(self.pending)
        chosen = [s for i, s in enumerate(live) if subset >> (i % 64) & 1] or live
        b = self.block_size
        limit = self._chunk_limit((None, 1, max(1, b - 1), b, b + 1)[chunk])
        schedule = []
        for seq_id in chosen:
            todo = self.pending[seq_id]
            new = todo[:limit] if todo else [(token + 7 * seq_id) % VOCAB]
            schedule.append((seq_id, new))
        self._run(schedule)

    @precondition(lambda self: any(not todo for todo in self.pending.values()))
    @rule(token=PICK)
    def decode(self, token: int) -> None:
        """One new token for every sequence whose prompt is done."""
        done = [s for s, todo in sorted(self.pending.items()) if not todo]
        self._run([(s, [(token + 7 * s) % VOCAB]) for s in done])

    @precondition(lambda self: bool(self.pending))
    @rule(token=PICK)
    def step_all(self, token: int) -> None:
        """Every live sequence at once: a chunk of at most B prompt tokens, or a decode."""
        limit = self._chunk_limit(self.block_size)
        schedule = [
            (s, todo[:limit] if todo else [(token + 7 * s) % VOCAB])
            for s, todo in sorted(self.pending.items())
        ]
        self._run(schedule)

    @precondition(lambda self: self.plan.max_draft > 0 and bool(self._forkable()))
    @rule(
        which=PICK,
        k=st.integers(0, MAX_DRAFT),
        accepted=st.integers(0, MAX_DRAFT),
        seed=SEED,
        then=st.integers(0, 4),
        batched=st.booleans(),
    )
    def speculate(
        self, which: int, k: int, accepted: int, seed: int, then: int, batched: bool
    ) -> None:
        """A speculative step of one sequence (``1 + k`` tokens), then verify ``a`` or roll back.

        ``k = 0`` drafts up to the end of the block of the verified token (a
        block full of drafts), or across its boundary when it ends there.
        ``then``: 0 verifies; 1 verifies, then the sequence decodes (it must not
        see the rejected K/V); 2 rolls every draft back; 3 verifies, then a new
        prompt repeats the drafted tokens (no prefix hit may serve a draft); 4
        preempts it by recomputation with its drafts in flight (freed, then its
        verified tokens sent again as a prompt: a prefix hit may serve only
        blocks of verified tokens).
        """
        seqs = self._forkable()
        seq_id = seqs[which % len(seqs)]
        if k == 0:
            b = self.block_size
            k = max(1, -(self.ls.manager.num_tokens(seq_id) + 1) % b)
        k = min(k, self.plan.max_draft)
        tokens = draw_tokens(seed, 1 + k)
        others = [(s, [(seed + 7 * s) % VOCAB]) for s in seqs if s != seq_id] if batched else []
        drafted = [*self.ls.manager.tokens(seq_id), *tokens]
        self._run([(seq_id, tokens), *others], drafts={seq_id: k})
        if not self.ls.manager.num_drafts(seq_id):
            return  # left out (no room, or past max_context_len): no drafts in flight
        if then == 2:
            self.ls.rollback(seq_id)
            self._count("speculative step, all of its drafts rolled back")
            return
        if then == 4:
            self._free(seq_id)
            self._count("preempted by recomputation with its drafts in flight")
            self._start(self._fit_prompt(drafted[: len(drafted) - k]))
            again = self.next_id - 1
            self._run([(again, self.pending[again][: self._chunk_limit(None)])])
            return
        a = min(accepted, k)
        self.ls.verify(seq_id, a)
        kept = "none" if a == 0 else "all" if a == k else "some"
        self._count(f"speculative step, {kept} of its drafts accepted")
        if then == 1:
            self._run([(seq_id, [seed % VOCAB])])
            self._count("decode right after a verification")
        elif then == 3 and a < k:
            self._make_room(1, keep=seq_id)
            self._start(self._fit_prompt(drafted))
            new = self.next_id - 1
            self._count("add (a prompt repeating rejected drafts)")
            self._run([(new, self.pending[new][: self._chunk_limit(None)])])

    @precondition(lambda self: self.plan.copy_on_write and bool(self._forkable()))
    @rule(which=PICK, write=st.booleans(), token=PICK)
    def fork(self, which: int, write: bool, token: int) -> None:
        """Share a sequence's blocks with a new child; with ``write``, both decode at once."""
        parents = self._forkable()
        self._make_room(1, keep=parents[which % len(parents)])
        parents = self._forkable()
        parent = parents[which % len(parents)]
        child = self._fork(parent)
        self._count("fork")
        if write:
            self._run([(child, [token]), (parent, [(token + 1) % VOCAB])])

    @precondition(lambda self: len(self.pending) >= 2 or (bool(self.pending) and self._half_full()))
    @rule(which=PICK)
    def free(self, which: int) -> None:
        live = sorted(self.pending)
        self._free(live[which % len(live)])
        self._count("free")

    @precondition(lambda self: self._half_full())
    @rule(seed=SEED)
    def allocation_failure(self, seed: int) -> None:
        """A prompt one block larger than what is left: the step must leave it out."""
        self._make_room(1)
        m = self.ls.manager
        prompt = draw_tokens(seed, (m.pool.num_available + 1) * self.block_size, offset=VOCAB)
        seq_id = self._new_id()
        self.ls.add(seq_id, prompt)
        ran = self.ls.step([(seq_id, prompt)])
        assert not ran, "internal error: an allocation larger than the pool succeeded"
        self.ls.free(seq_id)
        self._count("allocation failure (prompt larger than the free pool)")

    @precondition(lambda self: bool(self._rare_states()))
    @rule(kind=st.integers(0, 3), data=st.data())
    def rare(self, kind: int, data: st.DataObject) -> None:
        """One of the states random programs seldom reach, chosen among those reachable now.

        A long prompt (long-context examples), a prefix-cache eviction then the
        prompt that would have hit the evicted block, forks of forks, or a free
        in the middle of a chain of forks. One rule for all, so that the rules
        Hypothesis draws are mostly enabled.
        """
        states = self._rare_states()
        name = states[kind % len(states)]
        if name == "long":
            self._add_long(data.draw(long_prompts(self.plan.envelope), label="long prompt"))
        elif name == "evict":
            self._evict_then_reprompt(data.draw(PICK), data.draw(SEED), data.draw(PICK))
        elif name == "resend":
            self._resend(data.draw(PICK), data.draw(PICK))
        elif name == "fork chain":
            self._fork_chain(data.draw(PICK), data.draw(st.integers(2, 3)), data.draw(PICK))
        else:
            self._free_middle_of_chain(data.draw(PICK), data.draw(PICK))

    def _rare_states(self) -> list[str]:
        states = []
        if self._long_room() >= self.plan.envelope.long_prompts[0]:
            states.append("long")
        if self._can_evict():
            states.append("evict")
        if self.plan.copy_on_write and self._room(3) and self._forkable():
            states.append("fork chain")
        if self._chain_middles():
            states.append("free middle")
        if self.plan.kind == "groups" and self.computed:
            states.append("resend")
        return states

    def _resend(self, which: int, token: int) -> None:
        """An earlier prompt sent again whole (every group's hits), run, then decoded."""
        self._make_room(1)
        seq_id = self.next_id
        self._start(list(self.computed[which % len(self.computed)]))
        self._count("add (an earlier prompt resent whole)")
        self._run([(seq_id, self.pending[seq_id][: self._chunk_limit(None)])])
        if seq_id in self.pending and not self.pending[seq_id]:
            self._run([(seq_id, [token])])

    def _fork_chain(self, which: int, depth: int, token: int) -> None:
        """Forks of forks: a chain of ``depth`` children on one parent's blocks; then all write."""
        parents = self._forkable()
        chain = [parents[which % len(parents)]]
        for _ in range(depth):
            chain.append(self._fork(chain[-1]))
        self._count(f"fork of a fork (a chain of {depth})")
        self._run([(s, [(token + 7 * s) % VOCAB]) for s in chain])

    def _free_middle_of_chain(self, which: int, token: int) -> None:
        """Free a sequence that is both a fork's child and a fork's parent; the ends then write."""
        middles = self._chain_middles()
        middle = middles[which % len(middles)]
        ends = [self.parent_of[middle]] + [c for c, p in self.parent_of.items() if p == middle]
        self._free(middle)
        self._count("free in the middle of a chain of forks")
        self._run([(s, [(token + 7 * s) % VOCAB]) for s in sorted(set(ends)) if s in self.pending])

    def _evict_then_reprompt(self, which: int, seed: int, token: int) -> None:
        """Evict every cached block, then send the prompt that would have hit one of them."""
        m = self.ls.manager
        cached = [p for p in self.computed if m.cached_prefix(p) > 0]
        target = cached[which % len(cached)]
        filler = draw_tokens(seed, m.pool.num_available * self.block_size, offset=2 * VOCAB)
        filler_id = self.next_id
        self._start(filler)
        self._run([(filler_id, self.pending[filler_id])])
        if filler_id in self.pending:
            self._free(filler_id)
        self._count("prefix-cache eviction, then a prompt that would have hit the evicted block")
        seq_id = self.next_id
        self._start(target[: self.block_size] + draw_tokens(seed + 1, 1 + token % 3))
        self._run([(seq_id, self.pending[seq_id][: self._chunk_limit(None)])])

    @invariant()
    def spec_is_consistent(self) -> None:
        if self.lockstep is not None:
            self.lockstep.check_integrity()
            self.stats.checks["spec block-table and pool invariants"] += 1

    def teardown(self) -> None:
        try:
            if self.lockstep is not None:
                pool = self.lockstep.manager.pool
                self.stats.rules["prefix-cache evictions (spec pool)"] += pool.num_evictions
                try:
                    self.lockstep.finish()
                except ConformanceFailure as failure:
                    self._found(failure)
                    raise
        finally:
            self.on_example()
        if self.deferred is not None:
            raise self.deferred

    # -- internals --------------------------------------------------------------------
