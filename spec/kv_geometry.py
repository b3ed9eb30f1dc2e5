"""The shape of a KV cache, and the dtypes the backend contract knows by name.

A :class:`KVGeometry` is what :meth:`spec.backend.Backend.create_cache`
allocates: per layer, K and V caches of ``[num_blocks, block_size, H_kv, D]``,
in an activation dtype or a quantized fp8 one, and the KV cache group of
each layer. It comes before the contract (:mod:`spec.backend`, which
re-exports it) because the declaration of what a backend supports
(:mod:`spec.capabilities`) is checked against it too.

>>> g = KVGeometry(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=64)
>>> g.bytes_per_token, g.cache_dtype, g.group_of(1)   # 2 x 2 layers x 2 heads x 64 x 4 bytes
(2048, 'float32', 0)

A latent geometry (multi-head latent attention, :mod:`spec.kv_memory`) keeps
one row of ``latent_dim + rope_dim`` a token and layer, and no separate V:
DeepSeek-V3's 61 layers of 512 + 64 in bfloat16 cost 68.6 KiB a token.

>>> mla = KVGeometry(61, 8, 64, num_kv_heads=1, head_dim=576, dtype="bfloat16", latent_dim=512)
>>> mla.is_latent, mla.rope_dim, mla.value_dim, mla.kv_widths, mla.bytes_per_token
(True, 64, 512, (512, 64), 70272)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from spec.errors import ArgumentTypeError, ArgumentValueError
from spec.kv_budget import kv_bytes_per_token, latent_bytes_per_token
from spec.kv_memory import check_latent, check_latent_scales
from spec.quant import FP8_FORMATS, check_fp8_scale
from spec.validate import check_choice, check_int, check_positive

DTYPES = ("float32", "float16", "bfloat16")
"""Activation dtypes the contract knows, by name (numpy has no bfloat16): the query and output,
and the cache itself unless it is quantized."""

KV_DTYPES = tuple(FP8_FORMATS)
"""Quantized KV cache dtypes: ``fp8_e4m3`` and ``fp8_e5m2`` (see :mod:`spec.quant`)."""

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
"""Bytes per element of each dtype."""

DTYPE_MAX = {
    "float32": float(np.finfo(np.float32).max),
    "float16": float(np.finfo(np.float16).max),
    "bfloat16": float.fromhex("0x1.fep127"),
}
"""The largest finite value of each activation dtype (numpy has no bfloat16: its bits, by hand)."""


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a KV cache: ``num_layers`` x (K, V) x ``[num_blocks, block_size, H_kv, D]``.

    ``dtype`` is the activation dtype. ``kv_dtype`` (``None``, or one of
    :data:`KV_DTYPES`) quantizes the cache, with ``kv_scales[layer] =
    (k_scale, v_scale)``. ``layer_groups[layer]`` is the KV cache group whose
    block tables and slots the layer uses (:meth:`BatchMetadata.tables`);
    empty means every layer is in group 0.

    ``latent_dim`` (``None``: the ordinary layout) is the latent layout of
    multi-head latent attention: ``num_kv_heads`` is 1, ``head_dim`` is the
    row's width ``latent_dim + rope_dim``, and each layer holds one cache of
    rows ``[c_kv, k_rope]`` (no separate V; V is the first ``latent_dim``
    columns). A quantized latent cache has one scale a layer for the whole
    row, so each ``(k_scale, v_scale)`` pair must be equal (vLLM's MLA cache
    write takes one scale).
    """

    num_layers: int  # layers that keep K and V
    num_blocks: int  # blocks in each layer's K (and V) cache
    block_size: int  # tokens per block (B)
    num_kv_heads: int  # KV heads (H_kv); query heads are a multiple
    head_dim: int  # elements per head (D)
    dtype: str = "float32"  # the activations' dtype (queries, new K and V, outputs)
    kv_dtype: str | None = None  # None: the cache stores ``dtype``; else an fp8 format
    kv_scales: tuple[tuple[float, float], ...] = ()  # per layer (k_scale, v_scale), fp8 only
    layer_groups: tuple[int, ...] = ()  # each layer's KV cache group; empty: all in group 0
    latent_dim: int | None = None  # latent layout: rows [c_kv (latent_dim), k_rope]; None: K, V

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            check_positive(name, getattr(self, name))
        check_choice("dtype", self.dtype, DTYPES)
        check_latent(self.latent_dim, self.num_kv_heads, self.head_dim)
        if self.kv_dtype is not None:
            check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
            if len(self.kv_scales) != self.num_layers:
                raise ArgumentValueError(
                    f"kv_scales must hold one (k_scale, v_scale) per layer ({self.num_layers}), "
                    f"got {len(self.kv_scales)}"
                )
            for i, pair in enumerate(self.kv_scales):
                if not isinstance(pair, tuple) or len(pair) != 2:
                    raise ArgumentTypeError(f"kv_scales[{i}] must be a (k_scale, v_scale) tuple")
                for j, s in enumerate(pair):
                    check_fp8_scale(f"kv_scales[{i}][{j}]", s)
            if self.latent_dim is not None:
                check_latent_scales(self.kv_scales)
        elif self.kv_scales:
            raise ArgumentValueError("kv_scales are only for a quantized kv_dtype")
        if self.layer_groups:
            if len(self.layer_groups) != self.num_layers:
                raise ArgumentValueError(
                    f"layer_groups must name a group for each of {self.num_layers} layers, "
                    f"got {len(self.layer_groups)}"
                )
            used = {
                check_int(f"layer_groups[{i}]", g, low=0) for i, g in enumerate(self.layer_groups)
            }
            if used != set(range(len(used))):
                raise ArgumentValueError(f"layer_groups must number groups 0..G-1: {sorted(used)}")

    @property
    def cache_dtype(self) -> str:
        """What the cache stores: ``kv_dtype`` if quantized, else ``dtype``."""
        return self.kv_dtype or self.dtype

    @property
    def num_groups(self) -> int:
        return 1 + max(self.layer_groups, default=0)

    def group_of(self, layer: int) -> int:
        """The KV cache group of ``layer``."""
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        return self.layer_groups[layer] if self.layer_groups else 0

    @property
    def is_latent(self) -> bool:
        """Whether this is the latent layout (one row a token and layer, no separate V)."""
        return self.latent_dim is not None

    @property
    def rope_dim(self) -> int | None:
        """The rotary key's width in a latent row, ``head_dim - latent_dim``; ``None`` otherwise."""
        return None if self.latent_dim is None else self.head_dim - self.latent_dim

    @property
    def value_dim(self) -> int:
        """The width of V and of attention's output: ``latent_dim``, or ``head_dim``."""
        return self.head_dim if self.latent_dim is None else self.latent_dim

    @property
    def kv_widths(self) -> tuple[int, int]:
        """The widths of :meth:`~spec.backend.Backend.write_kv`'s ``key`` and ``value`` (and of
        what reads return): ``(head_dim, head_dim)``, or ``(latent_dim, rope_dim)``."""
        if self.latent_dim is None:
            return self.head_dim, self.head_dim
        return self.latent_dim, self.head_dim - self.latent_dim

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across every layer (latent: one row a layer)."""
        per = DTYPE_BYTES[self.cache_dtype]
        if self.latent_dim is not None:
            rope = self.head_dim - self.latent_dim
            return latent_bytes_per_token(self.num_layers, self.latent_dim, rope, per)
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, per)

    @property
    def num_elements(self) -> int:
        """Elements of one layer's K (or V, or latent row) cache: offsets into it must not be
        computed in int32."""
        return self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim


def check_kv_values(
    name: str, x: NDArray[np.floating], slots: NDArray[np.int64], geometry: KVGeometry
) -> None:
    """The rows of new K (or V) that a write stores fit the cache: one rule for every backend.

    An unquantized cache holds the activation dtype, so a finite value beyond
    that dtype's largest (:data:`DTYPE_MAX`: 1e6 into a float16 cache) is
    refused with :class:`~spec.errors.ArgumentValueError`: stored, it would
    become infinity without a word. Rows of padding slots, and rows past the
    slot mapping, are not stored and not checked; infinities and NaN are
    values of the dtype and pass. A quantized (fp8) cache does not refuse: it
    saturates, as :func:`spec.quant.quantize` defines.

    >>> g = KVGeometry(1, 2, 2, 1, 1, dtype="float16")
    >>> check_kv_values("key", np.array([[[7e4]], [[1.0]]]), np.array([-1, 0]), g)  # pad: unread
    >>> check_kv_values("key", np.array([[[1.0]], [[7e4]]]), np.array([-1, 0]), g)
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    spec.errors.ArgumentValueError: key[1] holds 70000.0, beyond float16's largest finite value ...
    """
    if geometry.kv_dtype is not None:
        return
    top = DTYPE_MAX[geometry.dtype]
    rows = np.asarray(x[: slots.shape[0]])
    stored = (slots != -1).reshape((-1,) + (1,) * (rows.ndim - 1))
    with np.errstate(invalid="ignore"):
        too_big = stored & np.isfinite(rows) & (np.abs(rows) > top)
    if too_big.any():
        where = tuple(int(i) for i in np.argwhere(too_big)[0])
        raise ArgumentValueError(
            f"{name}[{where[0]}] holds {float(rows[where])}, beyond {geometry.dtype}'s largest "
            f"finite value {top}: the cache would store it as infinity"
        )
