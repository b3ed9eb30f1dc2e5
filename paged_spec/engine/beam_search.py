"""Beam search on the paged engine: beams fork and die every step, and copy-on-write does the work.

Every step each live beam proposes its best next tokens; the ``width`` best
candidates over all beams continue (score: the sum of the tokens' log
probabilities; ties go to the smaller token sequence, so that any two
implementations pick the same beams). A beam with several survivors forks
(:meth:`spec.cache_manager.CacheManager.fork`: the children share every
block); a beam with none is freed. Each survivor then writes its new token:
into a block of its own, or, where its last block is shared and partly
filled, into a fresh copy of it (copy-on-write, executed by the backend
before the step's writes).

:func:`paged_beam_search` runs it through the spec's memory side and a
backend and records the blocks it holds at every step against what full
clones of every beam would hold; :func:`contiguous_beam_search` is the plain
reference (each beam recomputed alone with contiguous attention). They must
return the same beams: the same tokens, and scores equal up to float32 rounding.

The classic example, a 20-token prompt at width 4 with 16-token blocks: the
first fork shares the prompt's 2 blocks (2 held where clones take 8); the
first write copies the shared partial block for all but the last writer:

>>> from spec.backend import ReferenceBackend
>>> from paged_spec.engine.tiny_model import F64, TinyModel
>>> model = TinyModel()
>>> beams, steps = paged_beam_search(model, ReferenceBackend(), tuple(range(20)), 4, 3)
>>> first = steps[0]
>>> first.forks, first.held_at_fork, first.clones, first.copies, first.held
(3, 2, 8, 3, 5)
>>> plain = contiguous_beam_search(model, tuple(range(20)), 4, 3)
>>> [b.tokens for b in beams] == [b.tokens for b in plain]
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from paged_spec.engine.tiny_model import F64, TinyModel
from spec.backend import Backend
from spec.cache_manager import CacheManager
from spec.errors import ArgumentValueError, OutOfBlocksError
from spec.validate import check_positive, check_token_ids

__all__ = ["Beam", "BeamStep", "contiguous_beam_search", "format_steps", "paged_beam_search"]


@dataclass(frozen=True)
class Beam:
    """A hypothesis: its generated tokens and their summed log probability."""

    tokens: tuple[int, ...]
    score: float


@dataclass(frozen=True)
class BeamStep:
    """The memory of one step of the paged search.

    ``held_at_fork``: distinct blocks after the step's forks and frees, before
    any write ("2 vs 8"); ``held``: after its writes, copies
    included; ``clones``: what the same beams would hold as full copies.
    """

    step: int
    beams: int
    forks: int
    freed: int
    copies: int
    held_at_fork: int
    held: int
    clones: int


def select(beams: Sequence[Beam], logprobs: Sequence[F64], width: int) -> list[tuple[int, Beam]]:
    """The ``width`` best ``(parent index, beam)`` continuations, best first.

    Each beam proposes its ``width`` most likely tokens (no more can survive
    from one beam; among equally likely ones the smaller tokens); ties on the
    score go to the smaller token sequence.
    """
    candidates = []
    for i, (beam, lp) in enumerate(zip(beams, logprobs, strict=True)):
        for token in np.argsort(-lp, kind="stable")[:width].tolist():
            candidates.append((i, Beam((*beam.tokens, token), beam.score + float(lp[token]))))
    candidates.sort(key=lambda c: (-c[1].score, c[1].tokens))
    return candidates[:width]


def _logprobs(model: TinyModel, hidden: F64) -> list[F64]:
    """Each row's log softmax over the vocabulary."""
    logits = model.logits(hidden)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return list(shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True)))


def contiguous_beam_search(
    model: TinyModel, prompt: Sequence[int], width: int, steps: int
) -> list[Beam]:
    """The reference: every beam recomputed alone, contiguous attention, no paging, no sharing."""
    prompt, width, steps = _checked(prompt, width, steps)
    beams = [Beam((), 0.0)]
    for _ in range(steps):
        hidden = [model.extend([], prompt + b.tokens)[0][-1:] for b in beams]
        beams = [b for _, b in select(beams, _logprobs(model, np.concatenate(hidden)), width)]
    return beams


def paged_beam_search(
    model: TinyModel,
    backend: Backend,
    prompt: Sequence[int],
    width: int,
    steps: int,
    *,
    block_size: int = 16,
    num_blocks: int = 64,
) -> tuple[list[Beam], list[BeamStep]]:
    """Beam search through the spec's memory side and ``backend``; the beams and each step's memory.

    The prompt is computed once; after that each step computes one token per
    live beam. The last step's tokens are chosen but never fed back, so they
    hold no KV. Raises :class:`OutOfBlocksError` if the pool cannot hold the beams.
    """
    prompt, width, steps = _checked(prompt, width, steps)
    backend.create_cache(model.geometry(num_blocks, block_size))
    cache = CacheManager(num_blocks, block_size)
    if not cache.can_admit(prompt, len(prompt)):
        raise OutOfBlocksError(f"beam search: the prompt needs more than {num_blocks} blocks")
    cache.admit(0, prompt, len(prompt))
    hidden, _ = _run(model, backend, cache, [(0, (*prompt,))])
    live, beams, record = [0], [Beam((), 0.0)], []
    for step in range(1, steps + 1):
        chosen = select(beams, _logprobs(model, hidden), width)
        beams = [b for _, b in chosen]
        if step == steps:  # the last tokens are chosen, never fed back
            break
        parents = [live[i] for i, _ in chosen]
        freed = [s for s in live if s not in parents]
        for seq in freed:
            cache.release(seq)
        live = _fork(cache, parents)
        at_fork = cache.pool.num_held
        rows = [(seq, (beam.tokens[-1],)) for seq, beam in zip(live, beams, strict=True)]
        for seq, token in rows:
            if not cache.can_grow(seq, 1):
                raise OutOfBlocksError(f"beam search: {num_blocks} blocks cannot hold the beams")
            cache.grow(seq, token)
        hidden, copies = _run(model, backend, cache, rows)
        clones = sum(len(cache.manager.block_table(s)) for s in live)
        forks = len(live) - len(set(parents))
        held = cache.pool.num_held
        record.append(BeamStep(step, len(live), forks, len(freed), copies, at_fork, held, clones))
    for seq in live:
        cache.release(seq)
    return beams, record


def _fork(cache: CacheManager, parents: Sequence[int]) -> list[int]:
    """One sequence per survivor: a beam's first survivor continues it, each later one forks it."""
    live: list[int] = []
    next_id = 1 + max(cache.manager.sequence_ids())
    for parent in parents:
        if parent in live:
            cache.fork(parent, next_id)
            live.append(next_id)
            next_id += 1
        else:
            live.append(parent)
    return live


def _run(
    model: TinyModel,
    backend: Backend,
    cache: CacheManager,
    rows: Sequence[tuple[int, tuple[int, ...]]],
) -> tuple[F64, int]:
    """Lay out one step, execute its copies and forward pass: the rows' last hidden states,
    and how many copy-on-write copies the step made."""
    batch = cache.layout([(seq, len(tokens)) for seq, tokens in rows])
    if batch.copies:
        backend.copy_blocks(batch.copies)
    token_ids = [t for _, tokens in rows for t in tokens]
    hidden = model.forward_paged(token_ids, batch, backend)
    last = hidden[[batch.query_start_loc[i + 1] - 1 for i in range(batch.num_seqs)]]
    return last, len(batch.copies)


def _checked(prompt: Sequence[int], width: int, steps: int) -> tuple[tuple[int, ...], int, int]:
    tokens = check_token_ids("prompt", prompt)
    if not tokens:
        raise ArgumentValueError("prompt must hold at least one token, got ()")
    return tokens, check_positive("width", width), check_positive("steps", steps)


def format_steps(record: Sequence[BeamStep]) -> str:
    """The per-step table the engine demo prints."""
    head = "step  beams  forks  freed  copies  held at fork  held  full clones"
    lines = [head]
    for s in record:
        lines.append(
            f"{s.step:>4}  {s.beams:>5}  {s.forks:>5}  {s.freed:>5}  {s.copies:>6}  "
            f"{s.held_at_fork:>12}  {s.held:>4}  {s.clones:>11}"
        )
    return "\n".join(lines)
