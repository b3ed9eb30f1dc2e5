"""A small paged backend in numpy, built from replaceable parts, for the self-test.

It stores K and V in the cache dtype (bfloat16 as float32 holding bfloat16
values; fp8 as float32 holding fp8 values), computes attention in float32 the
way a GPU kernel would, and rounds the output to the activation dtype. Each
step of the computation is one short method, so that :mod:`conformance.planted.backends`
and :mod:`conformance.planted.variants` can break exactly one of them and check
that the suite notices: the variant steps (soft-cap, ALiBi, window, sink
softmax) and the fp8 steps (divide by the scale, saturate, round; multiply
back) included. Cache memory is addressed by element offsets (``block * B *
H_kv * D + ...``), as a kernel addresses it, in int64: a pool past 2^31
elements is allocated lazily (``np.zeros`` maps pages on first touch) and
read back by :meth:`NumpyPagedBackend.read_blocks`.

A latent geometry (multi-head latent attention) is one cache of rows
``[c_kv, k_rope]`` a layer, addressed the same way (one KV head, ``D =
latent_dim + rope_dim``): the parts of it a latent planted bug breaks are the
row a write stores (:meth:`NumpyPagedBackend._latent_row`), the key and value
attention reads of it (:meth:`NumpyPagedBackend._latent_kv`) and where a head
reads its rows (:meth:`NumpyPagedBackend._read`). ``NumpyPagedBackend(latent=None)``
declares the layout (the base of the latent bugs); by default it declares
none, so that the examples drawn for the bugs of ordinary attention are
drawn as they always were.

>>> from spec.backend import Backend
>>> isinstance(NumpyPagedBackend(), Backend)
True
>>> mla = NumpyPagedBackend(latent=None)
>>> mla.create_cache(KVGeometry(1, 2, 2, num_kv_heads=1, head_dim=3, latent_dim=2))
>>> mla.write_kv(0, np.array([[[1.0, 2.0]]]), np.array([[[9.0]]]), slot_mapping=[1])
>>> [x[0, 1, 0].tolist() for x in mla.read_cache(0)]
[[1.0, 2.0], [9.0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import numpy as np
from numpy.typing import NDArray

from conformance.judges.dtypes import round_to
from spec.attention import PLAIN, VARIANTS, AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchMetadata
from spec.block_manager import PAD_SLOT, cdiv
from spec.capabilities import Capabilities
from spec.errors import InvalidRequestError
from spec.kv_geometry import KV_DTYPES, KVGeometry
from spec.quant import FP8_FORMATS, round_fp8

F32 = NDArray[np.float32]
Ints = NDArray[np.int64]


class NumpyPagedBackend:
    """A correct paged backend: the base that every planted bug modifies in one place."""

    name = "numpy"

    def __init__(self, latent: AbstractSet[tuple[int, int]] | None = frozenset()) -> None:
        """``latent``: the latent layouts it declares (:attr:`Capabilities.latent`; ``None``:
        any). Every geometry runs either way; the declaration decides what the suite draws."""
        self.latent = latent
        self._geometry: KVGeometry | None = None
        self._k: list[NDArray[np.floating]] = []
        self._v: list[NDArray[np.floating]] = []

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name,
            device="cpu",
            kv_dtypes=frozenset(KV_DTYPES),
            kv_groups=True,
            variants=frozenset(VARIANTS),
            latent=self.latent,
        )

    def create_cache(self, geometry: KVGeometry) -> None:
        g = geometry
        storage = np.float16 if g.dtype == "float16" and g.kv_dtype is None else np.float32
        shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        self._geometry = g
        self._k = [np.zeros(shape, dtype=storage) for _ in range(g.num_layers)]
        # a latent layer's one cache of rows is K and V at once
        self._v = self._k if g.is_latent else [np.zeros(shape, storage) for _ in self._k]

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        g = self._geo()
        n = len(slot_mapping)
        slots = self._write_slots(np.asarray(slot_mapping, dtype=np.int64).reshape(n))
        keep = self._written(slots)
        row = g.num_kv_heads * g.head_dim
        index = self._slot_offsets(slots[keep])[:, None] + np.arange(row)
        if g.is_latent:  # one row [c_kv, k_rope] a token, with the one scale
            rows = self._latent_row(np.asarray(key)[:n][keep], np.asarray(value)[:n][keep])
            self._k[layer].reshape(-1)[index] = self._store(rows, layer, 0).reshape(-1, row)
            return
        for which, (cache, rows) in enumerate(((self._k[layer], key), (self._v[layer], value))):
            values = self._store(np.asarray(rows)[:n][keep], layer, which)
            cache.reshape(-1)[index] = values.reshape(-1, row)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        for layer in range(self._geo().num_layers):
            for src, dst in copies:
                self._copy_block(layer, src, dst)

    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        g = self._geo()
        variant = PLAIN if variant is None else variant
        q = np.asarray(query, dtype=np.float32)
        parts = [np.zeros((0, q.shape[1], g.value_dim), dtype=np.float32)]
        group = self._table_group(layer)
        for i in range(batch.num_seqs):  # the sequences' rows, in order: every token's
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            positions = self._query_positions(batch.seq_lens[i], end - start)
            first = variant.first_visible(int(positions[0])) if positions.size else 0
            k, v = self._gather(layer, self._table(batch, i, group), batch.seq_lens[i], first)
            visible = self._visible(positions, k.shape[0], batch.seq_lens[i])
            if variant.window is not None:
                visible &= self._in_window(positions, k.shape[0], variant.window)
            parts.append(self._attend(q[start:end], k, v, visible, scale, positions, variant))
        out = np.concatenate(parts[1:] or parts)  # as wide as V is read (latent: c_kv)
        return self._round_output(out)

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        self._geo()
        return self._parts(self._k[layer], self._v[layer])

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> tuple[FloatArray, FloatArray]:
        """K and V of just ``blocks``: ``[len(blocks), B, H_kv, D]`` each (no whole-pool copy)."""
        self._geo()
        ids = np.asarray(blocks, dtype=np.int64)
        return self._parts(self._k[layer][ids], self._v[layer][ids])

    def _parts(
        self, k: NDArray[np.floating], v: NDArray[np.floating]
    ) -> tuple[FloatArray, FloatArray]:
        """What a read returns of these K and V: themselves, or a latent row's c_kv and
        k_rope, as float32 copies."""
        latent = self._geo().latent_dim
        if latent is None:
            return k.astype(np.float32), v.astype(np.float32)
        return k[..., :latent].astype(np.float32), k[..., latent:].astype(np.float32)

    # -- the replaceable parts ----------------------------------------------------

    def _latent_row(self, c_kv: NDArray[np.floating], k_rope: NDArray[np.floating]) -> F32:
        """The row a latent write stores: ``[c_kv, k_rope]``, c_kv first."""
        out: F32 = np.concatenate([c_kv, k_rope], axis=-1).astype(np.float32)
        return out

    def _latent_kv(self, rows: F32) -> tuple[F32, F32]:
        """What attention reads of latent rows: the whole row as the key, its first
        ``latent_dim`` columns (c_kv) as the value (:func:`spec.attention.latent_kv`)."""
        latent = self._geo().latent_dim
        assert latent is not None
        return rows, rows[..., :latent]

    def _store(self, rows: NDArray[np.floating], layer: int, which: int) -> NDArray[np.floating]:
        """What the cache holds for new rows: the values, or their fp8 quantization."""
        g = self._geo()
        if g.kv_dtype is None:
            return round_to(rows, g.dtype)
        scale = np.float32(g.kv_scales[layer][which])
        quotient = np.asarray(rows, dtype=np.float32) / scale  # division in float32
        return self._fp8_round(self._saturate(quotient, g.kv_dtype), g.kv_dtype)

    def _saturate(self, x: F32, kv_dtype: str) -> F32:
        """Clip to the format's finite range: an overflow must not become NaN or infinity."""
        top = np.float32(FP8_FORMATS[kv_dtype].max_finite)
        out: F32 = np.clip(x, -top, top)
        return out

    def _fp8_round(self, x: F32, kv_dtype: str) -> F32:
        """To the nearest fp8 value, ties to even. A value beyond the finite maximum (which
        :meth:`_saturate` has already clipped) becomes what a cast without saturation makes
        of an overflow: NaN in e4m3 (it has no infinity), infinity in e5m2."""
        f = FP8_FORMATS[kv_dtype]
        over = np.abs(x) > f.max_finite
        beyond = np.copysign(np.inf, x) if f.mantissa_bits == 2 else np.full_like(x, np.nan)
        out: F32 = np.where(over, beyond, round_fp8(x, kv_dtype)).astype(np.float32)
        return out

    def _kv_scale(self, layer: int, which: int) -> float:
        """The scale attention multiplies stored K (``which = 0``) or V (1) by."""
        g = self._geo()
        return float(np.float32(g.kv_scales[layer][which])) if g.kv_dtype else 1.0

    def _dequantize(self, stored: F32, scale: float) -> F32:
        """What attention reads from a quantized cache: ``stored * scale``."""
        out: F32 = stored * np.float32(scale)
        return out

    def _write_slots(self, slots: Ints) -> Ints:
        """Where each row goes: the slot mapping as given."""
        return slots

    def _written(self, slots: Ints) -> NDArray[np.bool_]:
        """Which rows are written: all but padding (slot -1)."""
        keep: NDArray[np.bool_] = slots != PAD_SLOT
        return keep

    def _copy_block(self, layer: int, src: int, dst: int) -> None:
        self._k[layer][dst] = self._k[layer][src]
        self._v[layer][dst] = self._v[layer][src]

    def _blocks(self, table: Sequence[int], seq_len: int) -> list[int]:
        """The physical blocks holding positions ``0 .. seq_len - 1``, through the table."""
        return list(table[: cdiv(seq_len, self._geo().block_size)])

    def _num_keys(self, seq_len: int) -> int:
        return seq_len

    def _table_group(self, layer: int) -> int:
        """The KV cache group whose tables ``layer`` reads: its own."""
        return self._geo().group_of(layer)

    def _table(self, batch: BatchMetadata, i: int, group: int) -> Sequence[int]:
        """Sequence ``i``'s block table row in KV cache group ``group``."""
        return batch.tables(group)[i]

    def _split_position(self, positions: Ints) -> tuple[Ints, Ints]:
        """Position ``p`` is entry ``p // B`` of the table, offset ``p % B`` in that block."""
        return np.divmod(positions, self._geo().block_size)

    def _block_offsets(self, blocks: Ints) -> Ints:
        """Element offset of each block's start in a layer's cache: ``block * B * H_kv * D``."""
        g = self._geo()
        out: Ints = blocks.astype(np.int64) * (g.block_size * g.num_kv_heads * g.head_dim)
        return out

    def _slot_offsets(self, slots: Ints) -> Ints:
        """Element offset of each slot's row: its block's offset plus ``offset * H_kv * D``."""
        g = self._geo()
        blocks, offsets = np.divmod(slots.astype(np.int64), g.block_size)
        out: Ints = self._block_offsets(blocks) + offsets * (g.num_kv_heads * g.head_dim)
        return out

    def _gather(
        self, layer: int, table: Sequence[int], seq_len: int, first: int = 0
    ) -> tuple[F32, F32]:
        """Keys and values of positions ``0 .. n - 1``, each found through the block table.

        Positions before ``first`` (which no query sees: their blocks may have
        been released, their entries ``-1``) are zeros, never read.
        """
        g = self._geo()
        blocks = np.asarray(self._blocks(table, seq_len) or [0], dtype=np.int64)
        n = min(self._num_keys(seq_len), len(self._blocks(table, seq_len)) * g.block_size)
        read = np.arange(n) >= first
        entry, offset = self._split_position(np.arange(n, dtype=np.int64)[read])
        row = g.num_kv_heads * g.head_dim
        start = self._block_offsets(blocks[entry]) + offset * row
        k = self._read(self._k[layer], start, n, read)
        if g.is_latent:  # one read of the rows serves the key and the value
            if g.kv_dtype is not None:
                k = self._dequantize(k, self._kv_scale(layer, 0))
            return self._latent_kv(k)
        v = self._read(self._v[layer], start, n, read)
        if g.kv_dtype is not None:
            k = self._dequantize(k, self._kv_scale(layer, 0))
            v = self._dequantize(v, self._kv_scale(layer, 1))
        return k, v

    def _read(
        self, cache: NDArray[np.floating], start: Ints, n: int, read: NDArray[np.bool_]
    ) -> F32:
        """``n`` rows ``[n, H_kv, D]`` of ``cache``: those in ``read`` from element offsets
        ``start``, zeros elsewhere."""
        g = self._geo()
        shape = (n, g.num_kv_heads, g.head_dim)
        out = np.zeros(shape, dtype=np.float32)
        index = start[:, None] + np.arange(g.num_kv_heads * g.head_dim)
        out[read] = cache.reshape(-1)[index].reshape(-1, *shape[1:])
        return out

    def _query_positions(self, seq_len: int, query_len: int) -> Ints:
        """New tokens are the last ``query_len`` positions of the sequence."""
        return np.arange(seq_len - query_len, seq_len, dtype=np.int64)

    def _visible(self, positions: Ints, num_keys: int, seq_len: int) -> NDArray[np.bool_]:
        """Causal: the query at position ``p`` sees keys ``0 .. p``."""
        mask: NDArray[np.bool_] = np.arange(num_keys)[None, :] <= positions[:, None]
        return mask

    def _in_window(self, positions: Ints, num_keys: int, window: int) -> NDArray[np.bool_]:
        """A window of ``w``: the query at ``p`` sees keys ``p - w < k`` (and causal ``k <= p``)."""
        mask: NDArray[np.bool_] = np.arange(num_keys)[None, :] > positions[:, None] - window
        return mask

    def _kv_head(self, head: int, num_heads: int, num_kv_heads: int) -> int:
        return head // (num_heads // num_kv_heads)

    def _scale(self, scale: float, head_dim: int) -> float:
        return scale

    def _scores(self, q: F32, k: F32, scale: float, softcap: float | None) -> F32:
        """Scaled scores ``[n, t]`` of one head, soft-capped when the layer caps them."""
        scores: F32 = self._dot(q, k) * np.float32(self._scale(scale, self._geo().head_dim))
        return scores if softcap is None else self._softcap(scores, softcap)

    def _softcap(self, scores: F32, cap: float) -> F32:
        out: F32 = np.float32(cap) * np.tanh(scores / np.float32(cap))
        return out

    def _alibi(self, scores: F32, positions: Ints, slope: float) -> F32:
        """ALiBi: ``slope * (k - p)``, a penalty growing with the distance back to key ``k``."""
        distance = (np.arange(scores.shape[1])[None, :] - positions[:, None]).astype(np.float32)
        out: F32 = scores + np.float32(slope) * distance
        return out

    def _sink_softmax(self, scores: F32, sink: float) -> F32:
        """Softmax with one more logit, the sink: in the max and the denominator, with no value."""
        s = np.float32(sink)
        top = np.maximum(scores.max(axis=-1, keepdims=True), s)
        weights = np.exp(scores - top)
        out: F32 = weights / (weights.sum(axis=-1, keepdims=True) + np.exp(s - top))
        return out

    def _softmax(self, scores: F32) -> F32:
        shifted = scores - scores.max(axis=-1, keepdims=True)
        weights = np.exp(shifted)
        out: F32 = weights / weights.sum(axis=-1, keepdims=True)
        return out

    def _weighted_sum(self, scores: F32, v: F32) -> F32:
        """Softmax of the masked scores ``[n, t]``, applied to the values ``[t, D]``."""
        out: F32 = self._softmax(scores) @ v
        return out

    def _dot(self, q: F32, k: F32) -> F32:
        """Query-key products ``[n, t]`` of one head: ``q [n, D] @ k [t, D].T`` in float32."""
        out: F32 = q @ k.T
        return out

    def _round_output(self, out: F32) -> F32:
        """The output in the activation dtype (round to nearest, ties to even)."""
        rounded: F32 = round_to(out, self._geo().dtype).astype(np.float32)
        return rounded

    # -- internals ----------------------------------------------------------------

    def _attend(
        self,
        q: F32,
        k: F32,
        v: F32,
        visible: NDArray[np.bool_],
        scale: float,
        positions: Ints,
        variant: AttentionVariant,
    ) -> F32:
        num_heads = q.shape[1]
        out = np.zeros((*q.shape[:2], v.shape[2]), dtype=np.float32)  # latent: c_kv wide
        for h in range(num_heads):
            kv = self._kv_head(h, num_heads, k.shape[1])
            scores = self._scores(q[:, h], k[:, kv], scale, variant.softcap)
            if variant.alibi_slopes is not None:
                scores = self._alibi(scores, positions, variant.alibi_slopes[h])
            masked = np.where(visible, scores, np.float32(-np.inf))
            if variant.sinks is None:
                out[:, h] = self._weighted_sum(masked, v[:, kv])
            else:
                out[:, h] = self._sink_softmax(masked, variant.sinks[h]) @ v[:, kv]
        return out

    def _geo(self) -> KVGeometry:
        if self._geometry is None:
            raise InvalidRequestError("create_cache() must be called first")
        return self._geometry
