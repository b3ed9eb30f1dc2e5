"""The spec's own memory against each token's ground truth: a check of the spec, not the backend.

Every live token's K and V in the spec's memory must be what was written for
it (in an fp8 memory, one of the values a correct write stores, dequantized).
After a step only what it could have changed is read (each of its sequences
from its first block the step touched: re-reading every context at every step
cost more than the backend's attention at 64 x 2,048); every live token at a
whole-pool comparison. A break stops the run as the spec's or the suite's bug
(:class:`~conformance.errors.SpecSideBug`), never the backend's failure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from conformance.errors import SpecSideBug, SuiteStopped
from conformance.judges.dtypes import F64
from conformance.judges.fp8_ties import same, stored_range
from conformance.lockstep.example import Example
from conformance.lockstep.workload import SequenceTruth
from spec.block_manager import BlockManager
from spec.kv_memory import KVMemory
from spec.quant import dequantize

Held = Callable[[int, int], tuple[tuple[int, ...], int]]
"""A sequence's table for a layer, and its first position in a held block."""


class TruthCheck:
    """Reads ``memory`` through the sequences of ``manager`` against ``truth``."""

    def __init__(
        self,
        example: Example,
        memory: KVMemory,
        manager: BlockManager,
        truth: SequenceTruth,
        held: Held,
    ) -> None:
        self.example, self.memory, self.manager = example, memory, manager
        self.truth, self.held = truth, held

    def check(self, seq_ids: Sequence[int] | None, blocks: Sequence[int] | None = None) -> None:
        """The spec's memory holds each live token's true K and V: each of ``seq_ids`` (all
        live if ``None``) from its first block among ``blocks`` on (all if ``None``)."""
        ex = self.example
        live = self.manager.sequence_ids() if seq_ids is None else seq_ids
        touched = None if blocks is None else frozenset(blocks)
        b = ex.config.geometry.block_size
        for seq_id in live:
            tokens = self.manager.tokens(seq_id)
            n, checked = len(tokens), 0
            for layer in range(ex.config.geometry.num_layers):
                table, start = self.held(seq_id, layer)
                lo = start if touched is None else _first_touched(table, touched, start, n, b)
                if lo == n:
                    continue
                held = self.memory.gather(layer, table, n, start=lo)
                truth = self.truth.rows(seq_id, tokens, layer)
                if not all(
                    self._reads_as(x, t[lo:], layer, i)
                    for i, (x, t) in enumerate(zip(held, truth, strict=True))
                ):
                    raise SuiteStopped(
                        SpecSideBug(
                            f"at step {ex.step_index}, the spec's KV for sequence {seq_id}, "
                            f"layer {layer} is not what was written for its tokens"
                        )
                    )
                checked = max(checked, n - lo)
            ex.checks["spec KV equals the tokens' ground truth"] += checked

    def _reads_as(self, held: F64, written: F64, layer: int, which: int) -> bool:
        """Whether the spec's memory reads back ``held`` for written values ``written``: they
        themselves, or for fp8, a value a correct kernel may store for each, dequantized."""
        g = self.example.config.geometry
        if g.kv_dtype is None:
            return bool(np.array_equal(held, written))
        scale = g.kv_scales[layer][which]
        low, high = (dequantize(x, scale) for x in stored_range(g, written, layer, which))
        return bool((same(held, low) | same(held, high)).all())


def _first_touched(
    table: Sequence[int], touched: frozenset[int], start: int, num_tokens: int, b: int
) -> int:
    """The first position ``>= start`` of ``num_tokens`` in a block of ``touched``; else
    ``num_tokens``."""
    for j in range(start // b, -(-num_tokens // b)):
        if table[j] in touched:
            return max(start, j * b)
    return num_tokens
