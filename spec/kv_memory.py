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

A quantized memory (``kv_dtype="fp8_e4m3"``, see :mod:`spec.quant`) stores what
an fp8 cache stores, ``fp8(x / scale)``, and gathers ``stored * scale``:

>>> q = KVMemory(1, 4, 2, 1, 1, kv_dtype="fp8_e4m3", kv_scales=((0.5, 0.25),))
>>> q.write(0, np.array([[[1.3]]]), np.array([[[1.3]]]), slot_mapping=[0])
>>> float(q.k[0][0, 0, 0, 0]), float(q.v[0][0, 0, 0, 0])       # 2.6 -> 2.5; 5.2 -> 5.0
(2.5, 5.0)
>>> [float(x[0, 0, 0]) for x in q.gather(0, [0], 1)]
[1.25, 1.25]

Where a GPU's division may land either side of an fp8 tie
(:func:`spec.quant.quantize_range`), a correct cache may hold either
neighbour: the memory can be told to hold what one holds (:meth:`KVMemory.hold`),
so that later attention reads the KV that is really there:

>>> q.write(0, np.array([[[1.0625]]]), np.array([[[1.0]]]), slot_mapping=[1])  # 2.125: a tie
>>> float(q.k[0][0, 1, 0, 0])
2.0
>>> q.hold(0, 0, [1], np.array([[[2.25]]]))
>>> float(q.k[0][0, 1, 0, 0])
2.25

A pool of more than :data:`LAZY_ELEMENTS` elements per layer (a pool past
2^31 elements, say) is *lazy*: it holds only the blocks written so far, so it
costs memory for what a workload touches, not for its size; every other block
still reads as NaN. ``k`` and ``v`` are then not dense arrays: read it with
:meth:`KVMemory.read_blocks`.

>>> big = KVMemory(1, 2**26, 16, 2, 64)                   # 2^37 elements per layer
>>> big.lazy
True
>>> row = np.ones((1, 2, 64))
>>> big.write(0, row, -row, slot_mapping=[2**30 - 16])    # the last block, offset 0
>>> keys, _ = big.read_blocks(0, [0, 2**26 - 1])
>>> bool(np.isnan(keys[0]).all()), float(keys[1, 0, 0, 0]), bool(np.isnan(keys[1, 1]).all())
(True, 1.0, True)

**The latent layout** (multi-head latent attention, DeepSeek-V2/V3): with
``latent_dim`` set, a layer holds one array of *rows* ``[num_blocks,
block_size, 1, head_dim]`` and no separate V. A token's row is ``[c_kv
(latent_dim), k_rope (rope_dim)]``, ``head_dim = latent_dim + rope_dim``;
:meth:`KVMemory.write` takes ``key`` = c_kv ``[T, 1, latent_dim]`` and
``value`` = k_rope ``[T, 1, rope_dim]`` and stores their concatenation, and
every read returns the same two column ranges (``k`` and ``v`` are views of
them; :meth:`KVMemory.write_latent` names the parts). Slots, copies, padding,
laziness, NaN and fp8 are the rules above, unchanged; what attention reads of
a row is :func:`spec.attention.latent_kv`.

>>> lat = KVMemory(1, 2, 2, num_kv_heads=1, head_dim=3, latent_dim=2)   # rope_dim 1
>>> lat.write_latent(0, c_kv=np.array([[[1.0, 2.0]]]), k_rope=np.array([[[9.0]]]), slot_mapping=[1])
>>> lat.rows[0][0, 1, 0].tolist()                        # slot 1: block 0, offset 1
[1.0, 2.0, 9.0]
>>> [x.shape for x in lat.read_blocks(0, [0])]           # (c_kv, k_rope)
[(1, 2, 1, 2), (1, 2, 1, 1)]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from spec.batch import PAD_BLOCK, check_copies
from spec.block_manager import PAD_SLOT
from spec.errors import ArgumentValueError, InvalidRequestError, UnknownBlockError
from spec.quant import FP8_FORMATS, check_fp8_scale, dequantize, quantize
from spec.validate import check_choice, check_int, check_ints, check_positive

F64 = NDArray[np.float64]

LAZY_ELEMENTS = 2**26
"""Pools of more elements than this per layer (K or V) hold only the blocks written."""


def held_lazily(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether a pool of this shape holds only the blocks written (past :data:`LAZY_ELEMENTS`).

    >>> held_lazily(1 << 20, 16, 8, 128), held_lazily(1024, 16, 8, 128)
    (True, False)
    """
    return num_blocks * block_size * num_kv_heads * head_dim > LAZY_ELEMENTS


def check_latent(latent_dim: object, num_kv_heads: int, head_dim: int) -> int | None:
    """The latent layout's widths, checked: the one rule for memories and geometries.

    ``None`` is the ordinary layout. Otherwise ``latent_dim`` is an int with
    ``0 < latent_dim < head_dim`` (the row is ``[c_kv, k_rope]``, and both parts
    have columns) and there is one KV head: the row is shared by every query head.

    >>> check_latent(512, num_kv_heads=1, head_dim=576)
    512
    >>> check_latent(576, num_kv_heads=1, head_dim=576)
    Traceback (most recent call last):
    ...
    spec.errors.ArgumentValueError: latent_dim must be in 1..575, got 576
    >>> check_latent(512, num_kv_heads=8, head_dim=576)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    spec.errors.ArgumentValueError: num_kv_heads must be 1 for a latent layout ..., got 8
    """
    if latent_dim is None:
        return None
    out = check_int("latent_dim", latent_dim, low=1, high=head_dim - 1)
    if num_kv_heads != 1:
        raise ArgumentValueError(
            "num_kv_heads must be 1 for a latent layout (one row a token shared by every query "
            f"head), got {num_kv_heads}"
        )
    return out


def check_latent_scales(scales: Sequence[tuple[float, float]]) -> None:
    """A latent fp8 cache has one scale a layer for its whole row: ``k_scale == v_scale``.

    (vLLM's MLA cache write takes one scale; two would make c_kv and k_rope
    of one row differ in how they are stored.)
    """
    for i, (k_scale, v_scale) in enumerate(scales):
        if k_scale != v_scale:
            raise ArgumentValueError(
                f"kv_scales[{i}] is ({k_scale}, {v_scale}): a latent cache has one scale for "
                "its whole row, so k_scale and v_scale must be equal"
            )


class _LazyBlocks:
    """One layer's K or V, block by block as first written; a block never written reads as NaN."""

    def __init__(self, block_shape: tuple[int, int, int]) -> None:
        self._shape = block_shape
        self._blocks: dict[int, F64] = {}

    def block(self, block: int) -> F64:
        """The block's array, created (all NaN) on first use."""
        if block not in self._blocks:
            self._blocks[block] = np.full(self._shape, np.nan)
        return self._blocks[block]

    def read(self, blocks: Sequence[int]) -> F64:
        out = np.full((len(blocks), *self._shape), np.nan)
        for j, b in enumerate(blocks):
            if b in self._blocks:
                out[j] = self._blocks[b]
        return out

    def rows(self, slots: NDArray[np.int64]) -> F64:
        b = self._shape[0]
        out = np.full((slots.shape[0], *self._shape[1:]), np.nan)
        for i, s in enumerate(slots.tolist()):
            if s // b in self._blocks:
                out[i] = self._blocks[s // b][s % b]
        return out

    def put(self, slots: NDArray[np.int64], values: F64) -> None:
        b = self._shape[0]
        for s, row in zip(slots.tolist(), values, strict=True):
            self.block(s // b)[s % b] = row

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        sources = {s: self.read([s])[0] for s, _ in pairs}
        for src, dst in pairs:
            self._blocks[dst] = sources[src].copy()


class KVMemory:
    """K and V for every layer, as float64, in the paged layout (fp8 values when quantized).

    With ``latent_dim``, the latent layout: one row array a layer (``rows``),
    and ``k``/``v`` its c_kv and k_rope column ranges (see the module's text).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        kv_dtype: str | None = None,
        kv_scales: Sequence[tuple[float, float]] = (),
        lazy: bool | None = None,
        latent_dim: int | None = None,
    ) -> None:
        dims = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        names = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim")
        num_layers, *rest = (check_positive(n, d) for n, d in zip(names, dims, strict=True))
        self.latent_dim = check_latent(latent_dim, rest[2], rest[3])
        if kv_dtype is not None:
            check_choice("kv_dtype", kv_dtype, FP8_FORMATS)
        self.kv_dtype = kv_dtype
        self.kv_scales = _check_scales(kv_scales, num_layers, kv_dtype)
        if self.latent_dim is not None:
            check_latent_scales(self.kv_scales)
        shape = (rest[0], rest[1], rest[2], rest[3])
        self.shape = shape  # a latent memory's is its rows': [N, B, 1, latent_dim + rope_dim]
        self.widths = (shape[3], shape[3])  # of key and value: write's, and read's
        if self.latent_dim is not None:
            self.widths = (self.latent_dim, shape[3] - self.latent_dim)  # c_kv, k_rope
        self.num_layers = num_layers
        self.lazy = held_lazily(*shape) if lazy is None else bool(lazy)
        self.k: list[F64] = []
        self.v: list[F64] = []
        self.rows: list[F64] = []  # latent and not lazy: each layer's one array; k, v view it
        self._lazy: list[tuple[_LazyBlocks, _LazyBlocks]] = []
        if self.lazy:
            k_block, v_block = ((shape[1], shape[2], w) for w in self.widths)
            self._lazy = [(_LazyBlocks(k_block), _LazyBlocks(v_block)) for _ in range(num_layers)]
        elif self.latent_dim is not None:
            self.rows = [np.full(shape, np.nan) for _ in range(num_layers)]
            self.k = [row[..., : self.latent_dim] for row in self.rows]  # views: c_kv
            self.v = [row[..., self.latent_dim :] for row in self.rows]  # views: k_rope
        else:
            self.k = [np.full(shape, np.nan) for _ in range(num_layers)]
            self.v = [np.full(shape, np.nan) for _ in range(num_layers)]

    @property
    def value_dim(self) -> int:
        """The width of V, and of attention's output: ``latent_dim`` for a latent memory."""
        return self.shape[3] if self.latent_dim is None else self.latent_dim

    @property
    def num_slots(self) -> int:
        return self.shape[0] * self.shape[1]

    def write(self, layer: int, key: F64, value: F64, slot_mapping: Sequence[int]) -> None:
        """Write token ``i``'s K and V into slot ``slot_mapping[i]``; :data:`PAD_SLOT` skips.

        The number of tokens is ``len(slot_mapping)``; ``key`` and ``value`` may
        carry extra padding rows after that, which are ignored. No slot may be
        written twice in one call (the result would depend on the order).
        """
        layer = self._check_layer(layer)
        slots = check_slot_mapping(slot_mapping, self.num_slots)
        n = slots.shape[0]
        for which, (name, x) in enumerate((("key", key), ("value", value))):
            if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
                raise InvalidRequestError(f"{name} must be a float array, got {type(x).__name__}")
            row = (self.shape[2], self.widths[which])
            if x.ndim != 3 or x.shape[1:] != row or x.shape[0] < n:
                part = "" if self.latent_dim is None else _LATENT_PARTS[which]
                raise InvalidRequestError(
                    f"{name} has shape {x.shape}, expected [>= {n}, {row[0]}, {row[1]}]{part}"
                )
        keep = slots != PAD_SLOT
        used = slots[keep]
        for which, x in enumerate((key, value)):
            self._put_slots(layer, which, used, self._store(x[:n][keep], layer, which))

    def write_latent(self, layer: int, c_kv: F64, k_rope: F64, slot_mapping: Sequence[int]) -> None:
        """A latent memory's :meth:`write`, its two parts named: each token's ``c_kv`` ``[T, 1,
        latent_dim]`` and ``k_rope`` ``[T, 1, rope_dim]`` into its row of slot
        ``slot_mapping[i]``."""
        if self.latent_dim is None:
            raise InvalidRequestError("write_latent: this memory has per-head K and V, not rows")
        self.write(layer, c_kv, k_rope, slot_mapping)

    def read_slots(self, layer: int, which: int, slots: Sequence[int]) -> F64:
        """Copies of K (``which`` 0) or V (1) at ``slots`` (not padding), as stored."""
        index = self._held_slots(layer, which, slots)
        return self._read_slots(layer, which, index)

    def hold(self, layer: int, which: int, slots: Sequence[int], rows: F64) -> None:
        """Hold ``rows`` (``[len(slots), H_kv, width]``) in ``slots`` of K (``which`` 0) or V
        (1) as stored values, not quantized again: what a cache holds there (one of the two
        values a correct fp8 write may store at a rounding tie, say)."""
        index = self._held_slots(layer, which, slots)
        new = np.asarray(rows, dtype=np.float64)
        if new.shape != (index.shape[0], self.shape[2], self.widths[which]):
            raise InvalidRequestError(f"rows has shape {new.shape}, expected {len(index)} rows")
        self._put_slots(layer, which, index, new)

    def _held_slots(self, layer: int, which: int, slots: Sequence[int]) -> NDArray[np.int64]:
        self._check_layer(layer)
        check_int("which", which, low=0, high=1)
        index = check_slot_mapping(slots, self.num_slots)
        if (index == PAD_SLOT).any():
            raise ArgumentValueError("slots must be slots of the pool, not padding")
        return index

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` onto block ``dst`` for K and V of every layer.

        The list is checked whole first (:func:`spec.batch.check_copies`), so a
        bad pair changes nothing.
        """
        pairs = check_copies(copies, self.shape[0])
        if not pairs:
            return
        src = np.array([s for s, _ in pairs])
        dst = np.array([d for _, d in pairs])
        for layer in range(self.num_layers):
            if self.lazy:
                for blocks in self._lazy[layer]:
                    blocks.copy(pairs)
            else:
                self.k[layer][dst] = self.k[layer][src]
                self.v[layer][dst] = self.v[layer][src]

    def gather(
        self, layer: int, block_table: Sequence[int], num_tokens: int, *, start: int = 0
    ) -> tuple[F64, F64]:
        """K and V of positions ``start .. num_tokens - 1`` in logical order, dequantized.

        Shapes ``[num_tokens - start, num_kv_heads, head_dim]`` (latent: c_kv and
        k_rope, ``[num_tokens - start, 1, latent_dim]`` and ``[.., 1, rope_dim]``). Only the table
        entries that hold those positions are read; each must be a block id.
        """
        layer = self._check_layer(layer)
        b = self.shape[1]
        num_tokens = check_int("num_tokens", num_tokens, low=0)
        start = check_int("start", start, low=0, high=num_tokens)
        table = check_ints("block_table", block_table, low=PAD_BLOCK)
        if len(table) * b < num_tokens:
            raise InvalidRequestError(f"{len(table)} blocks of {b} cannot hold {num_tokens} tokens")
        skip, used = start // b, table[start // b : -(-num_tokens // b)]
        bad = [x for x in used if not 0 <= x < self.shape[0]]
        if bad:
            raise UnknownBlockError(
                f"block table entry {bad[0]} is outside 0..{self.shape[0] - 1} "
                "(padding and released blocks must never be dereferenced)"
            )
        p = np.arange(start, num_tokens, dtype=np.int64)  # only the entries read are converted
        slots = np.asarray(used, dtype=np.int64)[p // b - skip] * b + p % b
        if self.lazy:
            k, v = (blocks.rows(slots) for blocks in self._lazy[layer])
        else:
            k = self._flat(self.k[layer])[slots]
            v = self._flat(self.v[layer])[slots]
        if self.kv_dtype is None:
            return k, v
        k_scale, v_scale = self.kv_scales[layer]
        return dequantize(k, k_scale), dequantize(v, v_scale)

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> tuple[F64, F64]:
        """Copies of K and V of ``blocks``, ``[len(blocks), B, H_kv, D]`` each, as stored
        (latent: c_kv ``[len(blocks), B, 1, latent_dim]`` and k_rope ``[.., rope_dim]``)."""
        layer = self._check_layer(layer)
        ids = check_ints("blocks", blocks, low=0, high=self.shape[0] - 1)
        if self.lazy:
            k_blocks, v_blocks = self._lazy[layer]
            return k_blocks.read(ids), v_blocks.read(ids)
        index = np.asarray(ids, dtype=np.int64)
        return self.k[layer][index], self.v[layer][index]

    def _read_slots(self, layer: int, which: int, slots: NDArray[np.int64]) -> F64:
        """Copies of K (``which`` 0) or V (1) at ``slots``, as stored."""
        if self.lazy:
            return self._lazy[layer][which].rows(slots)
        out: F64 = self._flat((self.k, self.v)[which][layer])[slots]
        return out

    def _put_slots(self, layer: int, which: int, slots: NDArray[np.int64], rows: F64) -> None:
        if self.lazy:
            self._lazy[layer][which].put(slots, rows)
        else:
            self._flat((self.k, self.v)[which][layer])[slots] = rows

    def _store(self, x: F64, layer: int, which: int) -> F64:
        """What the cache holds for ``x``: itself, or its fp8 value when quantized."""
        if self.kv_dtype is None:
            return np.asarray(x, dtype=np.float64)
        return quantize(x, self.kv_scales[layer][which], self.kv_dtype)

    def _flat(self, x: F64) -> F64:
        """``x`` (a layer's K or V, or a latent row's column range) as ``[slots, H_kv, width]``:
        a view, so writes through it land in the layer's array."""
        out = x.reshape(self.num_slots, *x.shape[2:])
        assert np.may_share_memory(out, x), "a slot view must not be a copy"
        return out

    def _check_layer(self, layer: int) -> int:
        return check_int("layer", layer, low=0, high=self.num_layers - 1)


_LATENT_PARTS = (" (c_kv: latent_dim columns)", " (k_rope: rope_dim columns)")
"""How a latent memory's shape errors name what ``key`` and ``value`` hold."""


def _check_scales(
    scales: Sequence[tuple[float, float]], num_layers: int, kv_dtype: str | None
) -> tuple[tuple[float, float], ...]:
    """One ``(k_scale, v_scale)`` per layer for a quantized memory, none otherwise."""
    pairs = tuple(scales)
    if kv_dtype is None:
        if pairs:
            raise ArgumentValueError("kv_scales are only for a quantized kv_dtype")
        return ()
    if len(pairs) != num_layers:
        raise ArgumentValueError(f"kv_scales needs {num_layers} (k, v) pairs, got {len(pairs)}")
    out = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise ArgumentValueError(f"kv_scales[{i}] must be a (k_scale, v_scale) pair")
        out.append(
            (
                check_fp8_scale(f"kv_scales[{i}][0]", pair[0]),
                check_fp8_scale(f"kv_scales[{i}][1]", pair[1]),
            )
        )
    return tuple(out)


def check_slot_mapping(slot_mapping: object, num_slots: int) -> NDArray[np.int64]:
    """A KV write's slot mapping, checked whole: the one rule the spec and the backends apply.

    Each entry is an int (not a bool, a float or a string: ``True`` is not
    slot 1, and ``1.7`` is not slot 1) that is a slot of the pool or
    :data:`PAD_SLOT`; no slot appears twice (the result would depend on the
    order of the writes). Raises :class:`~spec.errors.ArgumentTypeError` or
    :class:`~spec.errors.ArgumentValueError` naming the entry; returns int64.

    >>> check_slot_mapping([3, -1, 0], num_slots=4).tolist()
    [3, -1, 0]
    >>> check_slot_mapping([1.7], num_slots=4)
    Traceback (most recent call last):
    ...
    spec.errors.ArgumentTypeError: slot_mapping[0] must be an int, got float 1.7
    >>> check_slot_mapping([2, 2], num_slots=4)
    Traceback (most recent call last):
    ...
    spec.errors.ArgumentValueError: slot_mapping writes slot 2 twice (entries 0 and 1)
    """
    slots = check_ints("slot_mapping", slot_mapping)
    if slots and (min(slots) < PAD_SLOT or max(slots) >= num_slots):  # Python ints: no overflow
        i, s = next((i, s) for i, s in enumerate(slots) if not PAD_SLOT <= s < num_slots)
        raise ArgumentValueError(
            f"slot_mapping[{i}] is {s}: slot {s} is outside 0..{num_slots - 1} "
            f"(and is not {PAD_SLOT}, the padding slot)"
        )
    out = np.asarray(slots, dtype=np.int64).reshape(-1)
    used = out[out != PAD_SLOT]
    if np.unique(used).size != used.size:
        seen: dict[int, int] = {}
        for i, s in enumerate(slots):
            if s != PAD_SLOT and s in seen:
                raise ArgumentValueError(
                    f"slot_mapping writes slot {s} twice (entries {seen[s]} and {i})"
                )
            seen[s] = i
    return out


def token_slots(block_table: Sequence[int], num_tokens: int, block_size: int) -> NDArray[np.int64]:
    """Slots of positions ``0 .. num_tokens - 1``: ``table[p // B] * B + p % B``."""
    if len(block_table) * block_size < num_tokens:
        raise InvalidRequestError(
            f"{len(block_table)} blocks of {block_size} cannot hold {num_tokens} tokens"
        )
    p = np.arange(num_tokens, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    return table[p // block_size] * block_size + p % block_size
