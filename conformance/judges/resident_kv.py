"""The spec's KV memory with a copy resident on the oracle's device: only new K and V cross.

The fast reference (:mod:`conformance.judges.fast_reference`) reads a layer's
cache as a :class:`~conformance.judges.fast_reference.PagedKV` on its device.
Built afresh from the spec's memory at every step, that is every block the
step reads, sent over again: for a decode of 64 sequences at 8,192 tokens,
8 KV heads of 128, 8 GiB a layer and a step (K and V in float64), a thousand
times what the step itself writes. :class:`ResidentKV` is the spec's memory
(it *is* a :class:`~spec.kv_memory.KVMemory`: every rule and check is the
spec's) that also keeps, on the device, the blocks written so far, and
follows the memory's changes: a write sends the blocks it touched (only
those), a block copy is done on the device, and a backend's other correct fp8
value, once held (:meth:`~spec.kv_memory.KVMemory.hold`), is sent too.
The cache it hands the oracle is that resident copy, so a step sends only what
it wrote.

The copy holds each block once, in the order first written (a large pool
of millions of blocks holds only the few the example used), as float32: every
value a cache holds (float16, bfloat16, float32, fp8 values, the poison NaN
and infinities) is exact in float32, and each upload checks it is. A latent
memory's copy is its rows, one tensor a layer, which the oracle reads as the
key and, in their first ``latent_dim`` columns, as the value.

>>> m = ResidentKV(1, 8, 2, num_kv_heads=1, head_dim=1, device="cpu")
>>> m.write(0, np.array([[[1.0]], [[2.0]]]), np.array([[[3.0]], [[4.0]]]), [6, 7])
>>> m.copy_blocks([(3, 5)])
>>> cache = m.layer_cache(0)
>>> cache.block_ids, cache.key[:, :, 0, 0].tolist(), m.sent_bytes
((3, 5), [[1.0, 2.0], [1.0, 2.0]], 16)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from conformance.judges.dtypes import F64
from conformance.judges.fast_reference import PagedKV, resolve_device
from spec.batch import check_copies
from spec.block_manager import PAD_SLOT
from spec.kv_memory import KVMemory, check_slot_mapping


class ResidentKV(KVMemory):
    """A :class:`~spec.kv_memory.KVMemory` whose written blocks are also kept on ``device``.

    Invariant: for every block ``block_ids[j]``, row ``j`` of each layer's
    device copy equals ``read_blocks(layer, [block_ids[j]])`` (as float32; NaN
    in a layer that never wrote it, as the spec's memory holds it);
    :meth:`layer_cache` hands out that copy. ``sent_bytes`` counts what crossed
    to the device.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        device: str,
        kv_dtype: str | None = None,
        kv_scales: Sequence[tuple[float, float]] = (),
        lazy: bool | None = None,
        latent_dim: int | None = None,
    ) -> None:
        super().__init__(
            num_layers,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            kv_dtype=kv_dtype,
            kv_scales=kv_scales,
            lazy=lazy,
            latent_dim=latent_dim,
        )
        import torch

        self._torch = torch
        self.device = resolve_device(device)
        self.block_ids: list[int] = []  # the pool block each row holds, in the order written
        self._row: dict[int, int] = {}
        parts = 2 if self.latent_dim is None else 1  # K and V, or a latent layer's rows
        self._copies: list[list[Any]] = [
            [self._empty(8) for _ in range(parts)] for _ in range(num_layers)
        ]
        self.sent_bytes = 0

    def write(self, layer: int, key: Any, value: Any, slot_mapping: Sequence[int]) -> None:
        """The spec's write, then the blocks it touched sent to the device."""
        # the spec's checks first: bad input changes neither copy
        super().write(layer, key, value, slot_mapping)
        slots = check_slot_mapping(slot_mapping, self.num_slots)
        touched = np.unique(slots[slots != PAD_SLOT] // self.shape[1])
        self._send(layer, [int(b) for b in touched])

    def hold(self, layer: int, which: int, slots: Sequence[int], rows: Any) -> None:
        """The spec's hold (a backend's other correct fp8 value, say), then the blocks it
        changed sent to the device."""
        super().hold(layer, which, slots, rows)
        index = check_slot_mapping(slots, self.num_slots)
        self._send(layer, [int(b) for b in np.unique(index // self.shape[1])])

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """The spec's copies, then the same copies on the device (a destination whose source
        was never written is sent from the spec's memory, as it now holds it)."""
        pairs = check_copies(copies, self.shape[0])
        super().copy_blocks(pairs)
        resident = [(s, d) for s, d in pairs if s in self._row]
        missing = [d for s, d in pairs if s not in self._row]
        if resident:
            src = [self._row[s] for s, _ in resident]
            dst = self._rows([d for _, d in resident])
            for pair in self._copies:
                for copy in pair:
                    copy[dst] = copy[src]  # every source read before any write, as the spec
        for layer in range(self.num_layers):
            self._send(layer, missing)

    def layer_cache(self, layer: int) -> PagedKV:
        """The device copy of ``layer``: the rows written so far, named by their pool blocks."""
        n = len(self.block_ids)
        copies = [copy[:n] for copy in self._copies[self._check_layer(layer)]]
        k, v = copies if self.latent_dim is None else (copies[0], copies[0][..., : self.latent_dim])
        scales = self.kv_scales[layer] if self.kv_dtype is not None else None
        return PagedKV(k, v, scales, tuple(self.block_ids), self.shape[0])

    def _send(self, layer: int, blocks: list[int]) -> None:
        """Blocks of ``layer`` from the spec's memory to their rows on the device."""
        if not blocks:
            return
        rows = self._rows(blocks)
        parts: tuple[F64, ...] = self.read_blocks(layer, blocks)
        if self.latent_dim is not None:  # c_kv and k_rope: one row again
            parts = (np.concatenate(parts, axis=-1),)
        for which, stored in enumerate(parts):
            values = self._torch.from_numpy(stored.astype(np.float32))
            exact = np.array_equal(values.numpy().astype(np.float64), stored, equal_nan=True)
            assert exact, "a stored K or V value is not exact in float32"
            self._copies[layer][which][rows] = values.to(self.device)
            self.sent_bytes += values.numel() * values.element_size()

    def _rows(self, blocks: list[int]) -> list[int]:
        """The device rows of ``blocks``; a block without one gets a new row of NaN in every
        layer, as the spec's memory holds a block never written (the copies grown first)."""
        first = len(self.block_ids)
        for b in blocks:
            if b not in self._row:
                self._row[b] = len(self.block_ids)
                self.block_ids.append(b)
        capacity = self._copies[0][0].shape[0]
        if len(self.block_ids) > capacity:
            size = max(len(self.block_ids), 2 * capacity)
            for pair in self._copies:
                for which, old in enumerate(pair):
                    grown = self._empty(size)
                    grown[:capacity] = old
                    pair[which] = grown
        if len(self.block_ids) > first:
            for pair in self._copies:
                for copy in pair:
                    copy[first:] = float("nan")
        return [self._row[b] for b in blocks]

    def _empty(self, rows: int) -> Any:
        shape = (rows, *self.shape[1:])
        return self._torch.empty(shape, dtype=self._torch.float32, device=self.device)
