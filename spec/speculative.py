"""Speculative decoding on paged memory: lookahead slots, verification, rollback.

A cheap drafter (a small model, an n-gram table, an extra head) proposes ``k``
tokens; the target model checks them all in one step. That step's row for
the sequence carries ``1 + k`` query tokens: the last verified token (sampled
last step, no KV yet) and the ``k`` drafts, causal among themselves like any
chunk (:mod:`spec.batch`). Their K/V is written like any token's, so memory
for all ``1 + k`` is allocated up front: **lookahead slots**. Then the target
accepts ``a`` drafts (``0 <= a <= k``, :func:`accepted_prefix`); the
sequence keeps ``old + 1 + a`` tokens, and the rest are rejected: their slots
still hold K/V that must never be read again.

The rules, each enforced where the state lives (``check_integrity`` asserts them):

1. **Allocation counts every block the 1 + k tokens touch**:
   :meth:`~spec.block_manager.BlockManager.blocks_needed` with ``1 + k``,
   across block boundaries and with a copy of a shared last block;
   ``append_slots(seq, tokens, num_draft=k)`` (``CacheManager.grow``) takes
   them, or raises having taken nothing. A step allocated for one token
   would write the drafts past its table.
2. **Verify or roll back.** ``verify(seq, a)`` keeps ``a`` drafts (after the
   step ran); ``rollback(seq)`` rejects them all (a preemption, a step that
   never ran). Neither may run twice, nor without drafts in flight
   (:class:`~spec.errors.SpeculationError`), and a sequence drafts again only
   after one of them.
3. **Policy: blocks holding only rejected tokens go back to the pool at
   once.** So between steps a sequence holds exactly ``ceil(t / B)`` blocks
   for its ``t`` verified tokens, the one table invariant of the spec is
   unchanged, and every step's lookahead is counted afresh (the pool may
   have given the block to someone else meanwhile). The rejected slots
   *inside* a kept block (its last) stay allocated: they lie past
   ``seq_len``, so no query reads them, and the next step overwrites them,
   position for position.
4. **The prefix cache names only verified tokens.** A block is hashed when it
   is full of verified tokens, never while it holds a draft, so no prefix hit
   can serve a rejected token, and a rollback never reaches into a hashed
   block: the one block a rollback cuts into is the partly verified last one,
   which has no hash (``check_integrity`` asserts that no block from
   ``verified // B`` on has one).
5. **Windows release by verified length.** A sliding-window group frees a
   block when the earliest query still to run no longer sees it, and that
   query is never past the first draft: after a rollback the query at the
   verified length needs the keys before it.
6. **State keeps a checkpoint.** A fixed-size state cannot be truncated, so
   a speculative step reads the sequence's own state slot (the checkpoint,
   left as it is) and writes the state after each of its ``1 + k`` tokens
   into lookahead state slots; verifying ``a`` keeps lookahead slot ``a``;
   a rollback keeps the checkpoint if the step never ran, and lookahead slot
   0 (the state after the verified token) if it did
   (:class:`~spec.kv_groups.StateManager`, ``CacheManager.rollback``).
7. **Forks and preemption.** A sequence forks only with no drafts in flight
   (the child starts from verified tokens); a sibling that shares a partly
   filled last block copies it before writing its drafts (rule 1 counts the
   copy). A preemption rolls the drafts back first, then swaps or drops the
   verified tokens only.
8. **The scheduler** (``SchedulerConfig.num_speculative_tokens``): the
   engine offers drafts (``ContinuousScheduler.propose``); a decoding
   sequence verifies up to ``k`` of them when the budget has ``1 + k``
   tokens for its row and memory has the lookahead (else it decodes one
   token, preempting no one for its drafts); ``update`` takes the accepted
   drafts and the next token, and the metrics report the acceptance rate.

A sequence of 6 tokens with ``B = 4`` drafts 3: the step's 4 tokens sit at
positions 6..9 and cross into a third block, which the allocation counts.

>>> from spec.block_manager import BlockManager
>>> m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
>>> m.add_sequence(0, [1, 2, 3, 4, 5, 6]), len(m.append_slots(0, [1, 2, 3, 4, 5, 6]))
(0, 6)
>>> m.take_copies()                                   # the prefill step is laid out
[]
>>> m.blocks_needed(0, 1 + 3)                         # token 7 and drafts 8, 9, 10
1
>>> m.append_slots(0, [7, 8, 9, 10], num_draft=3)     # lookahead slots, positions 6..9
[6, 7, 8, 9]
>>> m.block_table(0), m.pool.block_hash(1) is None    # block 1 is full, but holds drafts
((0, 1, 2), True)

The step runs; the target agrees with the first draft only. The sequence
keeps ``6 + 1 + 1`` tokens, block 2 (only rejected tokens) goes back to the
pool, and block 1, now full of verified tokens, is named for the prefix cache:

>>> _ = m.take_copies()
>>> m.verify(0, num_accepted=1)                       # the rejected tokens' slots
[8, 9]
>>> m.block_table(0), m.tokens(0)[6:], m.pool.num_held, m.pool.block_hash(1) is None
((0, 1), (7, 8), 2, False)
>>> m.verify(0, 0)                                    # verifying twice
Traceback (most recent call last):
...
spec.errors.SpeculationError: seq_id 0 has no drafts in flight (never drafted, or already ...

A fork shares the verified blocks. When the child drafts into the last block
they share (partly filled: positions 8, 9 of the child's 10), the lookahead
counts a copy of it and a fresh block for the drafts past it:

>>> _ = m.append_slots(0, [9, 9]); _ = m.take_copies()   # two plain decodes: 10 tokens
>>> m.fork(0, 1)
>>> m.blocks_needed(1, 1 + 3), m.append_slots(1, [5, 6, 7, 8], num_draft=3)
(2, [18, 19, 20, 21])
>>> m.take_copies()                                   # block 3 is copied before the writes
[(3, 4)]
>>> m.rollback(1), m.block_table(1), m.block_table(0)  # block 5 goes back; the copy stays
([19, 20, 21], (0, 1, 4), (0, 1, 3))
"""

from __future__ import annotations

from collections.abc import Sequence

from spec.errors import ArgumentValueError
from spec.validate import check_token_ids

__all__ = ["accepted_prefix"]


def accepted_prefix(drafts: Sequence[int], targets: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """Greedy verification: how many drafts the target accepts, and the tokens it commits.

    ``targets[j]`` is the target model's token after the last verified token
    and ``j`` drafts, for ``j = 0 .. k`` (one per query token of the step).
    Draft ``j`` is accepted while every draft before it was and it equals
    ``targets[j]``. With ``a`` accepted, the step commits ``drafts[:a]`` and
    then ``targets[a]``: the target's own token where the drafts went wrong
    (or after the last one), so every step yields ``1 + a`` tokens and the
    output is exactly what greedy decoding of the target alone produces.

    >>> accepted_prefix([5, 6, 7], [5, 6, 9, 4])
    (2, (5, 6, 9))
    >>> accepted_prefix([5, 6, 7], [5, 6, 7, 4])      # all accepted, plus a bonus token
    (3, (5, 6, 7, 4))
    >>> accepted_prefix([5], [5])
    Traceback (most recent call last):
    ...
    spec.errors.ArgumentValueError: targets must hold 1 + k = 2 tokens (one per query token), got 1
    """
    d = check_token_ids("drafts", drafts)
    t = check_token_ids("targets", targets)
    if len(t) != len(d) + 1:
        raise ArgumentValueError(
            f"targets must hold 1 + k = {len(d) + 1} tokens (one per query token), got {len(t)}"
        )
    a = 0
    while a < len(d) and d[a] == t[a]:
        a += 1
    return a, (*d[:a], t[a])
