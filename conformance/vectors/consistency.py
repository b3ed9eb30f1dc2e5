"""A vector's operations checked in order, before any backend call: each reads what was written.

:func:`check_operations` walks a schema-valid manifest whose values are in
range (:mod:`conformance.vectors.validate`) the way a replay would, without a
backend, and refuses the vector (:class:`~conformance.vectors.safe.VectorError`,
a setup error) at the first operation that is not one a correct backend can run:

* **arrays**: each of the documented shape, every value finite, and ``kv``,
  ``query`` and ``update`` values ones their format holds exactly
  (:func:`representable`): the activation dtype (so float32 too, whichever of
  float32 or float64 the file stores), or the fp8 format for an fp8 cache's
  ``update``, which holds the stored values;
* **writes**: a slot mapping that names no slot twice
  (:func:`spec.kv_memory.check_slot_mapping`); copy lists by
  :func:`spec.batch.check_copies`;
* **attention**: the batch by :meth:`spec.batch.BatchMetadata.validate` (every
  table entry of every group, the padding, the slot mapping against the
  tables), exactly one table row per sequence in each group, the variant
  its layer's (``layer_variants``), and every key a query sees in a block of
  the pool that the vector's writes filled, slot by slot (copies carry that
  along): otherwise the backend would be blamed for memory the vector never
  wrote;
* **reads**: an ``update`` names only written slots, and a block is read only
  once every slot of it has expected contents from an ``update``;
* **limits**: at most :data:`MAX_WORK` multiply-adds of attention and
  :data:`MAX_CACHE_VALUES` values of cache and expected image per vector.

Then replaying can only pass or fail: what it compares is defined. The C reader
(conformance/vectors/reader_c/) checks the same rules before it computes, so
that both readers give one vector the same verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from conformance.judges.numerics import MANTISSA_BITS, MIN_NORMAL_EXPONENT
from conformance.vectors.format import (
    batch_of,
    geometry_of,
    kv_rows,
    kv_shape,
    load_array,
    variant_of,
)
from conformance.vectors.safe import VectorError, confined
from conformance.vectors.validate import MAX_CONTEXT, block_values
from spec.attention import AttentionVariant
from spec.batch import BatchMetadata, check_copies
from spec.block_manager import PAD_BLOCK
from spec.errors import SpecError
from spec.kv_geometry import DTYPE_MAX, KVGeometry
from spec.kv_memory import check_slot_mapping
from spec.quant import FP8_FORMATS

MAX_WORK = 1 << 33
"""Multiply-adds of attention in one vector (keys seen x query heads x head dim, summed)."""
MAX_CACHE_VALUES = 1 << 27
"""Values the cache and the expected image hold, over the blocks the vector touches."""


@dataclass(frozen=True)
class NumberFormat:
    """A float format by its mantissa bits, smallest normal exponent and largest finite value."""

    mantissa_bits: int
    min_exponent: int
    max_finite: float


def number_format(name: str) -> NumberFormat:
    """An activation dtype's format, or an fp8 KV dtype's.

    >>> number_format("float16")
    NumberFormat(mantissa_bits=10, min_exponent=-14, max_finite=65504.0)
    """
    if name in FP8_FORMATS:
        f = FP8_FORMATS[name]
        return NumberFormat(f.mantissa_bits, f.min_exponent, f.max_finite)
    return NumberFormat(MANTISSA_BITS[name], MIN_NORMAL_EXPONENT[name], DTYPE_MAX[name])


def representable(x: NDArray[Any], fmt: NumberFormat) -> NDArray[np.bool_]:
    """Where ``x`` is a finite value of ``fmt``: within its range, and a whole number of its
    quantum ``2 ** (max(e, min_exponent) - mantissa_bits)`` at the value's exponent ``e``.

    >>> representable(np.array([1.0, 1.0 + 2**-10, 1.0 + 2**-11, 65504.0, 7e4]),
    ...               number_format("float16")).tolist()
    [True, True, False, True, False]
    """
    v = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        ok = np.isfinite(v) & (np.abs(v) <= fmt.max_finite)
        exponent = np.frexp(np.where(ok, v, 0.0))[1] - 1
        quantum = np.ldexp(1.0, np.maximum(exponent, fmt.min_exponent) - fmt.mantissa_bits)
        whole = np.rint(v / quantum) * quantum == v
    out: NDArray[np.bool_] = ok & whole
    return out


@dataclass
class _Walk:
    """What a replay would have done so far: slots written, slots given expected contents."""

    directory: Path
    manifest: Mapping[str, Any]
    geometry: KVGeometry  # create_cache's: the pool the operations address
    arrays: dict[str, NDArray[Any]] = field(default_factory=dict)
    written: dict[int, set[int]] = field(default_factory=dict)  # per layer
    expected: dict[int, set[int]] = field(default_factory=dict)  # per layer: slots in the image
    cache_blocks: set[tuple[int, int]] = field(default_factory=set)  # (layer, block) held
    image_blocks: set[tuple[int, int]] = field(default_factory=set)
    work: int = 0
    at: str = ""  # the operation being checked, for messages

    def refuse(self, what: str) -> VectorError:
        return VectorError(f"{self.directory / 'manifest.json'}: {self.at}{what}")

    def array(self, op: Mapping[str, Any], key: str, shape: tuple[int | None, ...]) -> NDArray[Any]:
        """The array ``op[key]`` names: its ``shape`` (``None``: any size) and finite values
        checked."""
        name = op[key]
        where = f"{self.directory}: {self.at}{key}"
        out = load_array(confined(self.directory, name, where))
        fits = out.ndim == len(shape) and all(
            w in (None, n) for w, n in zip(shape, out.shape, strict=False)
        )
        if not fits:
            want = ["any" if w is None else w for w in shape]
            raise self.refuse(f"{key}: {name} has shape {list(out.shape)}, expected {want}")
        if not np.isfinite(out).all():
            raise self.refuse(f"{key}: {name} holds a NaN or infinite value")
        self.arrays[name] = out
        return out

    def exact_in(self, x: NDArray[Any], fmt: str, key: str, name: str) -> None:
        bad = np.flatnonzero(~representable(x, number_format(fmt)))
        if bad.size:
            value = float(x.reshape(-1)[bad[0]])
            raise self.refuse(f"{key}: {name} holds {value!r}, which {fmt} cannot hold exactly")

    def hold(self, blocks: set[tuple[int, int]], layer: int, ids: Any) -> None:
        """Note blocks the C reader allocates; refuse past :data:`MAX_CACHE_VALUES`."""
        blocks.update((layer, int(b)) for b in ids)
        per_block = block_values(self.geometry)
        if (len(self.cache_blocks) + len(self.image_blocks)) * per_block > MAX_CACHE_VALUES:
            raise self.refuse(
                f"the cache and the expected image would hold more than {MAX_CACHE_VALUES} "
                "values, past the readers' limit"
            )


def check_operations(directory: Path, manifest: Mapping[str, Any]) -> dict[str, NDArray[Any]]:
    """Refuse the first operation of ``manifest`` no correct backend can run (see the module
    docstring); the arrays, loaded and checked, by the names the operations give them."""
    ops: Sequence[Mapping[str, Any]] = manifest["operations"]
    walk = _Walk(directory, manifest, geometry_of(ops[0]["geometry"]))
    steps: dict[str, Callable[[_Walk, Mapping[str, Any]], None]] = {
        "write_kv": _write,
        "copy_blocks": _copy,
        "attention": _attention,
        "read_kv": _read,
    }
    for index, op in enumerate(ops[1:], start=1):
        walk.at = f"operations[{index}] ({op['op']}): "
        check = steps.get(op["op"])
        if check is not None:
            check(walk, op)
    return walk.arrays


def _write(walk: _Walk, op: Mapping[str, Any]) -> None:
    g, layer = walk.geometry, op["layer"]
    slots = op["slot_mapping"]
    kv = walk.array(op, "kv", kv_shape(g, None))
    if kv_rows(g, kv) < len(slots):
        raise walk.refuse(f"kv has {kv_rows(g, kv)} rows for {len(slots)} slot_mapping entries")
    walk.exact_in(kv, g.dtype, "kv", op["kv"])
    try:
        mapped = check_slot_mapping(slots, g.num_blocks * g.block_size)
    except SpecError as err:
        raise walk.refuse(str(err)) from None
    stored = mapped[mapped >= 0]
    walk.written.setdefault(layer, set()).update(stored.tolist())
    walk.hold(walk.cache_blocks, layer, np.unique(stored // g.block_size))


def _copy(walk: _Walk, op: Mapping[str, Any]) -> None:
    g = walk.geometry
    try:
        pairs = check_copies([tuple(p) for p in op["copies"]], g.num_blocks)
    except SpecError as err:
        raise walk.refuse(str(err)) from None
    b = g.block_size
    for layer in range(g.num_layers):
        filled = walk.written.setdefault(layer, set())
        moved = {dst * b + off: src * b + off in filled for src, dst in pairs for off in range(b)}
        filled.difference_update(s for s, kept in moved.items() if not kept)
        filled.update(s for s, kept in moved.items() if kept)
        walk.hold(walk.cache_blocks, layer, [x for pair in pairs for x in pair])


def _attention(walk: _Walk, op: Mapping[str, Any]) -> None:
    g, m, layer = walk.geometry, walk.manifest, op["layer"]
    variant = _variant(walk, op["variant"], "variant")
    declared = _variant(walk, m["layer_variants"][layer], f"layer_variants[{layer}]")
    if variant != declared:
        raise walk.refuse(f"variant is not layer_variants[{layer}], the layer's")
    d = op["batch"]
    seqs = len(d["seq_lens"])
    for key in ("group_tables", "group_slots"):
        if len(d[key]) != len(d["group_tables"]):
            raise walk.refuse("batch.group_slots must hold one slot mapping per group's tables")
    for i, rows in enumerate(d["group_tables"]):
        if len(rows) != seqs:
            raise walk.refuse(
                f"batch.group_tables[{i}] has {len(rows)} rows, one per sequence is {seqs}"
            )
    try:
        batch = batch_of(d)
        batch.validate(g.num_blocks)
    except SpecError as err:
        raise walk.refuse(f"batch: {err}") from None
    heads = m["num_heads"]
    t = batch.num_tokens
    walk.exact_in(walk.array(op, "query", (t, heads, g.head_dim)), g.dtype, "query", op["query"])
    walk.array(op, "expected", (2, t, heads, g.value_dim))  # latent: [.., latent_dim]
    group = g.layer_groups[layer] if g.layer_groups else 0
    for i in range(batch.num_seqs):
        _keys_seen(walk, batch, i, group, layer, variant, heads * g.head_dim)


def _variant(walk: _Walk, d: Mapping[str, Any] | None, name: str) -> AttentionVariant:
    try:
        return variant_of(d)
    except SpecError as err:
        raise walk.refuse(f"{name}: {err}") from None


def _keys_seen(
    walk: _Walk,
    batch: BatchMetadata,
    i: int,
    group: int,
    layer: int,
    variant: AttentionVariant,
    per_key: int,
) -> None:
    """Sequence ``i``'s queries see keys in blocks of the pool, in written slots; its work."""
    b = batch.block_size
    rows = batch.positions[batch.query_start_loc[i] : batch.query_start_loc[i + 1]]
    firsts = [variant.first_visible(p) for p in rows]
    seen = max(p - f + 1 for p, f in zip(rows, firsts, strict=True))
    if seen > MAX_CONTEXT:
        raise walk.refuse(f"a query sees {seen} keys, past the readers' limit of {MAX_CONTEXT}")
    walk.work += sum(p - f + 1 for p, f in zip(rows, firsts, strict=True)) * per_key
    if walk.work > MAX_WORK:
        raise walk.refuse(f"more than {MAX_WORK} multiply-adds of attention, past the limit")
    keys = np.arange(min(firsts), max(rows) + 1)  # a window only moves forward: one range
    table = np.asarray(batch.tables(group)[i], dtype=np.int64)
    blocks = table[keys // b]
    released = keys[blocks == PAD_BLOCK]
    seq = batch.seq_ids[i]
    if released.size:
        raise walk.refuse(f"sequence {seq} sees position {released[0]} in a released block")
    slots = blocks * b + keys % b
    missing = set(slots.tolist()) - walk.written.get(layer, set())
    if missing:
        raise walk.refuse(
            f"sequence {seq} sees slot {min(missing)} of layer {layer}, which no write_kv of the "
            "vector filled"
        )


def _read(walk: _Walk, op: Mapping[str, Any]) -> None:
    g, layer = walk.geometry, op["layer"]
    slots = op["update_slots"]
    if op["update"] is not None:
        update = walk.array(op, "update", kv_shape(g, len(slots)))
        walk.exact_in(update, g.kv_dtype or g.dtype, "update", op["update"])
    elif slots:
        raise walk.refuse("update_slots name slots, but update is null")
    unwritten = [s for s in slots if s not in walk.written.get(layer, ())]
    if unwritten:  # the image would blame the backend for what the vector never wrote
        raise walk.refuse(
            f"update_slots: slot {unwritten[0]} of layer {layer} was never written by the "
            "vector's write_kv operations"
        )
    image = walk.expected.setdefault(layer, set())
    image.update(slots)
    b = g.block_size
    walk.hold(walk.image_blocks, layer, {s // b for s in slots})
    if op["blocks"] is None and len(image) < g.num_blocks * b:
        raise walk.refuse(
            f"the whole pool of layer {layer} is read before an update gave every slot of it "
            "its expected contents"
        )
    for block in op["blocks"] or ():
        if any(block * b + off not in image for off in range(b)):
            raise walk.refuse(
                f"block {block} of layer {layer} is read before an update gave every slot of it "
                "its expected contents"
            )
