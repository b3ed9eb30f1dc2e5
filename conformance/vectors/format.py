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

import ast
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from conformance.judges import numerics
from conformance.vectors.safe import (
    MAX_ARRAY_BYTES,
    MAX_MANIFEST_BYTES,
    VectorError,
    parse_json,
    read_bounded,
)
from conformance.vectors.schema_check import schema_error

__all__ = ["VectorError", "load_array", "read_manifest", "save_array", "tolerance"]

FORMAT = "paged-spec-vectors"
VERSION = 1
MANIFEST = "manifest.json"
ARRAYS = "arrays"
_MAGIC = b"\x93NUMPY\x01\x00"
_DTYPES = {"<f4": np.float32, "<f8": np.float64}
TOLERANCE_RULE = "same-precision-ulps"
_MAX_DIMS = 8


def save_array(path: Path, array: NDArray[Any]) -> None:
    """Write ``array`` (float32 or float64) as a version 1.0 little-endian C-order ``.npy``."""
    a = np.ascontiguousarray(array)
    if a.dtype not in (np.float32, np.float64):
        raise TypeError(f"vectors store float32 or float64 arrays, got {a.dtype}")
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        np.lib.format.write_array(f, a, version=(1, 0), allow_pickle=False)


def load_array(path: Path) -> NDArray[Any]:
    """Read a ``.npy`` of the documented subset; :class:`VectorError` names what is wrong."""
    data = read_bounded(path, MAX_ARRAY_BYTES, str(path))
    if data[:8] != _MAGIC:
        raise VectorError(f"{path}: not a version 1.0 .npy file (magic bytes {data[:8]!r})")
    size = int.from_bytes(data[8:10], "little")
    try:
        header = ast.literal_eval(data[10 : 10 + size].decode("latin1"))
        descr, fortran, shape = header["descr"], header["fortran_order"], tuple(header["shape"])
        if not all(type(d) is int and d >= 0 for d in shape) or len(shape) > _MAX_DIMS:
            raise ValueError(f"shape {shape!r} is not a tuple of at most {_MAX_DIMS} sizes")
    except (ValueError, SyntaxError, KeyError, TypeError, MemoryError, RecursionError) as err:
        raise VectorError(f"{path}: unreadable .npy header: {err}") from err
    if descr not in _DTYPES or fortran is not False:
        raise VectorError(
            f"{path}: dtype {descr!r}, fortran_order {fortran!r}: "
            "vectors use '<f4' or '<f8' in C order"
        )
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
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(manifest, indent=1, allow_nan=False)
    (directory / MANIFEST).write_text(text + "\n")


def read_manifest(directory: Path) -> dict[str, Any]:
    """A vector's manifest: strict JSON of bounded size, of this format and version, valid by
    the schema (conformance/vectors/schema/vectors.schema.json); :class:`VectorError` if not."""
    path = directory / MANIFEST
    manifest = parse_json(read_bounded(path, MAX_MANIFEST_BYTES, str(path)), str(path))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise VectorError(f'{path}: not a {FORMAT} manifest (no "format": "{FORMAT}")')
    version = manifest.get("version")
    if type(version) is not int or version != VERSION:
        raise VectorError(f"{path}: format version {version!r}, this reader reads {VERSION}")
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
