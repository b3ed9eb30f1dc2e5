"""The test-vector format: one directory per example, a JSON manifest and ``.npy`` arrays.

Everything a reader needs is in these files, so that an engine in any language
can replay the suite's workloads without this project's code:

* ``manifest.json``: the format and version, the geometry and options, the
  tolerance rule with its parameters, and the ordered operations (see
  ``conformance/vectors/schema/vectors.schema.json`` and docs/vectors.md);
* ``arrays/NNNNNN.npy``: the float arrays the operations name, in the subset
  of NumPy's ``.npy`` format written and read here (:func:`save_array`,
  :func:`load_array`): version 1.0, a little-endian ``<f4`` or ``<f8``
  dtype, C order, no pickled objects.

Every problem with a vector is a :class:`VectorError` naming the file and the
field, raised before the backend is called for that vector.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d:
...     save_array(Path(d) / "a.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
...     load_array(Path(d) / "a.npy").tolist()
[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
"""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from conformance.judges import numerics
from conformance.output_files import write_output
from conformance.vectors.safe import (
    MAX_ARRAY_BYTES,
    MAX_MANIFEST_BYTES,
    VectorError,
    parse_json,
    read_bounded,
)
from conformance.vectors.schema_check import schema_error
from spec.attention import PLAIN, AttentionVariant
from spec.batch import BatchMetadata, GroupLayout
from spec.kv_geometry import KVGeometry

__all__ = [
    "VectorError",
    "batch_of",
    "geometry_of",
    "join_kv",
    "kv_rows",
    "kv_shape",
    "load_array",
    "read_manifest",
    "save_array",
    "split_kv",
    "tolerance",
    "variant_of",
]

FORMAT = "paged-spec-vectors"
VERSION = 2
"""The version an export writes. Version 2 added the latent layout (:func:`kv_shape`); a
version 1 vector has none and reads as it always did."""
READS = (1, 2)
"""The versions :func:`read_manifest` reads."""
MANIFEST = "manifest.json"
ARRAYS = "arrays"
_MAGIC = b"\x93NUMPY\x01\x00"
_DTYPES = {"<f4": np.float32, "<f8": np.float64}
TOLERANCE_RULE = "same-precision-ulps"
_MAX_DIMS = 8
_DIM = rb"(?:0|[1-9][0-9]{0,17})"
_HEADER = re.compile(
    rb"\{'descr': '(?P<descr><f[48])', 'fortran_order': False, 'shape': "
    rb"\((?P<shape>(?:" + _DIM + rb"(?:, " + _DIM + rb")*,?)?)\), \} *\n"
)
"""The header of the documented subset: the dictionary numpy writes, padded with spaces, then a
newline. A dimension is written as numpy writes it (no leading zero), in at most 18 digits."""


def save_array(path: Path, array: NDArray[Any]) -> None:
    """Write ``array`` (float32 or float64) as a version 1.0 little-endian C-order ``.npy``."""
    a = np.ascontiguousarray(array)
    if a.dtype not in (np.float32, np.float64):
        raise TypeError(f"vectors store float32 or float64 arrays, got {a.dtype}")
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    data = io.BytesIO()
    np.lib.format.write_array(data, a, version=(1, 0), allow_pickle=False)
    write_output(path, data.getvalue(), durable=False)


def load_array(path: Path) -> NDArray[Any]:
    """Read a ``.npy`` of the documented subset; :class:`VectorError` names what is wrong."""
    data = read_bounded(path, MAX_ARRAY_BYTES, str(path))
    if data[:8] != _MAGIC:
        raise VectorError(f"{path}: not a version 1.0 .npy file (magic bytes {data[:8]!r})")
    size = int.from_bytes(data[8:10], "little")
    if 10 + size > len(data):
        raise VectorError(f"{path}: the .npy header runs past the end of the file")
    header = _HEADER.fullmatch(data[10 : 10 + size])
    if header is None:
        raise VectorError(
            f"{path}: the .npy header is not the dictionary of a little-endian float32 or "
            f"float64 C-order array, as numpy writes it: {data[10 : 10 + size][:80]!r}"
        )
    descr = header["descr"].decode()
    shape = tuple(int(d) for d in re.findall(rb"[0-9]+", header["shape"]))
    if len(shape) > _MAX_DIMS:
        raise VectorError(f"{path}: a .npy array of {len(shape)} dimensions, past {_MAX_DIMS}")
    body = data[10 + size :]
    count = math.prod(shape)
    dtype = np.dtype(descr)
    if len(body) != count * dtype.itemsize:
        raise VectorError(
            f"{path}: {len(body)} data bytes, expected {count * dtype.itemsize} for {descr}{shape}"
        )
    out: NDArray[Any] = (
        np.frombuffer(body, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    )
    return out


def tolerance(dtype: str) -> dict[str, Any]:
    """The parameters of the output tolerance rule for ``dtype`` (conformance.judges.numerics)."""
    return {
        "rule": TOLERANCE_RULE,
        "dtype": dtype,
        "mantissa_bits": numerics.MANTISSA_BITS[dtype],
        "min_normal_exponent": numerics.MIN_NORMAL_EXPONENT[dtype],
        "magnitude_floor": numerics.MAGNITUDE_FLOOR[dtype],
        "ratio": numerics.RATIO[dtype],
        "floor_ulps": numerics.FLOOR_ULPS[dtype],
        "mean_ratio": numerics.MEAN_RATIO[dtype],
        "mean_floor_ulps": numerics.MEAN_FLOOR_ULPS[dtype],
        "bias_limit_ulps": numerics.BIAS_LIMIT_ULPS[dtype],
        "bias_clip_ulps": numerics._BIAS_CLIP_ULPS,
        "min_samples": numerics.MIN_SAMPLES,
    }


def check_tolerance(where: str, given: object) -> str:
    """The dtype of a manifest's tolerance, which must be this suite's rule with its parameters.

    The check judges outputs with :mod:`conformance.judges.numerics` itself, so a
    vector whose parameters differ (made by another version) is refused.
    """
    if not isinstance(given, Mapping) or given.get("dtype") not in numerics.MANTISSA_BITS:
        raise VectorError(f"{where}: tolerance must be an object naming a dtype")
    want = tolerance(str(given["dtype"]))
    for key, value in want.items():
        if given.get(key) != value:
            raise VectorError(
                f"{where}: tolerance.{key} is {given.get(key)!r}, this suite's is {value!r}: "
                "export the vectors again with this version"
            )
    return str(given["dtype"])


def write_manifest(directory: Path, manifest: Mapping[str, Any]) -> None:
    text = json.dumps(manifest, indent=1, allow_nan=False)
    write_output(directory / MANIFEST, text + "\n", durable=False)


def read_manifest(directory: Path) -> dict[str, Any]:
    """A vector's manifest: strict JSON of bounded size, of this format and version, valid by
    the schema (conformance/vectors/schema/vectors.schema.json); :class:`VectorError` if not."""
    path = directory / MANIFEST
    manifest = parse_json(read_bounded(path, MAX_MANIFEST_BYTES, str(path)), str(path))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise VectorError(f'{path}: not a {FORMAT} manifest (no "format": "{FORMAT}")')
    version = manifest.get("version")
    if type(version) is not int or version not in READS:
        reads = " and ".join(map(str, READS))
        raise VectorError(f"{path}: format version {version!r}, this reader reads {reads}")
    error = schema_error(manifest)
    if error:
        raise VectorError(f"{path}: {error} (conformance/vectors/schema/vectors.schema.json)")
    return manifest


def vector_dirs(root: Path) -> list[Path]:
    """The vector directories under ``root`` (or ``root`` itself), in name order."""
    if not root.is_dir():
        raise VectorError(f"{root}: no such directory of vectors")
    if (root / MANIFEST).is_file():
        return [root]
    found = sorted(p.parent for p in root.glob(f"*/{MANIFEST}"))
    if not found:
        raise VectorError(f"{root}: no vectors here (no */{MANIFEST}); make some with 'export'")
    return found


def geometry_of(d: Mapping[str, Any]) -> KVGeometry:
    """A manifest geometry as the spec's :class:`~spec.kv_geometry.KVGeometry`."""
    return KVGeometry(
        num_layers=int(d["num_layers"]),
        num_blocks=int(d["num_blocks"]),
        block_size=int(d["block_size"]),
        num_kv_heads=int(d["num_kv_heads"]),
        head_dim=int(d["head_dim"]),
        dtype=str(d["dtype"]),
        kv_dtype=None if d["kv_dtype"] is None else str(d["kv_dtype"]),
        kv_scales=tuple((float(k), float(v)) for k, v in d["kv_scales"]),
        layer_groups=tuple(int(x) for x in d["layer_groups"]),
        latent_dim=None if d.get("latent_dim") is None else int(d["latent_dim"]),
    )


def kv_shape(g: KVGeometry, rows: int | None) -> tuple[int | None, ...]:
    """The shape of a ``kv`` or ``update`` array of ``rows`` rows (``None``: any number): K
    then V, ``[2, rows, H_kv, D]``; or, of a latent geometry, the rows as the cache stores
    them, ``[rows, 1, latent_dim + rope_dim]``: c_kv, then k_rope (the parts' widths differ).

    >>> mla = KVGeometry(1, 4, 2, 1, 48, latent_dim=32)
    >>> kv_shape(KVGeometry(1, 4, 2, 2, 8), 3), kv_shape(mla, 3)
    ((2, 3, 2, 8), (3, 1, 48))
    """
    if g.is_latent:
        return (rows, 1, g.head_dim)
    return (2, rows, g.num_kv_heads, g.head_dim)


def kv_rows(g: KVGeometry, array: NDArray[Any]) -> int:
    """How many rows a ``kv`` or ``update`` array of :func:`kv_shape` holds."""
    return int(array.shape[0] if g.is_latent else array.shape[1])


def split_kv(g: KVGeometry, array: NDArray[Any]) -> tuple[NDArray[Any], NDArray[Any]]:
    """A ``kv`` or ``update`` array's two parts, as a backend writes and reads them: K and V,
    or c_kv and k_rope (:attr:`~spec.kv_geometry.KVGeometry.kv_widths` wide).

    >>> g = KVGeometry(1, 4, 2, 1, 3, latent_dim=2)
    >>> [x.tolist() for x in split_kv(g, np.array([[[1.0, 2.0, 9.0]]]))]
    [[[[1.0, 2.0]]], [[[9.0]]]]
    """
    if g.is_latent:
        return array[..., : g.latent_dim], array[..., g.latent_dim :]
    return array[0], array[1]


def join_kv(g: KVGeometry, key: NDArray[Any], value: NDArray[Any]) -> NDArray[Any]:
    """The ``kv`` or ``update`` array of two parts (the inverse of :func:`split_kv`)."""
    if g.is_latent:
        return np.concatenate([key, value], axis=-1)
    return np.stack([key, value])


def variant_of(d: Mapping[str, Any] | None) -> AttentionVariant:
    """A manifest variant (``None``: plain attention) as an :class:`AttentionVariant`."""
    if d is None:
        return PLAIN
    sinks, slopes = d.get("sinks"), d.get("alibi_slopes")
    return AttentionVariant(
        window=d.get("window"),
        softcap=d.get("softcap"),
        sinks=None if sinks is None else tuple(float(x) for x in sinks),
        alibi_slopes=None if slopes is None else tuple(float(x) for x in slopes),
    )


def batch_of(d: Mapping[str, Any]) -> BatchMetadata:
    """The batch of an attention operation (the :meth:`BatchMetadata.arrays` layout)."""
    tables = [tuple(tuple(int(b) for b in row) for row in t) for t in d["group_tables"]]
    slots = [tuple(int(s) for s in group) for group in d["group_slots"]]
    return BatchMetadata(
        block_size=int(d["block_size"]),
        seq_ids=tuple(int(x) for x in d["seq_ids"]),
        query_start_loc=tuple(int(x) for x in d["query_start_loc"]),
        seq_lens=tuple(int(x) for x in d["seq_lens"]),
        block_tables=tables[0],
        slot_mapping=slots[0],
        positions=tuple(int(x) for x in d["positions"]),
        copies=tuple((int(s), int(t)) for s, t in d["copies"]),
        extra_groups=tuple(GroupLayout(t, s) for t, s in zip(tables[1:], slots[1:], strict=True)),
    )
