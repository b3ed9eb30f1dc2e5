"""Scripted workloads for the planted speculative bugs (:mod:`conformance.planted.speculative`).

``test_conformance_lockstep.py`` runs each on the correct backends (it must
pass) and on its planted bug (it must be caught, as one of the listed kinds).
Block size 4 throughout: a 6-token sequence's verified token sits at position
6, so 3 drafts (positions 7..9) cross into a third block.
"""

from __future__ import annotations

from collections.abc import Callable

from conformance.lockstep.driver import Lockstep
from conformance.lockstep.workload import WorkloadConfig, geometry_for, scale_for
from spec.attention import AttentionVariant

HEADS = 4  # two KV heads, two query heads each


def _draft_reject_decode(ls: Lockstep) -> None:
    """Draft 3 across a block boundary (into a block not next to the last one: another
    sequence took that), accept 1; draft 3 more into one block and accept none (the
    rejected slots stay in the kept block); then decode: it must see none of them."""
    prompt = [3, 1, 4, 1, 5, 9]
    ls.add(0, prompt)
    ls.add(1, [7, 7, 7])
    ls.step([(0, prompt), (1, [7, 7, 7])])
    ls.step([(0, [2, 6, 5, 3]), (1, [4])], drafts={0: 3})
    ls.verify(0, 1)
    ls.step([(0, [5, 8, 9, 7]), (1, [6])], drafts={0: 3})  # all in one block: positions 8..11
    ls.verify(0, 0)
    ls.step([(0, [5]), (1, [2])])


def _draft_fill_rollback(ls: Lockstep) -> None:
    """Drafts that fill a block (prefix caching on), then a rollback of them all."""
    prompt = [3, 1, 4, 1, 5]
    ls.add(0, prompt)
    ls.step([(0, prompt)])
    ls.step([(0, [9, 2, 6, 5])], drafts={0: 3})
    ls.rollback(0)
    ls.step([(0, [8])])


def _windowed_drafts(ls: Lockstep) -> None:
    """A 9-token prompt, then a speculative row whose first query's window edge falls
    inside the keys the last draft's window no longer sees."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    ls.add(0, prompt)
    ls.step([(0, prompt)])
    ls.step([(0, [3, 5, 8, 9])], drafts={0: 3})
    ls.verify(0, 3)


def _config(
    variant: AttentionVariant | None = None, prefix_caching: bool = False
) -> WorkloadConfig:
    geometry, heads = geometry_for(4, 2, HEADS // 2, 8, "float32", 1)
    variants = () if variant is None else (variant,)
    return WorkloadConfig(
        geometry, heads, scale_for(8, False), 17, prefix_caching, variants=variants
    )


Workload = tuple[Callable[[Lockstep], None], WorkloadConfig, set[str]]

SPECULATIVE_WORKLOADS: dict[str, Workload] = {
    "StaleAfterRollback": (_draft_reject_decode, _config(), {"output"}),
    "LookaheadOneToken": (_draft_reject_decode, _config(), {"memory"}),
    "DraftBlocksHashed": (_draft_fill_rollback, _config(prefix_caching=True), {"memory"}),
    "WindowFromSpeculativeEnd": (
        _windowed_drafts,
        _config(AttentionVariant(window=3)),
        {"output"},
    ),
    "RowInOneBlock": (_draft_reject_decode, _config(), {"output", "exception"}),
}
