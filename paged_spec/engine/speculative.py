"""Speculative decoding in the engine loop: drafts, one verification step, exact output.

Before each step the engine proposes drafts for every running sequence
(:meth:`spec.scheduler.ContinuousScheduler.propose`) from a drafter:

* **layer skip** (the default, :class:`LayerSkipDrafter`): a smaller model
  made of the target's first layer and its unembedding, run autoregressively
  ``k`` times with the request's own sampling (greedy, or the same seeded
  noise per position that the target uses), so it agrees with the target
  whenever one layer already decides the token;
* **n-gram** (:func:`ngram_drafts`, prompt lookup): find the latest earlier
  place where the sequence's last ``n`` tokens occurred and propose the
  tokens that followed there (free, but the tiny model seldom repeats itself).

The scheduler gives a decoding sequence's row ``1 + k`` tokens (the
last verified token and ``k`` drafts, in lookahead slots), the forward pass
computes logits at every one of them, and the engine samples the target's
token at each position exactly as plain decoding would (greedy, or seeded by
position). Greedy verification (:func:`spec.speculative.accepted_prefix`)
keeps the drafts up to the first that differs, plus the target's own token
there, so the output is token for token what plain decoding produces: only
the number of steps changes. ``update`` then verifies the drafts on the
memory side, which returns the blocks of rejected tokens to the pool.

>>> ngram_drafts([5, 6, 7, 9, 5, 6], 3)       # "5 6" occurred before: propose what followed
[7, 9, 5]
>>> ngram_drafts([1, 2, 3], 2)                # nothing repeats: no proposal
[]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from paged_spec.engine.loop import Engine
from paged_spec.engine.tiny_model import F64, TinyModel, sample
from spec.backend import Backend
from spec.request import SeqStatus
from spec.request import Sequence as Sequence_
from spec.scheduler import ContinuousScheduler, Scheduler, SchedulerOutput
from spec.speculative import accepted_prefix

NGRAM = 3
"""The longest suffix the drafter looks up (it tries shorter ones down to 1)."""


def ngram_drafts(tokens: Sequence[int], k: int, n: int = NGRAM) -> list[int]:
    """Up to ``k`` drafts: what followed the latest earlier occurrence of the last ``m`` tokens,
    for the longest ``m <= n`` that occurred before (none if no suffix did)."""
    toks = list(tokens)
    for size in range(min(n, len(toks) - 1), 0, -1):
        tail = toks[-size:]
        for start in range(len(toks) - size - 1, -1, -1):
            if toks[start : start + size] == tail:
                return toks[start + size : start + size + k]
    return []


Drafter = Callable[[Sequence_, int], list[int]]
"""Up to ``k`` drafts for a running sequence."""


def ngram_drafter(seq: Sequence_, k: int) -> list[int]:
    """The n-gram drafter over the sequence's prompt and generated tokens."""
    return ngram_drafts(seq.tokens, k)


class LayerSkipDrafter:
    """Drafts from the target's first ``num_layers`` layers: a smaller model sharing weights."""

    def __init__(self, model: TinyModel, num_layers: int = 1) -> None:
        self.model, self.num_layers = model, num_layers

    def __call__(self, seq: Sequence_, k: int) -> list[int]:
        tokens, out = list(seq.tokens), []
        for j in range(k):
            hidden, _ = self.model.extend([], tokens, num_layers=self.num_layers)
            logits = self.model.logits(hidden[-1:])[0]
            token = sample(logits, seq.request, seq.sample_index, seq.num_generated + j)
            out.append(token)
            tokens.append(token)
        return out


class SpeculativeEngine(Engine):
    """The engine loop with an n-gram drafter and verification of ``1 + k`` token rows.

    The scheduler must be a :class:`ContinuousScheduler` whose config has
    ``num_speculative_tokens > 0`` (it takes the proposals). ``drafter``
    defaults to :class:`LayerSkipDrafter` over the model's first layer.
    """

    def __init__(
        self,
        model: TinyModel,
        backend: Backend,
        scheduler: Scheduler,
        drafter: Drafter | None = None,
    ) -> None:
        super().__init__(model, backend, scheduler)
        self.drafter = LayerSkipDrafter(model) if drafter is None else drafter

    def step(self) -> SchedulerOutput:
        """Propose, then run the step in the loop's order; sample every speculative position."""
        sched = self.scheduler
        assert isinstance(sched, ContinuousScheduler), "speculation needs propose()"
        if self._t0 is None:
            self._t0 = time.perf_counter()
        self._propose(sched)
        out = sched.step()
        ex = self.executor
        ex._check_swaps(out.swap_out, out.swap_in)
        ex._swap_out(out.swap_out)
        if out.batch.copies:
            self.backend.copy_blocks(out.batch.copies)
        ex._swap_in(out.swap_in)
        sampled: dict[int, int | tuple[int, ...]] = {}
        if out.batch.num_tokens:
            hidden = self.model.forward_paged(out.token_ids, out.batch, self.backend)
            sampled = self._sample(out, hidden)
        for done in sched.update(sampled):
            self.finished[done.request_id] = done
        self.step_end_times.append(time.perf_counter() - self._t0)
        return out

    def _propose(self, sched: ContinuousScheduler) -> None:
        """Drafts for every running, decoding sequence (the scheduler decides which it takes)."""
        k = sched.config.num_speculative_tokens
        held = sched.cache.manager
        for seq in sched.sequences():
            if seq.status is SeqStatus.RUNNING and seq.seq_id in held and seq.forked:
                drafts = self.drafter(seq, k)
                if drafts:
                    sched.propose(seq.seq_id, drafts)

    def _sample(self, out: SchedulerOutput, hidden: F64) -> dict[int, int | tuple[int, ...]]:
        """A token per sample; a speculative row's: its accepted drafts, then the target's."""
        drafts = dict(out.drafts)
        sampled: dict[int, int | tuple[int, ...]] = {}
        for s in out.samples:
            request = self.requests[s.request_id]
            d = drafts.get(s.seq_id, ())
            end = out.batch.query_start_loc[s.row + 1]
            logits = self.model.logits(hidden[end - 1 - len(d) : end])
            targets = [
                sample(logits[j], request, s.sample_index, s.position + j)
                for j in range(len(d) + 1)
            ]
            sampled[s.seq_id] = accepted_prefix(d, targets)[1] if d else targets[0]
        return sampled
