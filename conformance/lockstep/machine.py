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

What an example starts with depends on its pass (:data:`conformance.lockstep.plan.PASSES`):

* **long**: a prompt of hundreds to thousands of tokens prefilled in large
  chunks, then decoded, so sequences pass the 64-key tiles and the
  256/512/1024-key switch points of a kernel;
* **wide** and **production**: 16 to 32 sequences (64 to 256 on a device)
  prefilled together, then a step that mixes a decode of every one of them
  with several new prompts' prefill chunks;
* **large pool**: a prompt placed in the blocks past 2^31 elements;
* **groups**: layers in two KV cache groups (:mod:`conformance.lockstep.groups`), memory
  through the spec's :class:`~spec.cache_manager.CacheManager`, and a prompt
  of a window and a block more, prefilled then decoded, so that the
  windowed group releases blocks from the first decode on, then forked and
  decoded; later rules fork it, hit its prefix and resend whole prompts;
* **short**: one sequence, not yet run.

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

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conformance.bounds.checker import BoundsChecker
from conformance.judges.coverage import Coverage
from conformance.judges.numerics import Margins
from conformance.judges.oracle import OracleChoice
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.envelope import Envelope
from conformance.lockstep.groups import group_label
from conformance.lockstep.pairs import planned_pairs, split_keys
from conformance.lockstep.plan import (
    MANY_PARTS,
    MAX_DRAFT,
    OPENS_WITH_PAIRS,
    Plan,
    many_parts_keys,
)
from conformance.lockstep.spec_side import SpecSide
from conformance.lockstep.variants import label
from conformance.lockstep.workload import WorkloadConfig
from spec.backend import Backend
from spec.block_manager import cdiv

VOCAB = 64
_SEED = st.integers(0, 2**16)
_PICK = st.integers(0, 63)
_SUBSET = st.integers(0, 2**64 - 1)
"""A subset of the live sequences, as bits (0: all of them)."""
MAX_LONG_PROMPTS = 2
"""Long prompts per workload at most: each costs seconds on an interpreted kernel."""
_JOINERS = 3
"""New prompts that join a wide example's first full step of decodes."""


@dataclass
class RunStats:
    """What a run exercised: examples, steps, rules applied, checks made, skips, coverage."""

    examples: int = 0
    steps: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    configs: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)  # attention the backend cannot run
    drawn: Counter[str] = field(default_factory=Counter)  # examples per variant, dtype, KV dtype
    coverage: Coverage = field(default_factory=Coverage)
    margins: Margins = field(default_factory=Margins)  # how close the outputs came to failing
    longest: int = 0  # the most tokens any sequence held when a step ran
    specialisations: set[str] = field(default_factory=set)  # compiled kernels' keys launched
    call_seconds: dict[str, float] = field(default_factory=dict)  # backend time, by call
    compiles: int = 0  # Triton kernels compiled during the run (compiled Triton only)
    compile_seconds: float = 0.0  # their compile (or disk-cache load) time, within call_seconds
    first_failure_example: int | None = None  # examples run when the first failure appeared

    def note_failure(self) -> None:
        if self.first_failure_example is None:
            self.first_failure_example = self.examples

    def add(self, other: RunStats) -> None:
        """Count ``other``'s examples in these stats too (the shards of one run, merged).

        The first failure's example is not added: it is the merged run's headline's to set.
        """
        self.examples += other.examples
        self.steps += other.steps
        for mine, theirs in (
            (self.rules, other.rules),
            (self.checks, other.checks),
            (self.configs, other.configs),
            (self.skips, other.skips),
            (self.drawn, other.drawn),
        ):
            mine.update(theirs)
        self.coverage.add(other.coverage)
        self.margins.add(other.margins)
        self.longest = max(self.longest, other.longest)
        self.specialisations |= other.specialisations
        for call, seconds in other.call_seconds.items():
            self.call_seconds[call] = self.call_seconds.get(call, 0.0) + seconds
        self.compiles += other.compiles
        self.compile_seconds += other.compile_seconds


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


def long_prompts(env: Envelope) -> st.SearchStrategy[LongPrompt]:
    """Long prompts of the envelope: often just past a switch point or at the limit."""
    lengths = st.one_of(st.sampled_from(env.long_lengths), st.integers(*env.long_prompts))
    return st.builds(
        LongPrompt,
        lengths,
        st.sampled_from(env.long_chunks),
        st.booleans(),
        st.integers(1, 3),
        _SEED,
        _PICK,
    )


class LockstepMachine(RuleBasedStateMachine):
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
        return split_keys(self.plan.capabilities, self.plan.envelope.device)

    def _count(self, name: str) -> None:
        self.stats.rules[name] += 1

    def _room(self, more: int = 1) -> bool:
        return len(self.pending) + more <= self.plan.max_live

    # -- rules ------------------------------------------------------------------------

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        paths = self.stats.coverage.paths
        if not paths.planned:
            caps, device = self.plan.capabilities, self.plan.envelope.device
            wanted, why = planned_pairs(caps, device)
            how = "" if caps.decode_split is None else caps.decode_split.describe()
            paths.plan(wanted, why, split_keys(caps, device), how)
        config: WorkloadConfig = data.draw(self.plan.configs(), label="config")
        self.stats.examples += 1  # one the backend can run (a draw its limits rule out is not)
        self.stats.configs[_shape(config, self.plan.kind)] += 1
        self.stats.drawn.update(drawn_names(config))
        if self.draw_only:
            self.lockstep = SpecSide(config)
        else:
            self.lockstep = self._lockstep(config)
        if self.plan.kind == "split":
            seed, token = data.draw(_SEED, label="seed"), data.draw(_PICK, label="token")
            chunk = data.draw(st.sampled_from(self.plan.envelope.long_chunks), label="chunk")
            self._start_split(seed, chunk, token)
        elif self.plan.long_context:  # every long-context workload starts with a long prompt
            self._add_long(data.draw(long_prompts(self.plan.envelope), label="long prompt"))
        elif self.plan.wide:
            self._start_wide(data)
        elif self.plan.kind == "groups":
            self._start_groups(data)
        elif self.plan.kind in OPENS_WITH_PAIRS:
            self._start_pairs(data.draw(_SEED, label="seed"), data.draw(_PICK, label="token"))
        else:  # a first sequence, so that every rule can run from the first step on
            self.add(data.draw(st.integers(0, 5), label="length"), data.draw(_SEED), False, 0)

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

    def _start_pairs(self, seed: int, token: int) -> None:
        """Every kernel path, in order (:mod:`conformance.lockstep.pairs`): a prompt a block past
        a split-KV context, prefilled in two chunks (prefill, then a chunk after cached
        context), decoded alone (split-KV decode), decoded together with a new prompt's
        prefill (mixed); that prompt decoded alone (single-pass decode); then a prompt that
        hits the first one's prefix, its chunk run after the cached blocks beside a decode
        (a mixed call with cached context). In a large pool,
        all of it lies past 2^31 elements, so a kernel's cached-context loop runs there."""
        b = self.block_size
        where = " in the blocks past 2^31 elements" if self.plan.kind == "large pool" else ""
        self._count(f"add (a prompt past a split-KV context, every kernel path{where})")
        seq_id = self.next_id
        prompt = _tokens(seed, self._fit_length(self._split_keys + b + 1))
        self._start(prompt)
        chunk = self._chunk_limit(max(1, len(prompt) // 2))
        while self.pending.get(seq_id):
            if not self._run([(seq_id, self.pending[seq_id][:chunk])]):
                return  # the pool ran out: the sequence stays pending for later steps
        self._run([(seq_id, [token])])
        joiner = self.next_id
        self._start(_tokens(seed + 1, self._fit_length(b + 1)))
        self._run([(seq_id, [(token + 1) % VOCAB]), (joiner, self.pending[joiner])])
        if joiner in self.pending and not self.pending[joiner]:
            self._run([(joiner, [(token + 2) % VOCAB])])
        if self.ls.config.prefix_caching and len(prompt) > 2 * b:
            hit = self.next_id
            self._start(self._fit_prompt(prompt[: 2 * b] + _tokens(seed + 2, b + 1)))
            chunk_after_hit = (hit, self.pending[hit][: self._chunk_limit(None)])
            done = [
                (s, [(token + 3) % VOCAB]) for s, rest in sorted(self.pending.items()) if not rest
            ]
            self._run([chunk_after_hit, *done[:1]])  # with a decode: cached context, mixed
        self._draft_across_a_block(seed + 3, token, long=seq_id)

    def _start_split(self, seed: int, chunk: int, token: int) -> None:
        """A prompt whose lone decode the backend's plan splits into :data:`MANY_PARTS` parts or
        more (:func:`~conformance.lockstep.plan.many_parts_keys`), prefilled in large chunks;
        decoded alone, then beside a new prompt's prefill (a mixed call), then alone again."""
        keys = many_parts_keys(self.plan.capabilities)
        assert keys is not None, "the split pass runs only where the plan splits so"
        self._count(f"add (a prompt whose decode the backend splits into {MANY_PARTS}+ parts)")
        self.long_prompts += 1
        seq_id = self.next_id
        self._start(_tokens(seed, self._fit_length(keys)))
        chunk_size = self._chunk_limit(chunk)
        while self.pending.get(seq_id):
            if not self._run([(seq_id, self.pending[seq_id][:chunk_size])]):
                return  # the pool ran out: the sequence stays pending for later steps
        self._run([(seq_id, [token])])
        joiner = self.next_id
        self._start(_tokens(seed + 1, self._fit_length(self.block_size + 1)))
        self._run([(seq_id, [(token + 1) % VOCAB]), (joiner, self.pending[joiner])])
        self._run([(seq_id, [(token + 2) % VOCAB])])

    def _draft_across_a_block(self, seed: int, token: int, long: int | None = None) -> None:
        """A sequence past every layer's window, ending a slot before a block boundary (a new
        prompt, a few tokens long without a window; with a window longer than a few blocks,
        the opening's ``long`` one, a chunk added to reach the boundary, when it is still
        live: a second prompt past a window of a thousand keys costs as much again); a
        speculative step whose drafts cross into a block that does not follow its last one
        in the pool (a new prompt's block comes between; the window edge inside the row);
        one draft accepted, two rejected; a decode that overwrites one rejected slot and
        must not see the other; then a fork whose parent and child both write the shared
        partial block (copy-on-write)."""
        k = min(3, self.plan.max_draft)
        if not k:
            return
        b = self.block_size
        layers = range(self.ls.config.geometry.num_layers)
        window = max((self.ls.config.variant(x).window or 0 for x in layers), default=0)
        m = self.ls.manager
        if (
            long is not None
            and window > 4 * b
            and long in self._forkable()
            and (m.num_tokens(long) >= window + 2)
        ):
            self._make_room(2, keep=long)
            seq_id = long
            pad = (b - 1 - m.num_tokens(seq_id) % b) % b
            if pad and not self._run([(seq_id, _tokens(seed, pad))]):
                return  # the pool ran out
        else:
            self._make_room(3)
            length = self._fit_length(cdiv(window + 2, b) * b - 1)
            seq_id = self.next_id
            self._start(_tokens(seed, length))
            while self.pending.get(seq_id):
                if not self._run([(seq_id, self.pending[seq_id][: self._chunk_limit(None)])]):
                    return  # the pool ran out
        self._count("speculative step across a block boundary (constructed)")
        spacer = self.next_id  # its block comes first: the drafts' block is not the next one
        self._start(_tokens(seed + 2, 1))
        row = (seq_id, _tokens(seed + 1, 1 + k))
        self._run([(spacer, self.pending[spacer]), row], drafts={seq_id: k})
        if not self.ls.manager.num_drafts(seq_id):
            return  # left out: past max_context_len
        self.ls.verify(seq_id, max(0, k - 2))
        self._run([(seq_id, [token])])  # reads the verified tokens only
        if self.plan.copy_on_write and seq_id in self._forkable():
            child = self._fork(seq_id)
            self._count("fork (both write the shared partial block, constructed)")
            self._run([(child, [(token + 1) % VOCAB]), (seq_id, [(token + 2) % VOCAB])])

    def _start_wide(self, data: st.DataObject) -> None:
        """Many prompts prefilled together, then their decodes mixed with new prefill chunks."""
        width = data.draw(st.sampled_from(self.plan.widths), label="width")
        kinds = data.draw(st.lists(st.integers(0, 5), min_size=width, max_size=width))
        seed = data.draw(_SEED, label="seed")
        for j, kind in enumerate(kinds):
            self._start(_tokens(seed + j, self._prompt_length(kind)))
        for _ in range(4):  # prompts are at most 2B + 1 tokens: three chunks of B
            if not any(self.pending.values()):
                break
            self.step_all(seed % VOCAB)
        joiners = []
        for j in range(_JOINERS):
            joiners.append(self.next_id)
            self._start(_tokens(seed + width + j, self.block_size + 1))
        self._count(f"wide step: {width} decodes with {_JOINERS} new prompts' prefill chunks")
        decodes = [
            (s, [(seed + 7 * s) % VOCAB]) for s, todo in sorted(self.pending.items()) if not todo
        ]
        self._run(decodes + [(s, self.pending[s]) for s in joiners])

    def _start_groups(self, data: st.DataObject) -> None:
        """A prompt past the window and past a split-KV context, prefilled in chunks (or
        whole), two decodes (the full-attention group's on the split-KV path), then a fork of
        it and a decode of both (the window has released blocks by then)."""
        b = self.block_size
        window = max((w for w in self.ls.config.group_windows if w is not None), default=b)
        seq_id = self.next_id
        length = self._fit_length(max(window, self._split_keys) + b + 1)
        self._start(_tokens(data.draw(_SEED, label="seed"), length))
        chunk = data.draw(st.sampled_from((b, None)), label="chunk")
        chunk = self._chunk_limit(None if chunk is None else max(chunk, cdiv(length, 4)))
        self._count("add (a prompt past the window and a split-KV context)")
        while self.pending.get(seq_id):
            if not self._run([(seq_id, self.pending[seq_id][:chunk])]):
                break  # the pool ran out: the sequence stays pending for later steps
        for token in range(2):
            if any(not rest for rest in self.pending.values()):
                self.decode(token)
        if self._room(2):  # a new prompt's prefill beside the decodes: the mixed path
            joiner = self.next_id
            self._start(_tokens(seq_id + 11, self._fit_length(b + 1)))
            decodes = [(s, [3]) for s, rest in sorted(self.pending.items()) if not rest]
            self._run([*decodes, (joiner, self.pending[joiner][:chunk])])
        if self.plan.copy_on_write and seq_id in self._forkable():
            self._fork(seq_id)  # sharing what the window left; both then write their last block
            self._count("fork (of a sequence whose window released blocks)")
            self.decode(2)

    @rule(length=st.integers(0, 5), seed=_SEED, then_step=st.booleans(), token=_PICK)
    def add(self, length: int, seed: int, then_step: bool, token: int) -> None:
        """A new sequence; with ``then_step``, a step of every live sequence follows."""
        self._make_room(1)
        self._count(f"add (prompt length {('1', 'B-1', 'B', 'B+1', '2B+1', '5')[length]})")
        self._start(_tokens(seed, self._prompt_length(length)))
        if then_step:
            self.step_all(token)

    @precondition(lambda self: bool(self.prompts))
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
        self._make_room(1)
        pool = self.computed or self.prompts
        earlier = pool[which % len(pool)]
        prompt = earlier[: blocks * self.block_size] + _tokens(seed, tail)
        self._count("add (sharing an earlier prompt's prefix)")
        self._start(self._fit_prompt(prompt))
        if then_step:
            self.step_all(token)

    def _add_long(self, long: LongPrompt) -> None:
        n = min(long.length, self._long_room())
        if n < 1:
            return
        self.long_prompts += 1
        lo, hi = self.plan.envelope.long_prompts
        self._count(f"add (long prompt, {lo}..{hi} tokens)")
        seq_id = self.next_id
        self._start(_tokens(long.seed, n))
        chunk = self._chunk_limit(long.chunk)
        while self.pending.get(seq_id):
            todo = self.pending[seq_id]
            done = [s for s, rest in sorted(self.pending.items()) if not rest]
            token = long.token
            decoding = [(s, [(token + 7 * s) % VOCAB]) for s in done] if long.with_decodes else []
            if not self._run([(seq_id, todo[:chunk]), *decoding]):
                break  # the pool ran out: the sequence stays pending for later steps
        for i in range(long.decodes):
            if any(not rest for rest in self.pending.values()):
                self.decode((long.token + i) % VOCAB)

    @precondition(lambda self: bool(self.pending))
    @rule(subset=_SUBSET, chunk=st.integers(0, 4), token=_PICK)
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
    @rule(token=_PICK)
    def decode(self, token: int) -> None:
        """One new token for every sequence whose prompt is done."""
        done = [s for s, todo in sorted(self.pending.items()) if not todo]
        self._run([(s, [(token + 7 * s) % VOCAB]) for s in done])

    @precondition(lambda self: bool(self.pending))
    @rule(token=_PICK)
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
        which=_PICK,
        k=st.integers(0, MAX_DRAFT),
        accepted=st.integers(0, MAX_DRAFT),
        seed=_SEED,
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
        tokens = _tokens(seed, 1 + k)
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
    @rule(which=_PICK, write=st.booleans(), token=_PICK)
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
    @rule(which=_PICK)
    def free(self, which: int) -> None:
        live = sorted(self.pending)
        self._free(live[which % len(live)])
        self._count("free")

    @precondition(lambda self: self._half_full())
    @rule(seed=_SEED)
    def allocation_failure(self, seed: int) -> None:
        """A prompt one block larger than what is left: the step must leave it out."""
        self._make_room(1)
        m = self.ls.manager
        prompt = _tokens(seed, (m.pool.num_available + 1) * self.block_size, offset=VOCAB)
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
            self._evict_then_reprompt(data.draw(_PICK), data.draw(_SEED), data.draw(_PICK))
        elif name == "resend":
            self._resend(data.draw(_PICK), data.draw(_PICK))
        elif name == "fork chain":
            self._fork_chain(data.draw(_PICK), data.draw(st.integers(2, 3)), data.draw(_PICK))
        else:
            self._free_middle_of_chain(data.draw(_PICK), data.draw(_PICK))

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
        filler = _tokens(seed, m.pool.num_available * self.block_size, offset=2 * VOCAB)
        filler_id = self.next_id
        self._start(filler)
        self._run([(filler_id, self.pending[filler_id])])
        if filler_id in self.pending:
            self._free(filler_id)
        self._count("prefix-cache eviction, then a prompt that would have hit the evicted block")
        seq_id = self.next_id
        self._start(target[: self.block_size] + _tokens(seed + 1, 1 + token % 3))
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
        limit = self.plan.capabilities.max_context_len
        return n if limit is None else max(1, min(n, limit - 1))

    def _fit_prompt(self, prompt: list[int]) -> list[int]:
        return prompt[: self._fit_length(len(prompt))]

    def _chunk_limit(self, limit: int | None) -> int | None:
        """A prefill chunk size the backend can attend: capped by ``max_query_len`` (when > 1),
        and whole prompts when it has no chunked prefill."""
        caps = self.plan.capabilities
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
        limit = self.plan.capabilities.max_context_len
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


def drawn_names(config: WorkloadConfig) -> set[str]:
    """What an example drew, as the report counts it: its dtype, KV dtype, latent layout and
    layers' variants (combined ones by their names joined in alphabetical order,
    "alibi+sinks" say, as :mod:`conformance.lockstep.pairs` names them)."""
    g = config.geometry
    names = {g.dtype, g.kv_dtype or f"KV {g.dtype}"}
    if g.is_latent:
        names.add(f"latent {g.latent_dim}+{g.rope_dim}")
    for layer in range(g.num_layers):
        features = sorted(config.variant(layer).features)
        names.update(features)
        if len(features) > 1:
            names.add("+".join(features))
    return names


def _shape(config: WorkloadConfig, kind: str) -> str:
    g = config.geometry
    extra = {"short": "", "long": " long-context", "groups": ""}.get(kind, f" {kind}")
    width = f"latent {g.latent_dim}+{g.rope_dim}" if g.is_latent else f"D={g.head_dim}"
    shape = f"{g.dtype} B={g.block_size} H={config.num_heads}/{g.num_kv_heads} {width}"
    return shape + label(config) + group_label(config) + extra  # fp8, variants, groups


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
