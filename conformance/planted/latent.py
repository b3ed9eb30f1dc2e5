"""Planted bugs in latent KV (multi-head latent attention): each the latent numpy backend with
one latent step broken.

Each is a mistake an MLA kernel can make in a few characters, each exact on
ordinary K and V (so only the latent geometries the suite draws show it), and
each needs a latent workload as the suite draws it
(:mod:`conformance.lockstep.plan`): a model scale that is not the row width's,
c_kv and k_rope of their own widths, several query heads on the one row.
Each is registered in :data:`conformance.planted.backends.PLANTED` (through
:data:`PLANTED_LATENT`), so the self-test runs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from conformance.lockstep.numpy_backend import F32, Ints, NumpyPagedBackend
from spec.attention import AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchMetadata


class _LatentBug(NumpyPagedBackend):
    """A planted latent bug: the numpy backend declaring every latent layout."""

    def __init__(self) -> None:
        super().__init__(latent=None)


class LatentScaleFromWidth(_LatentBug):
    """The softmax scale of a latent layer is ``1 / sqrt(row width)`` (``1 / sqrt(576)`` for
    DeepSeek-V3), derived from the cache, not the model's scale as given."""

    def _scale(self, scale: float, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim) if self._geo().is_latent else scale


class LatentValueAtRope(_LatentBug):
    """V is read ``latent_dim`` wide from the row's end, ``rope_dim`` columns late: it takes
    the rope columns and misses the first of c_kv (a value pointer offset by the rope width)."""

    def _latent_kv(self, rows: F32) -> tuple[F32, F32]:
        key, value = super()._latent_kv(rows)
        return key, rows[..., rows.shape[-1] - value.shape[-1] :]


class LatentValueWholeRow(_LatentBug):
    """V is the whole row, c_kv and k_rope: the output comes back ``latent_dim + rope_dim``
    wide, the shape of the query rather than ``[T, H, latent_dim]``."""

    def _latent_kv(self, rows: F32) -> tuple[F32, F32]:
        return rows, rows


class LatentRopeLeftOut(_LatentBug):
    """The score is ``q_latent . c_kv`` alone: the rope part ``q_rope . k_rope`` is left out."""

    def _latent_kv(self, rows: F32) -> tuple[F32, F32]:
        key, value = super()._latent_kv(rows)
        no_rope = key.copy()
        no_rope[..., value.shape[-1] :] = 0.0
        return no_rope, value


class LatentRowPerHead(_LatentBug):
    """The latent row is read per query head, as if the cache had heads: head ``h`` reads at
    ``slot * D + h * D``, the row ``h`` slots on, so heads see each other's offsets.

    Exact with one query head: only a latent example with several shows it.
    """

    _heads = 1  # query heads of the current attention call

    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        self._heads = int(np.asarray(query).shape[1])
        with np.errstate(invalid="ignore", over="ignore"):  # a neighbour's row may be poison
            return super().attention(layer, query, batch, scale, variant=variant)

    def _read(
        self, cache: NDArray[np.floating], start: Ints, n: int, read: NDArray[np.bool_]
    ) -> F32:
        if not self._geo().is_latent:
            return super()._read(cache, start, n, read)
        d = self._geo().head_dim
        out = np.zeros((n, self._heads, d), dtype=np.float32)
        for h in range(self._heads):  # head h's "own" row: h rows on (wrapping at the end)
            index = (start[:, None] + h * d + np.arange(d)) % cache.size
            out[read, h] = cache.reshape(-1)[index]
        return out


class LatentRopeFirst(_LatentBug):
    """The write stores ``[k_rope, c_kv]``: the rope part first in the row, where c_kv goes."""

    def _latent_row(self, c_kv: NDArray[np.floating], k_rope: NDArray[np.floating]) -> F32:
        return super()._latent_row(k_rope, c_kv)


class LatentPerHeadShapes(_LatentBug):
    """Declares the latent layout, but reads the cache back as per-head K and V would be: both
    the whole row, ``[N, B, 1, latent_dim + rope_dim]``, not c_kv and k_rope."""

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        if not self._geo().is_latent:
            return super().read_cache(layer)
        rows = self._k[layer].astype(np.float32)
        return rows, rows.copy()

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> tuple[FloatArray, FloatArray]:
        if not self._geo().is_latent:
            return super().read_blocks(layer, blocks)
        rows = self._k[layer][np.asarray(blocks, dtype=np.int64)].astype(np.float32)
        return rows, rows.copy()


PLANTED_LATENT: dict[str, type[NumpyPagedBackend]] = {
    "latent score scale from the cache width (1/sqrt(latent + rope))": LatentScaleFromWidth,
    "latent V read at the rope columns (offset by rope_dim)": LatentValueAtRope,
    "latent V read as the whole row (c_kv and k_rope)": LatentValueWholeRow,
    "latent rope part left out of the score": LatentRopeLeftOut,
    "latent row read per query head (heads see each other's offsets)": LatentRowPerHead,
    "latent write stores k_rope before c_kv": LatentRopeFirst,
    "latent layout declared, per-head K and V shapes returned": LatentPerHeadShapes,
}
"""The latent planted bugs, by the bug class each stands for."""
