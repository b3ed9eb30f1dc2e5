"""The values of a vector manifest checked against its geometry, before any backend call.

The schema (:mod:`conformance.vectors.schema_check`) fixes each field's type and
sign; :func:`check_values` checks what the schema cannot: every layer,
block, slot and group index in range of the geometry, one scale pair per
layer, sizes within the readers' limits, the first operation the only
``create_cache`` and its geometry the manifest's (with at least as many
blocks), and a latent layout only from version 2 on, by the spec's rules (one
KV head, ``0 < latent_dim < head_dim``, equal fp8 scales). The C reader
(conformance/vectors/reader_c/) applies the same rules and limits, so a vector
one reader refuses the other refuses too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from conformance.vectors.format import geometry_of, variant_of
from conformance.vectors.safe import VectorError
from spec.errors import SpecError
from spec.kv_geometry import KVGeometry

# The readers' limits (docs/vectors.md); past one, a vector is a setup error.
MAX_LAYERS = 4096
MAX_BLOCK_SIZE = 65536
MAX_HEADS = 4096
MAX_HEAD_DIM = 65536
MAX_BLOCK_VALUES = 1 << 24  # of K and V (or the latent rows) in a block: block_values
MAX_BLOCKS = 1 << 40
MAX_WHOLE_POOL = 1 << 20  # blocks in a read_kv of the whole pool
MAX_CONTEXT = 1 << 24  # a window

_SAME = (
    "num_layers",
    "block_size",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "kv_dtype",
    "kv_scales",
    "layer_groups",
    "latent_dim",  # absent is null
)
"""create_cache's geometry is the manifest's in these (and has at least its blocks)."""


def block_values(g: KVGeometry) -> int:
    """The values one block of a layer holds: K and V, ``2 * B * H_kv * D``, or the latent
    rows, ``B * (latent_dim + rope_dim)``; what the readers' limits count.

    >>> mla = KVGeometry(1, 4, 16, 1, 48, latent_dim=32)
    >>> block_values(KVGeometry(1, 4, 16, 2, 8)), block_values(mla)
    (512, 768)
    """
    return g.block_size * g.num_kv_heads * sum(g.kv_widths)


def check_values(m: Mapping[str, Any], where: str) -> None:
    """Raise :class:`VectorError` naming the first value of schema-valid ``m`` out of range."""
    g, ops = m["geometry"], m["operations"]
    made = ops[0]["geometry"]
    if m["version"] == 1 and g.get("latent_dim") is not None:
        raise VectorError(f"{where}: geometry.latent_dim: format version 1 holds no latent vector")
    _check_geometry(g, made, where)
    heads = m["num_heads"]
    if heads is not None and (heads > MAX_HEADS or heads % g["num_kv_heads"]):
        raise VectorError(
            f"{where}: num_heads {heads} is not a multiple of num_kv_heads <= {MAX_HEADS}"
        )
    if len(m["layer_variants"]) != g["num_layers"]:
        raise VectorError(
            f"{where}: layer_variants holds {len(m['layer_variants'])} entries, one per layer "
            f"is {g['num_layers']}"
        )
    for layer, variant in enumerate(m["layer_variants"]):
        _check_variant(variant, heads, f"{where}: layer_variants[{layer}]")
    if m["tolerance"]["dtype"] != g["dtype"]:
        raise VectorError(f"{where}: tolerance.dtype is not geometry.dtype {g['dtype']!r}")
    blocks, slots = made["num_blocks"], made["num_blocks"] * g["block_size"]
    for i, op in enumerate(ops[1:], start=1):
        at = f"{where}: operations[{i}] ({op['op']})"
        if op["op"] == "create_cache":
            raise VectorError(f"{at}: create_cache comes first, once")
        if "layer" in op:
            _below(op["layer"], g["num_layers"], f"{at}.layer")
        if op["op"] == "write_kv":
            _all_below(op["slot_mapping"], slots, f"{at}.slot_mapping", low=-1)
        elif op["op"] == "copy_blocks":
            _all_below([b for pair in op["copies"] for b in pair], blocks, f"{at}.copies")
        elif op["op"] == "read_kv":
            _check_read(op, blocks, slots, at)
        elif op["op"] == "attention":
            _check_attention(op, g, heads, at)


def _below(value: int, top: int, name: str, low: int = 0) -> None:
    if not low <= value < top:
        raise VectorError(f"{name}: {value} is outside {low}..{top - 1}")


def _all_below(values: Sequence[int], top: int, name: str, low: int = 0) -> None:
    bad = [v for v in values if not low <= v < top]
    if bad:
        raise VectorError(f"{name}: {bad[0]} is outside {low}..{top - 1}")


def _check_geometry(g: Mapping[str, Any], made: Mapping[str, Any], where: str) -> None:
    limits = {
        "num_layers": MAX_LAYERS,
        "block_size": MAX_BLOCK_SIZE,
        "num_kv_heads": MAX_HEADS,
        "head_dim": MAX_HEAD_DIM,
        "num_blocks": MAX_BLOCKS,
    }
    for key, top in limits.items():
        _below(g[key], top + 1, f"{where}: geometry.{key}", low=1)
    for key in _SAME:
        if made.get(key) != g.get(key):
            raise VectorError(f"{where}: operations[0].geometry.{key} is not geometry.{key}")
    _below(
        made["num_blocks"],
        MAX_BLOCKS + 1,
        f"{where}: operations[0].geometry.num_blocks",
        g["num_blocks"],
    )
    for name, d in (("geometry", g), ("operations[0].geometry", made)):
        try:  # kv_scales, layer_groups and the latent layout by the spec's own rules
            geometry = geometry_of(d)
        except SpecError as err:
            raise VectorError(f"{where}: {name}: {err}") from None
    if block_values(geometry) > MAX_BLOCK_VALUES:
        raise VectorError(f"{where}: geometry: a block holds more than {MAX_BLOCK_VALUES} values")
    groups = g["layer_groups"]
    if groups and len(groups) != g["num_layers"]:
        raise VectorError(f"{where}: geometry.layer_groups must be empty or one per layer")
    if g["kv_dtype"] is not None:
        scales = g["kv_scales"]
        if len(scales) != g["num_layers"]:
            raise VectorError(f"{where}: geometry.kv_scales must hold one pair per layer")
        with np.errstate(over="ignore"):  # a scale past float32's range becomes inf: refused
            as32 = np.asarray(scales, dtype=np.float64).astype(np.float32)
        if not (np.isfinite(as32).all() and (as32 > 0).all()):
            raise VectorError(f"{where}: geometry.kv_scales: a scale is not a positive float32")


def _check_read(op: Mapping[str, Any], blocks: int, slots: int, at: str) -> None:
    if op["blocks"] is None and blocks > MAX_WHOLE_POOL:
        raise VectorError(
            f"{at}.blocks: a whole-pool read of {blocks} blocks, past {MAX_WHOLE_POOL}"
        )
    if op["blocks"] is not None:
        _all_below(op["blocks"], blocks, f"{at}.blocks")
    _all_below(op["update_slots"], slots, f"{at}.update_slots")


def _check_attention(
    op: Mapping[str, Any], g: Mapping[str, Any], heads: int | None, at: str
) -> None:
    if heads is None:
        raise VectorError(f"{at}: attention in a vector whose num_heads is null")
    batch = op["batch"]
    if batch["block_size"] != g["block_size"]:
        raise VectorError(f"{at}.batch.block_size is not geometry.block_size")
    group = g["layer_groups"][op["layer"]] if g["layer_groups"] else 0
    for key in ("group_tables", "group_slots"):
        if len(batch[key]) <= group:
            raise VectorError(f"{at}.batch.{key}: no entry for the layer's group {group}")
    _check_variant(op["variant"], heads, f"{at}.variant")


def _check_variant(variant: Mapping[str, Any] | None, heads: int | None, name: str) -> None:
    """A window within the limit; sinks and ALiBi slopes one per query head (none without
    query heads); the rest by :class:`spec.attention.AttentionVariant`."""
    d = variant or {}
    if (d.get("window") or 0) > MAX_CONTEXT:
        raise VectorError(f"{name}.window: past {MAX_CONTEXT}")
    for key in ("sinks", "alibi_slopes"):
        if d.get(key) is not None and len(d[key]) != heads:
            raise VectorError(f"{name}.{key}: not one value per query head ({heads})")
    try:
        variant_of(variant)
    except SpecError as err:
        raise VectorError(f"{name}: {err}") from None
