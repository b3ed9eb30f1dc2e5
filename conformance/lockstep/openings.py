"""What each pass's examples start with, constructed: the openings that reach every kernel path.

A short example starts with one sequence, not yet run; the others open with
what a chance draw would rarely reach (:data:`conformance.lockstep.plan.PASSES`):

* **long**: a prompt of hundreds to thousands of tokens prefilled in large
  chunks, then decoded, so sequences pass the 64-key tiles and the
  256/512/1024-key switch points of a kernel;
* **split**: a prompt whose lone decode the backend's plan splits into more
  than 8 parts;
* **wide** and **production**: 16 to 32 sequences (64 to 256 on a device)
  prefilled together, then a step that mixes a decode of every one of them
  with several new prompts' prefill chunks;
* **feature** and **large pool**: every kernel path with the pass's feature (a
  prompt past a split-KV context: prefill, a chunk after cached context, a
  split-KV decode, a mixed step, a prefix hit), then a speculative step whose
  drafts cross a block boundary; the large pool's all past 2^31 elements;
* **groups**: a prompt past the window and a split-KV context in two KV cache
  groups, decoded as the windowed group releases blocks, then forked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from conformance.lockstep.envelope import Envelope
from conformance.lockstep.plan import (
    MANY_PARTS,
    many_parts_keys,
)
from conformance.lockstep.sequences import PICK, SEED, VOCAB, LiveSequences, draw_tokens
from spec.block_manager import cdiv

_JOINERS = 3
"""New prompts that join a wide example's first full step of decodes."""


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
        SEED,
        PICK,
    )


class Openings(LiveSequences):
    """The constructed openings of the passes, on the example's live sequences."""

    decode: Callable[[int], None]  # the machine's rules: one token for each finished sequence,
    step_all: Callable[[int], None]  # and a step of every live sequence

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
        prompt = draw_tokens(seed, self._fit_length(self._split_keys + b + 1))
        self._start(prompt)
        chunk = self._chunk_limit(max(1, len(prompt) // 2))
        while self.pending.get(seq_id):
            if not self._run([(seq_id, self.pending[seq_id][:chunk])]):
                return  # the pool ran out: the sequence stays pending for later steps
        self._run([(seq_id, [token])])
        joiner = self.next_id
        self._start(draw_tokens(seed + 1, self._fit_length(b + 1)))
        self._run([(seq_id, [(token + 1) % VOCAB]), (joiner, self.pending[joiner])])
        if joiner in self.pending and not self.pending[joiner]:
            self._run([(joiner, [(token + 2) % VOCAB])])
        if self.ls.config.prefix_caching and len(prompt) > 2 * b:
            hit = self.next_id
            self._start(self._fit_prompt(prompt[: 2 * b] + draw_tokens(seed + 2, b + 1)))
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
        keys = many_parts_keys(self.plan.caps)
        assert keys is not None, "the split pass runs only where the plan splits so"
        self._count(f"add (a prompt whose decode the backend splits into {MANY_PARTS}+ parts)")
        self.long_prompts += 1
        seq_id = self.next_id
        self._start(draw_tokens(seed, self._fit_length(keys)))
        chunk_size = self._chunk_limit(chunk)
        while self.pending.get(seq_id):
            if not self._run([(seq_id, self.pending[seq_id][:chunk_size])]):
                return  # the pool ran out: the sequence stays pending for later steps
        self._run([(seq_id, [token])])
        joiner = self.next_id
        self._start(draw_tokens(seed + 1, self._fit_length(self.block_size + 1)))
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
            if pad and not self._run([(seq_id, draw_tokens(seed, pad))]):
                return  # the pool ran out
        else:
            self._make_room(3)
            length = self._fit_length(cdiv(window + 2, b) * b - 1)
            seq_id = self.next_id
            self._start(draw_tokens(seed, length))
            while self.pending.get(seq_id):
                if not self._run([(seq_id, self.pending[seq_id][: self._chunk_limit(None)])]):
                    return  # the pool ran out
        self._count("speculative step across a block boundary (constructed)")
        spacer = self.next_id  # its block comes first: the drafts' block is not the next one
        self._start(draw_tokens(seed + 2, 1))
        row = (seq_id, draw_tokens(seed + 1, 1 + k))
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
        seed = data.draw(SEED, label="seed")
        for j, kind in enumerate(kinds):
            self._start(draw_tokens(seed + j, self._prompt_length(kind)))
        for _ in range(4):  # prompts are at most 2B + 1 tokens: three chunks of B
            if not any(self.pending.values()):
                break
            self.step_all(seed % VOCAB)
        joiners = []
        for j in range(_JOINERS):
            joiners.append(self.next_id)
            self._start(draw_tokens(seed + width + j, self.block_size + 1))
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
        self._start(draw_tokens(data.draw(SEED, label="seed"), length))
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
            self._start(draw_tokens(seq_id + 11, self._fit_length(b + 1)))
            decodes = [(s, [3]) for s, rest in sorted(self.pending.items()) if not rest]
            self._run([*decodes, (joiner, self.pending[joiner][:chunk])])
        if self.plan.copy_on_write and seq_id in self._forkable():
            self._fork(seq_id)  # sharing what the window left; both then write their last block
            self._count("fork (of a sequence whose window released blocks)")
            self.decode(2)

    def _add_long(self, long: LongPrompt) -> None:
        n = min(long.length, self._long_room())
        if n < 1:
            return
        self.long_prompts += 1
        lo, hi = self.plan.envelope.long_prompts
        self._count(f"add (long prompt, {lo}..{hi} tokens)")
        seq_id = self.next_id
        self._start(draw_tokens(long.seed, n))
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
