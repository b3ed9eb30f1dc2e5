"""Either side of an fp8 rounding tie: what a correct cache may hold, and taking what it holds.

A compiled fp8 write divides by the scale approximately (``div.full.f32``,
within :data:`spec.quant.DIVISION_ULPS`), so where the exact quotient lies that
close to a rounding boundary, a correct kernel may store either neighbour
(:func:`spec.quant.quantize_range`). :class:`TieNeighbours` follows the spec's
memory through its writes and copies and knows, in each element, the other
value a correct kernel may store there (the stored one itself elsewhere);
:meth:`TieNeighbours.accept` takes a backend's choice into the spec's memory
(:meth:`spec.kv_memory.KVMemory.hold`), so that attention is judged from then on
against the KV that is really there, and refuses anything else.

>>> from spec.kv_memory import KVMemory
>>> q = KVMemory(1, 4, 2, 1, 1, kv_dtype="fp8_e4m3", kv_scales=((0.5, 0.25),))
>>> ties = TieNeighbours(q)
>>> k = np.array([[[1.0625]]])                      # 2.125 at scale 0.5: a tie
>>> q.write(0, k, k, slot_mapping=[1]); ties.note_write(0, k, k, [1])
>>> float(q.k[0][0, 1, 0, 0]), float(ties.others(0, [0])[0][0, 1, 0, 0])
(2.0, 2.25)
>>> ties.accept(0, 0, [1], np.array([[[2.25]]]))     # one element now holds 2.25
1
>>> float(q.k[0][0, 1, 0, 0]), float(ties.others(0, [0])[0][0, 1, 0, 0])
(2.25, 2.0)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from conformance.judges.dtypes import F64
from spec.errors import ArgumentValueError
from spec.kv_geometry import KVGeometry
from spec.kv_memory import KVMemory
from spec.quant import quantize, quantize_range


class TieNeighbours:
    """Beside an fp8 ``memory``: in each element, the other value a correct kernel may store
    (nothing to hold for an unquantized memory, whose ``others`` are its own values)."""

    def __init__(self, memory: KVMemory) -> None:
        self.memory = memory
        m = memory
        self._others = (
            None
            if m.kv_dtype is None
            else KVMemory(m.num_layers, *m.shape, lazy=m.lazy, latent_dim=m.latent_dim)
        )

    def note_write(self, layer: int, key: F64, value: F64, slot_mapping: Sequence[int]) -> None:
        """The memory's write of ``key`` and ``value`` (made first): each element's other
        neighbour, where its quotient lies at a tie (else the stored value again)."""
        if self._others is None:
            return
        m = self.memory
        slots = np.asarray(list(slot_mapping), dtype=np.int64)
        keep = slots >= 0
        used = slots[keep].tolist()
        n = len(slots)
        others = []
        for which, x in enumerate((key, value)):
            rows = x[:n][keep]
            stored = m.read_slots(layer, which, used) if used else rows[:0]
            low, high = quantize_range(rows, m.kv_scales[layer][which], str(m.kv_dtype))
            others.append(np.where(stored == low, high, low))
        self._others.write(layer, others[0], others[1], used)

    def note_copies(self, copies: Sequence[tuple[int, int]]) -> None:
        """The memory's block copies."""
        if self._others is not None:
            self._others.copy_blocks(copies)

    def others(self, layer: int, blocks: Sequence[int]) -> tuple[F64, F64]:
        """For ``blocks`` of K and V, the other value a correct kernel may have stored in each
        element: the neighbour across an fp8 rounding boundary that the exact quotient lies
        within :data:`spec.quant.DIVISION_ULPS` of; the stored value itself elsewhere (and
        in an unquantized memory)."""
        if self._others is None:
            return self.memory.read_blocks(layer, blocks)
        return self._others.read_blocks(layer, blocks)

    def accept(self, layer: int, which: int, slots: Sequence[int], rows: F64) -> int:
        """Hold ``rows`` (``[len(slots), H_kv, D]``, a backend's stored values) in ``slots`` of
        K (``which`` 0) or V (1) of the memory: each element must be what it holds there or
        the other value a correct kernel may store (:meth:`others`). Returns how many
        elements changed; a row that is neither is refused, naming it, and nothing changes."""
        m = self.memory
        held = m.read_slots(layer, which, slots)
        new = np.asarray(rows, dtype=np.float64)
        if new.shape != held.shape:
            m.hold(layer, which, slots, new)  # refused, naming the shape
        other = held if self._others is None else self._others.read_slots(layer, which, slots)
        kept, alt = same(new, held), same(new, other)
        bad = np.flatnonzero(~(kept | alt).reshape(len(held), -1).all(axis=1))
        if bad.size:
            raise ArgumentValueError(
                f"slot {int(list(slots)[bad[0]])} holds values no correct kernel stores there"
            )
        changed = int((~kept).sum())
        if changed and self._others is not None:
            self._others.hold(layer, which, slots, np.where(kept, other, held))
            m.hold(layer, which, slots, new)
        return changed


def same(a: F64, b: F64) -> NDArray[np.bool_]:
    """Elementwise equality in which NaN equals NaN (a stored NaN is a value like any other)."""
    out: NDArray[np.bool_] = (a == b) | (np.isnan(a) & np.isnan(b))
    return out


def stored_range(g: KVGeometry, x: F64, layer: int, which: int) -> tuple[F64, F64]:
    """The lowest and highest fp8 value a correct cache of ``g`` stores for written ``x``, in
    K (``which`` 0) or V (1) of ``layer``."""
    assert g.kv_dtype is not None
    return quantize_range(x, g.kv_scales[layer][which], g.kv_dtype)


def as_stored(g: KVGeometry, x: F64, layer: int, which: int) -> F64:
    """What a cache of ``g`` stores for written values ``x``: themselves, or their fp8 values."""
    if g.kv_dtype is None:
        return x
    return quantize(x, g.kv_scales[layer][which], g.kv_dtype)
