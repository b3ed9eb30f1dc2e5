"""The spec's model of physical KV memory, and the token-by-token view through a table.

Per layer there is one K array and one V array of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``: the layout that the
backends use too. Flattening the first two axes gives ``num_blocks *
block_size`` slots, and slot ``s`` is row ``s`` of that view. The model holds
float64 and starts as NaN, so that any read of a slot nobody wrote shows up.

>>> mem = KVMemory(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=1)
>>> k = np.array([[[1.0]], [[2.0]], [[3.0]]])
>>> mem.write(0, k, -k, slot_mapping=[6, 7, 2])      # tokens 0, 1 in block 3; token 2 in block 1
>>> keys, values = mem.gather(0, block_table=[3, 1], num_tokens=3)
>>> keys[:, 0, 0].tolist(), values[:, 0, 0].tolist()
([1.0, 2.0, 3.0], [-1.0, -2.0, -3.0])
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from spec.block_manager import PAD_SLOT
from spec.errors import InvalidRequestError, UnknownBlockError

F64 = NDArray[np.float64]


class KVMemory:
    """K and V for every layer, as float64, in the paged layout."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.shape = shape
        self.num_layers = num_layers
        self.k: list[F64] = [np.full(shape, np.nan) for _ in range(num_layers)]
        self.v: list[F64] = [np.full(shape, np.nan) for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.shape[0] * self.shape[1]

    def write(self, layer: int, key: F64, value: F64, slot_mapping: Sequence[int]) -> None:
        """Write token ``i``'s K and V into slot ``slot_mapping[i]``; :data:`PAD_SLOT` skips.

        The number of tokens is ``len(slot_mapping)``; ``key`` and ``value`` may
        carry extra padding rows after that, which are ignored.
        """
        n = len(slot_mapping)
        self._check_layer(layer)
        row = self.shape[2:]
        for name, x in (("key", key), ("value", value)):
            if x.ndim != 3 or x.shape[1:] != row or x.shape[0] < n:
                raise InvalidRequestError(
                    f"{name} has shape {x.shape}, expected [>= {n}, {row[0]}, {row[1]}]"
                )
        slots = np.asarray(slot_mapping, dtype=np.int64).reshape(n)
        bad = (slots != PAD_SLOT) & ((slots < 0) | (slots >= self.num_slots))
        if bad.any():
            raise InvalidRequestError(
                f"slot {int(slots[bad][0])} is outside 0..{self.num_slots - 1}"
            )
        keep = slots != PAD_SLOT
        self._flat(self.k[layer])[slots[keep]] = key[:n][keep]
        self._flat(self.v[layer])[slots[keep]] = value[:n][keep]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` onto block ``dst`` for K and V of every layer."""
        for src, dst in copies:
            for b in (src, dst):
                if not 0 <= b < self.shape[0]:
                    raise UnknownBlockError(f"block {b} is outside 0..{self.shape[0] - 1}")
        for layer in range(self.num_layers):
            for src, dst in copies:
                self.k[layer][dst] = self.k[layer][src]
                self.v[layer][dst] = self.v[layer][src]

    def gather(self, layer: int, block_table: Sequence[int], num_tokens: int) -> tuple[F64, F64]:
        """A sequence's K and V in logical order, ``[num_tokens, num_kv_heads, head_dim]``."""
        self._check_layer(layer)
        used = block_table[: -(-num_tokens // self.shape[1])]
        bad = [b for b in used if not 0 <= b < self.shape[0]]
        if bad:
            raise UnknownBlockError(
                f"block table entry {bad[0]} is outside 0..{self.shape[0] - 1} "
                "(padding must never be dereferenced)"
            )
        slots = token_slots(block_table, num_tokens, self.shape[1])
        return self._flat(self.k[layer])[slots], self._flat(self.v[layer])[slots]

    def _flat(self, x: F64) -> F64:
        return x.reshape(self.num_slots, *self.shape[2:])

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise InvalidRequestError(f"layer {layer} is outside 0..{self.num_layers - 1}")


def token_slots(block_table: Sequence[int], num_tokens: int, block_size: int) -> NDArray[np.int64]:
    """Slots of positions ``0 .. num_tokens - 1``: ``table[p // B] * B + p % B``."""
    if len(block_table) * block_size < num_tokens:
        raise InvalidRequestError(
            f"{len(block_table)} blocks of {block_size} cannot hold {num_tokens} tokens"
        )
    p = np.arange(num_tokens, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    return table[p // block_size] * block_size + p % block_size
