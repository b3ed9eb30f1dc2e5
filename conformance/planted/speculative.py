"""Planted speculative-decoding bugs: each breaks one rule of :mod:`spec.speculative`.

Three are kernel bugs in the numpy backend; two are memory-side bugs, in a
block manager that the lockstep uses in place of the spec's (the backend's
``planted_block_manager`` attribute, :mod:`conformance.lockstep.driver`), so
that the suite's memory checks of the speculative rules must catch them. Each
is a class of bug that serving engines have shipped:

* rejected K/V still visible after a rollback (a cache whose length was not
  rewound, mlx-lm PR 1486);
* lookahead allocated for one new token when ``1 + k`` cross a block boundary
  (ROCm ATOM PR 250);
* a block hashed while it held a draft, still named after the rollback (vLLM
  PR 12333 added ``uncache_blocks`` for it);
* a sliding window measured from the speculative length rather than each
  query's own position;
* a kernel that cannot address a multi-token step across two blocks
  (vllm-rbln issue 326).

A kernel bug is limited to the rows a decode kernel would take: ``2 .. 1 +
MAX_DRAFT`` new tokens after cached context (short prefill chunks look the
same to a kernel, and are caught alike).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from conformance.lockstep.numpy_backend import F32, Ints, NumpyPagedBackend
from conformance.lockstep.plan import MAX_DRAFT
from spec.backend import FloatArray, KVGeometry
from spec.block_manager import BlockManager, _Sequence, cdiv
from spec.prefix_cache import prompt_block_hashes


def _decode_row(query_len: int, seq_len: int) -> bool:
    """A row a speculative decode kernel takes: 1 + k tokens after cached context."""
    return 1 < query_len <= 1 + MAX_DRAFT and seq_len > query_len


class StaleAfterRollback(NumpyPagedBackend):
    """Decode attends to every key its block's fill counter names, not ``seq_len``.

    The backend counts how far each block has been written (reset when
    offset 0 is written) and a one-token decode reads that many keys of its
    last block, unmasked. Without speculation the count equals the
    sequence's length; after a rollback it still counts the rejected drafts,
    so the next decode sees them: the suite must decode right after a
    verification that kept the rejected slots in the last block.
    """

    def create_cache(self, geometry: KVGeometry) -> None:
        super().create_cache(geometry)
        self._fill: dict[tuple[int, int], int] = {}  # (layer, block) -> slots written from 0

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        super().write_kv(layer, key, value, slot_mapping)
        b = self._geo().block_size
        for slot in slot_mapping:
            if slot >= 0:
                block, offset = divmod(int(slot), b)
                old = 0 if offset == 0 else self._fill.get((layer, block), 0)
                self._fill[(layer, block)] = max(old, offset + 1)

    def _copy_block(self, layer: int, src: int, dst: int) -> None:
        super()._copy_block(layer, src, dst)
        self._fill[(layer, dst)] = self._fill.get((layer, src), 0)

    def _gather(
        self, layer: int, table: Sequence[int], seq_len: int, first: int = 0
    ) -> tuple[F32, F32]:
        b = self._geo().block_size
        last = cdiv(seq_len, b) - 1
        filled = last * b + self._fill.get((layer, int(table[last])), 0)
        return super()._gather(layer, table, max(seq_len, min(filled, (last + 1) * b)), first)

    def _visible(self, positions: Ints, num_keys: int, seq_len: int) -> NDArray[np.bool_]:
        if positions.size == 1:  # a decode: every key read is taken as context
            return np.ones((1, num_keys), dtype=np.bool_)
        return super()._visible(positions, num_keys, seq_len)


class WindowFromSpeculativeEnd(NumpyPagedBackend):
    """A sliding window measured from the row's last position for every query of a 1 + k row.

    Right for a one-token decode; for a speculative row the verified token's
    query loses the keys between its own window edge and the last draft's.
    """

    def _in_window(self, positions: Ints, num_keys: int, window: int) -> NDArray[np.bool_]:
        n = positions.size
        if positions.size and _decode_row(n, int(positions[-1]) + 1):
            positions = np.full(n, positions[-1], dtype=np.int64)
        return super()._in_window(positions, num_keys, window)


class RowInOneBlock(NumpyPagedBackend):
    """A 1 + k row's keys addressed from its first token's block: ``offset + j``, no next block.

    The kernel reads token ``j`` of the row at the first token's block and
    offset plus ``j``, so a row that crosses a block boundary reads the
    tokens past it from whatever physical block follows.
    """

    def _query_positions(self, seq_len: int, query_len: int) -> Ints:
        self._row = (seq_len - query_len, seq_len) if _decode_row(query_len, seq_len) else None
        return super()._query_positions(seq_len, query_len)

    def _split_position(self, positions: Ints) -> tuple[Ints, Ints]:
        entry, offset = super()._split_position(positions)
        row = getattr(self, "_row", None)
        if row is None:
            return entry, offset
        start, end = row
        b = self._geo().block_size
        inside = (positions >= start) & (positions < end)
        entry = np.where(inside, start // b, entry)
        offset = np.where(inside, start % b + positions - start, offset)
        return entry, offset


class OneTokenLookahead(BlockManager):
    """Lookahead allocated for the verified token only: drafts past its block get no block."""

    def append_slots(
        self, seq_id: int, token_ids: Sequence[int], *, num_draft: int = 0
    ) -> list[int]:
        slots = super().append_slots(seq_id, token_ids, num_draft=num_draft)
        if num_draft:
            seq = self._seqs[seq_id]
            keep = cdiv(len(seq.tokens) - num_draft, self.block_size)
            for block in reversed(seq.table[keep:]):
                self.pool.decref(block)
            del seq.table[keep:]
        return slots


class HashesDrafts(BlockManager):
    """Names full blocks for the prefix cache drafts and all, and keeps the names on rollback."""

    def _name_full_blocks(self, seq: _Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        b, first = self.block_size, len(seq.hashes)
        parent = seq.hashes[-1] if seq.hashes else None
        new = seq.tokens[first * b : len(seq.tokens) // b * b]
        seq.hashes.extend(prompt_block_hashes(new, b, seq.extra_keys, parent=parent))
        for i in range(max(first, seq.released), min(len(seq.hashes), len(seq.table))):
            self.pool.register(seq.table[i], seq.hashes[i])


class _MemoryBug(NumpyPagedBackend):
    """A correct kernel over a planted block manager (the lockstep's memory side)."""

    planted_block_manager: type[BlockManager] = BlockManager


class LookaheadOneToken(_MemoryBug):
    """Lookahead allocated for one token: drafts past a block boundary get no block."""

    planted_block_manager = OneTokenLookahead


class DraftBlocksHashed(_MemoryBug):
    """A block hashed while it holds a draft, still named after the rollback."""

    planted_block_manager = HashesDrafts


PLANTED_SPECULATIVE: dict[str, type[NumpyPagedBackend]] = {
    "rejected K/V still visible after a rollback (block fill not rewound)": StaleAfterRollback,
    "lookahead allocated for one token (drafts past a block boundary)": LookaheadOneToken,
    "block hashed while holding a draft, still named after the rollback": DraftBlocksHashed,
    "sliding window measured from the speculative length": WindowFromSpeculativeEnd,
    "1 + k row addressed within its first block (cannot cross a boundary)": RowInOneBlock,
}
"""The planted speculative bugs, by the bug class each stands for."""
