"""The backend's KV cache against the spec's, bit for bit, and the guard blocks around a large pool.

Pools of up to :data:`WHOLE_POOL_SLOTS` slots are compared whole after every
step. Larger ones (and every pool under the device contract) are compared
where the step wrote (the blocks written or copied into, and their
neighbours), and whole every :data:`SWEEP_EVERY` steps and at the end, so a
stray write anywhere is still caught; a large read goes by blocks, at most
:data:`READ_ELEMENTS` a part. The first difference reported is a live token's
(sequence and logical position), else the first slot's. In an fp8 cache a
value on the other side of a rounding tie is accepted
(:mod:`conformance.judges.fp8_ties`) and held by the spec from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from conformance.judges.compare import Difference, first_kv_difference
from conformance.judges.dtypes import F64
from conformance.judges.fp8_ties import TieNeighbours, as_stored, same, stored_range
from conformance.lockstep.backend_calls import BackendCalls
from conformance.lockstep.example import Example
from conformance.lockstep.workload import guard_background, kv_parts
from spec.batch import BatchMetadata
from spec.kv_memory import KVMemory

WHOLE_POOL_SLOTS = 4096
"""Pools of at most this many slots are compared whole after every step."""
SWEEP_EVERY = 8
"""Larger pools are compared whole every this many steps (and at the end)."""
READ_ELEMENTS = 1 << 24
"""Elements of K (and as many of V) read back at once in a comparison: a larger pool is read
and compared by blocks, in parts of at most this many (128 MiB each as float64)."""
ACCEPTED_NEIGHBOURS = (
    "fp8 values accepted as the other side of a rounding tie (a compiled division: 2 ulp)"
)
"""The check that counts stored fp8 values the spec took from a backend: each the other neighbour
a correct kernel may store where the exact quotient lies within 2 ulp of a rounding boundary."""

Owners = Callable[[int], dict[int, tuple[int, int]]]
"""A KV cache group's live slots: slot -> (sequence, token)."""


class KVCheck:
    """Compares one example's backend cache with the spec's ``memory`` (and ``ties`` beside
    it), counting into the example's checks and failing through it."""

    def __init__(
        self,
        example: Example,
        memory: KVMemory,
        ties: TieNeighbours,
        calls: BackendCalls,
        owners: Owners,
        whole_pool_slots: int = WHOLE_POOL_SLOTS,
    ) -> None:
        g = example.config.geometry
        self.example, self.memory, self.ties, self.calls = example, memory, ties, calls
        self.owners = owners
        self.whole = g.num_blocks * g.block_size <= whole_pool_slots and calls.device is None

    def due(self, step_index: int) -> bool:
        """Whether this step's comparison is of the whole pool."""
        return self.whole or step_index % SWEEP_EVERY == 0

    def compare(self, blocks: list[int] | None) -> list[int]:
        """Compare ``blocks`` (all if ``None``) and the guards; the blocks compared."""
        ex = self.example
        g = ex.config.geometry
        ids = (
            list(range(g.num_blocks)) if blocks is None else [x for x in blocks if x < g.num_blocks]
        )
        owners = [self.owners(group) for group in range(g.num_groups)]
        b, names = g.block_size, kv_parts(g)
        slots = (np.asarray(ids, dtype=np.int64)[:, None] * b + np.arange(b)).reshape(-1)
        chunk = self._read_chunk(len(ids))
        for layer in range(g.num_layers):
            found: dict[str, list[Difference]] = {name: [] for name in names}
            for lo in range(0, len(ids), chunk):
                part = ids[lo : lo + chunk]
                got = self.calls.read(layer, part)
                want = self._accepted(layer, part, got)  # a lazy pool (2^26 elements) too
                for name, width, spec, actual in zip(names, g.kv_widths, want, got, strict=True):
                    row = (g.num_kv_heads, width)
                    diff = first_kv_difference(
                        ex.step_index,
                        layer,
                        name,
                        spec.reshape(-1, *row),
                        actual.reshape(-1, *row),
                        owners[g.group_of(layer)],
                        b,
                        slots=slots[lo * b : (lo + len(part)) * b],
                        block_offset=self.calls.pool.base,
                    )
                    if diff is not None:
                        found[name].append(diff)
            for diffs in found.values():
                if diffs:  # a live token's first (as one read would), else the first slot
                    live = [d for d in diffs if d.seq_id is not None]
                    first = (
                        min(live, key=lambda d: (d.seq_id or 0, d.token or 0)) if live else diffs[0]
                    )
                    ex.raise_for(ex.named(first, layer))
            self._check_guards(layer)
        ex.checks["K and V slots compared exactly"] += 2 * g.num_layers * len(ids) * b
        if blocks is None:
            ex.checks["whole-pool comparisons"] += 1
        return ids

    def _accepted(self, layer: int, blocks: list[int], got: tuple[F64, F64]) -> tuple[F64, F64]:
        """The spec's K and V of ``blocks``, once it holds each fp8 value the backend stored that
        is the other one a correct kernel may store there (a compiled division lands on either
        side of a rounding tie: :func:`spec.quant.quantize_range`). Attention is judged from
        then on against the KV that is there; anything else stays a difference."""
        want = self.memory.read_blocks(layer, blocks)
        if self.example.config.geometry.kv_dtype is None:
            return want
        b = self.example.config.geometry.block_size
        changed = 0
        for which, other in enumerate(self.ties.others(layer, blocks)):
            held, actual = want[which], got[which]
            takes = same(actual, other) & ~same(actual, held)
            rows = np.flatnonzero(takes.reshape(len(blocks) * b, -1).any(axis=1))
            if rows.size == 0:
                continue
            slots = [blocks[r // b] * b + r % b for r in rows.tolist()]
            merged = np.where(takes, actual, held).reshape(len(blocks) * b, *held.shape[2:])
            changed += self.ties.accept(layer, which, slots, merged[rows])
        if not changed:
            return want
        self.example.checks[ACCEPTED_NEIGHBOURS] += changed
        return self.memory.read_blocks(layer, blocks)

    def _read_chunk(self, num_blocks: int) -> int:
        """Blocks per read of a comparison: all of them, unless they pass
        :data:`READ_ELEMENTS` and the backend reads by blocks (a device-scale pool read
        whole would be gigabytes, twice: the backend's copy and the spec's)."""
        g = self.example.config.geometry
        per_block = g.block_size * g.num_kv_heads * g.head_dim
        if num_blocks * per_block <= READ_ELEMENTS or self.calls.read_blocks_fn is None:
            return max(num_blocks, 1)
        return max(1, READ_ELEMENTS // per_block)

    def _check_guards(self, layer: int) -> None:
        """The guard blocks around a large pool's workload still hold their primed values."""
        guards = self.calls.pool.guards
        if not guards:
            return
        ex = self.example
        g = ex.config.geometry
        ids = [blk for blk, _ in guards]
        got = self.calls.read(layer, ids, backend_ids=True)
        want = guard_background(ex.config, layer, len(ids) * g.block_size)
        for which, name in enumerate(kv_parts(g)):
            row = (g.num_kv_heads, g.kv_widths[which])
            expected = as_stored(g, want[which], layer, which)
            if g.kv_dtype is not None:  # either side of a tie is correct
                low, high = stored_range(g, want[which], layer, which)
                actual = got[which].reshape(expected.shape)
                expected = np.where(same(actual, low) | same(actual, high), actual, expected)
            for j, (blk, _) in enumerate(guards):
                lo = j * g.block_size
                diff = first_kv_difference(
                    ex.step_index,
                    layer,
                    name,
                    expected[lo : lo + g.block_size].reshape(-1, *row),
                    got[which][j].reshape(-1, *row),
                    {},
                    g.block_size,
                    slots=list(range(blk * g.block_size, (blk + 1) * g.block_size)),
                )
                if diff is not None:
                    detail = f"guard block {blk} (the workload never writes it) changed: "
                    ex.raise_for(replace(diff, detail=detail + diff.detail))
        ex.checks["guard blocks around a large pool unchanged"] += len(ids)


def written_blocks(batch: BatchMetadata) -> list[int]:
    """Blocks a step may change (written or copied into), with their neighbours."""
    b = batch.block_size
    touched = {s // b for g in range(batch.num_groups) for s in batch.slots(g) if s >= 0}
    touched |= {dst for _, dst in batch.copies}
    return sorted({x for t in touched for x in (t - 1, t, t + 1) if x >= 0})
