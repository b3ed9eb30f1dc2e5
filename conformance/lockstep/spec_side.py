"""The spec's bookkeeping of a workload alone: what an example of another shard needs.

A sharded run (:mod:`conformance.run.shard`) still generates every example of
the run, in order, because Hypothesis generates each example after the ones
before it; but it runs only its own share against the backend. The others
run through a :class:`SpecSide`: the same operations on the spec's block
manager (or KV cache groups) that :class:`~conformance.lockstep.driver.Lockstep`
performs, so that every rule's precondition and every draw sees the same
state, and nothing else: no backend, no KV values, no attention, no checks.

>>> from spec.backend import KVGeometry
>>> from conformance.lockstep.workload import WorkloadConfig
>>> side = SpecSide(WorkloadConfig(KVGeometry(1, 4, 2, 1, 8), num_heads=2, scale=0.35, seed=1))
>>> side.add(0, [7, 8, 9]), side.step([(0, [7, 8, 9])]), side.manager.block_table(0)
(0, [0], (0, 1))
>>> side.step([(0, list(range(9)))])        # more than the pool holds: left out, unchanged
[]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from conformance.lockstep.group_memory import GroupMemory
from conformance.lockstep.workload import WorkloadConfig
from spec.batch import build_batch
from spec.block_manager import BlockManager
from spec.errors import OutOfBlocksError


class SpecSide:
    """The spec's memory side of a workload, driven as a Lockstep drives it, and nothing more.

    Invariant: after the same operations, :attr:`manager` (and the group
    memory) is in the state a :class:`~conformance.lockstep.driver.Lockstep`'s
    would be in, so that the examples drawn after it are the same.
    """

    def __init__(
        self,
        config: WorkloadConfig,
        groups: GroupMemory | None = None,
        manager: BlockManager | None = None,
    ) -> None:
        """A fresh spec side; or, given a lockstep's ``groups`` and ``manager``, that state."""
        g = config.geometry
        self.config = config
        if manager is None:
            groups = GroupMemory(config) if config.group_windows else None
            manager = (
                BlockManager(
                    g.num_blocks, g.block_size, enable_prefix_caching=config.prefix_caching
                )
                if groups is None
                else groups.manager
            )
        self.groups = groups
        self.manager = manager

    def add(self, seq_id: int, prompt: Sequence[int]) -> int:
        """Start a sequence; how many prompt tokens the prefix cache supplied."""
        if self.groups is not None:
            return self.groups.add(seq_id, prompt)
        return self.manager.add_sequence(seq_id, prompt)

    def fork(self, parent_id: int, child_id: int) -> None:
        if self.groups is not None:
            self.groups.fork(parent_id, child_id)
        else:
            self.manager.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        if self.groups is not None:
            self.groups.free(seq_id)
        else:
            self.manager.free(seq_id)

    def step(
        self,
        schedule: Sequence[tuple[int, Sequence[int]]],
        drafts: Mapping[int, int] | None = None,
    ) -> list[int]:
        """Give each sequence's tokens their slots and lay the step out; the sequences that ran.

        ``drafts``: the speculative rows' draft counts, as a Lockstep takes them.
        """
        k = dict(drafts or {})
        ran = [(s, len(t)) for s, t in schedule if self._append(s, t, k.get(s, 0))]
        if ran:
            if self.groups is not None:
                self.groups.layout(ran)
            else:
                build_batch(self.manager, ran)  # laying out commits: copies taken, tokens placed
        return [seq_id for seq_id, _ in ran]

    def verify(self, seq_id: int, num_accepted: int) -> None:
        """Keep ``num_accepted`` of ``seq_id``'s drafts; reject the rest."""
        if self.groups is not None:
            self.groups.cache.verify(seq_id, num_accepted)
        else:
            self.manager.verify(seq_id, num_accepted)

    def rollback(self, seq_id: int) -> None:
        """Reject every draft of ``seq_id``."""
        if self.groups is not None:
            self.groups.cache.rollback(seq_id)
        else:
            self.manager.rollback(seq_id)

    def finish(self) -> None:
        """Nothing to judge: no backend ran."""

    def check_integrity(self) -> None:
        if self.groups is not None:
            self.groups.check_integrity()
        else:
            self.manager.check_integrity()

    def _append(self, seq_id: int, tokens: Sequence[int], num_draft: int = 0) -> bool:
        if self.groups is not None:
            return self.groups.append(seq_id, tokens, num_draft)
        try:
            self.manager.append_slots(seq_id, tokens, num_draft=num_draft)
        except OutOfBlocksError:
            return False
        return True
