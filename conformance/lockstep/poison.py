"""Every slot primed before a workload starts, and the slots no live token owns poisoned.

Before the first operation every slot of the cache is written, on both sides,
with known background values ("step 0"), so that a write or copy into any slot
that should not change is visible; a large pool's guard blocks are primed too.
In a poisoned example (``config.poison``) the slots no live token owns hold the
poison instead (NaN, an infinity, or with ``--poison finite`` a large finite
value), at priming and again before each step's writes: free blocks, the tails
of partial blocks, blocks a window released, evicted blocks handed to a new
owner, but not a free block the prefix cache still holds (a later prompt may
hit it). Everything goes through ``write_kv``, as any KV does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from conformance.judges.dtypes import F64
from conformance.lockstep.backend_calls import BackendCalls
from conformance.lockstep.example import Example
from conformance.lockstep.workload import POISONS, background, guard_background, poison_rows
from spec.block_pool import BlockPool
from spec.kv_memory import KVMemory

SpecWrite = Callable[[int, F64, F64, list[int]], None]
"""The spec's side of a write: layer, K, V, slots."""


class Poison:
    """Primes one example's slots, and poisons those no live token owns."""

    def __init__(
        self,
        example: Example,
        calls: BackendCalls,
        memory: KVMemory,
        spec_write: SpecWrite,
        owners: Callable[[int], dict[int, tuple[int, int]]],
        pools: Callable[[int], BlockPool],
        note_offset: Callable[[int], None],
    ) -> None:
        self.example, self.calls, self.memory, self.spec_write = example, calls, memory, spec_write
        self.owners, self.pools, self.note_offset = owners, pools, note_offset

    def prime(self) -> None:
        """Fill every slot with known values first, so that any stray write is visible (poison,
        in a poisoned example)."""
        c = self.example.config
        if c.poison is not None:
            self._prime_guards()
            self.unowned(everywhere=True)
            return
        g = c.geometry
        b = g.block_size
        slots = list(range(g.num_blocks * b))
        guard_slots = self._guard_slots()
        shifted = self.calls.pool.slots(slots)
        for layer in range(g.num_layers):
            k, v = background(c, layer)
            gk, gv = guard_background(c, layer, len(guard_slots))
            self.calls.write_kv(
                layer, np.concatenate([k, gk]), np.concatenate([v, gv]), shifted + guard_slots
            )
            self.spec_write(layer, k, v, slots)
        self.note_offset(max(shifted + guard_slots))

    def _guard_slots(self) -> list[int]:
        b = self.example.config.geometry.block_size
        return [s for blk, _ in self.calls.pool.guards for s in range(blk * b, (blk + 1) * b)]

    def _prime_guards(self) -> None:
        """A poisoned example's guard blocks: primed with their known values all the same."""
        c = self.example.config
        guard_slots = self._guard_slots()
        if not guard_slots:
            return
        for layer in range(c.geometry.num_layers):
            gk, gv = guard_background(c, layer, len(guard_slots))
            self.calls.write_kv(layer, gk, gv, guard_slots)
        self.note_offset(max(guard_slots))

    def unowned(self, everywhere: bool = False) -> None:
        """Fill every slot no live token owns with the example's poison, on both sides, only
        where it does not hold poison already (``everywhere``: in every slot, as priming does).
        Nothing when the example is not poisoned."""
        c = self.example.config
        if c.poison is None:
            return
        g = c.geometry
        b = g.block_size
        for group in range(g.num_groups):
            owned = self.owners(group)
            pool = self.pools(group)
            layers = [x for x in range(g.num_layers) if g.group_of(x) == group]
            k, _ = self.memory.read_blocks(layers[0], list(range(g.num_blocks)))
            flat = k.reshape(g.num_blocks * b, -1)
            value = POISONS[c.poison]
            held = np.isnan(flat) if np.isnan(value) else np.equal(flat, value)
            poisoned = np.zeros(flat.shape[0], dtype=np.bool_)
            if not everywhere:
                poisoned |= np.asarray(held, dtype=np.bool_).reshape(flat.shape).all(axis=1)
            slots = [
                s
                for s in range(g.num_blocks * b)
                if s not in owned
                and not poisoned[s]
                and not (pool.ref_count(s // b) == 0 and pool.block_hash(s // b) is not None)
            ]
            if not slots:
                continue
            k_rows, v_rows = poison_rows(c, len(slots))
            for layer in layers:
                self.calls.write_kv(layer, k_rows, v_rows, self.calls.pool.slots(slots))
                self.spec_write(layer, k_rows, v_rows, slots)
            self.example.checks["slots no live token owns poisoned"] += len(slots) * len(layers)
