"""A running sequence's step, on the memory side: its next tokens, the layout, its drafts.

Slots for the next tokens in every group (windows release first; drafts get lookahead
slots), the batch laid out over every group's tables, then the drafts verified or rolled
back in every group (:mod:`spec.speculative`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from spec.batch import BatchMetadata, StateLayout, build_batch
from spec.block_manager import BlockManager, check_num_draft
from spec.block_pool import BlockPool
from spec.errors import OutOfBlocksError, SpeculationError
from spec.kv_groups import StateManager
from spec.validate import check_int, check_token_ids


class CacheStep:
    """The step's growth, layout and drafts, over every group of a cache manager."""

    _pool: BlockPool  # the block pool every paged group shares
    _managers: tuple[BlockManager, ...]  # each paged group's tables, in batch-group order
    _state: StateManager | None  # the state group's slots, if the model has one

    def can_grow(self, seq_id: int, num_new: int, *, num_draft: int = 0) -> bool:
        """Could running sequence ``seq_id`` get slots for ``num_new`` more tokens now?

        Counts what every group takes (new blocks, copy-on-write copies) less
        what windows give back first. When ``num_draft`` of them are drafts,
        a state group also needs ``1 + num_draft`` free lookahead slots.
        """
        k = check_int("num_draft", num_draft, low=0)
        if k and self._state is not None and not self._state.can_draft(k):
            return False
        if len(self._managers) == 1:
            return self._managers[0].can_append(seq_id, num_new)
        return self._growth(seq_id, num_new) <= self._pool.num_available

    def grow(self, seq_id: int, tokens: Sequence[int], *, num_draft: int = 0) -> list[int]:
        """Give slots to the next ``tokens`` of a running sequence (copy-on-write first).

        Returns group 0's slots. Windows release first, then every group
        appends. The last ``num_draft`` tokens are drafts: every paged group
        gives them lookahead slots, and a state group lookahead state slots.
        """
        toks = check_token_ids("tokens", tokens)
        k = check_int("num_draft", num_draft, low=0)
        if k:
            self._check_draft(seq_id, len(toks), k)
        if len(self._managers) > 1:  # one group checks and releases as it appends
            if not self.can_grow(seq_id, len(toks), num_draft=k):
                self._pool.num_allocation_failures += 1
                raise OutOfBlocksError(
                    f"sequence {seq_id} needs {self._growth(seq_id, len(toks))} more blocks over "
                    f"its KV cache groups for {len(toks)} tokens, {self._pool.num_available} "
                    "available"
                )
            for m in self._managers:
                m.release_expired(seq_id)
        slots = self._managers[0].append_slots(seq_id, toks, num_draft=k)
        for m in self._managers[1:]:
            m.append_slots(seq_id, toks, num_draft=k)
        if k and self._state is not None:
            self._state.draft(seq_id, k)
        return slots

    def _check_draft(self, seq_id: int, num_tokens: int, num_draft: int) -> None:
        """Refuse a draft the managers would refuse half-way (state slots, drafts in flight)."""
        m = self._managers[0]
        if m.num_drafts(seq_id):
            raise SpeculationError(
                f"seq_id {seq_id} has {m.num_drafts(seq_id)} drafts in flight: verify or "
                "roll them back before drafting again"
            )
        check_num_draft(num_draft, num_tokens)
        if self._state is not None and not self._state.can_draft(num_draft):
            self._pool.num_allocation_failures += 1
            raise OutOfBlocksError(
                f"state pool: seq_id {seq_id} needs {1 + num_draft} lookahead state slots, "
                f"{self._state.pool.num_free} free"
            )

    def _growth(self, seq_id: int, num_new: int) -> int:
        """Net blocks ``num_new`` more tokens take from the pool, over every group."""
        return sum(
            m.blocks_needed(seq_id, num_new) - m.blocks_reclaimed(seq_id) for m in self._managers
        )

    def layout(self, scheduled: Sequence[tuple[int, int]]) -> BatchMetadata:
        """The step's batch metadata for ``(seq_id, num_new_tokens)`` rows, copies included.

        The memory side lays the batch out because the tables are its own:
        one per paged group (``batch.tables(g)``), and each row's state slot
        with the step's state copies (``batch.state``) when there is a state group.
        """
        if self._state is None:
            return build_batch(self._managers[0], scheduled, groups=self._managers[1:])
        st = self._state
        slots = tuple(st.slot(seq_id) for seq_id, _ in scheduled)
        ahead = tuple(st.lookahead(seq_id) for seq_id, _ in scheduled)
        batch = build_batch(self._managers[0], scheduled, groups=self._managers[1:])
        lookahead = ahead if any(ahead) else ()
        return replace(batch, state=StateLayout(slots, tuple(st.take_copies()), lookahead))

    def num_drafts(self, seq_id: int) -> int:
        """Drafts in flight for running ``seq_id`` (0 unless it speculates)."""
        return self._managers[0].num_drafts(seq_id)

    def verify(self, seq_id: int, num_accepted: int) -> list[int]:
        """Accept ``num_accepted`` drafts of ``seq_id`` in every group; return group 0's
        rejected slots. Blocks holding only rejected tokens return to the pool now."""
        rejected = self._managers[0].verify(seq_id, num_accepted)  # checks all; the rest follow
        for m in self._managers[1:]:
            m.verify(seq_id, num_accepted)
        if self._state is not None:
            self._state.verify(seq_id, num_accepted)
        return rejected

    def rollback(self, seq_id: int) -> list[int]:
        """Reject every draft in flight of ``seq_id`` in every group; return group 0's slots.

        The last verified token stays. If the step ran, its KV is written and
        so is the state after it (lookahead slot 0, which the state keeps: a
        rollback then equals verifying no draft); if not, both are still to
        compute, from the checkpoint.
        """
        first = self._managers[0]
        ran = not first.num_uncommitted(seq_id) if seq_id in first else False
        rejected = first.rollback(seq_id)
        for m in self._managers[1:]:
            m.rollback(seq_id)
        if self._state is not None:
            if ran:
                self._state.verify(seq_id, 0)
            else:
                self._state.rollback(seq_id)
        return rejected
