"""Reading test-vector files as hostile input: confined paths, bounded sizes, strict JSON.

A vector directory may come from anywhere, so nothing in it is trusted:

* an array a manifest names must be ``arrays/NNN.npy``, a regular file (not a
  symbolic link) whose resolved path lies inside the resolved vector
  directory (:func:`confined`);
* a file's size is checked before it is read, and a file larger than its
  limit, or one that is not a regular file (``/dev/zero``, a FIFO), is
  refused without reading it (:func:`read_bounded`);
* a manifest is strict JSON (RFC 8259) in UTF-8: no ``NaN`` or ``Infinity``, no
  number too large for a double or written in more than
  :data:`MAX_NUMBER_CHARS` characters, no duplicate key, at most
  :data:`MAX_MEMBERS` members an object, nesting at most :data:`MAX_DEPTH`
  deep (:func:`parse_json`); an integer is one that fits in 64 bits (a larger
  one reads as a number that is not an integer).

Every refusal is a :class:`VectorError` (a setup
error, exit status 2) naming the file and what is wrong.

>>> parse_json(b'{"a": [1, 2.5]}', "m.json")
{'a': [1, 2.5]}
>>> parse_json(b'{"a": NaN}', "m.json")
Traceback (most recent call last):
...
conformance.vectors.safe.VectorError: m.json: not valid JSON: NaN is not a JSON number
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path

from conformance.errors import SetupError

MAX_MANIFEST_BYTES = 16 << 20
MAX_ARRAY_BYTES = 256 << 20
MAX_DEPTH = 64
MAX_MEMBERS = 256  # per object: a manifest's objects have at most a dozen
MAX_NUMBER_CHARS = 63  # characters of one number, as written
ARRAY_NAME = re.compile(r"arrays/[0-9]+\.npy")


class VectorError(SetupError):
    """A vector directory, manifest or array is missing, malformed or of another version."""


def confined(directory: Path, name: object, where: str) -> Path:
    """The path of array ``name`` inside ``directory``; refused if it could lead outside.

    The name must be ``arrays/NNN.npy`` (so neither absolute nor holding
    ``..``), neither ``arrays`` nor the file may be a symbolic link, and the
    resolved path must lie inside the resolved directory.
    """
    if not isinstance(name, str) or not ARRAY_NAME.fullmatch(name):
        raise VectorError(f"{where}: {name!r} is not an array path of the form arrays/NNN.npy")
    path = directory / name
    for part in (directory / "arrays", path):
        if part.is_symlink():
            raise VectorError(f"{where}: {part} is a symbolic link (refused)")
    try:
        real, root = path.resolve(strict=True), directory.resolve(strict=True)
    except OSError as err:
        raise VectorError(f"{where}: cannot resolve {path}: {err}") from err
    if not real.is_relative_to(root):
        raise VectorError(f"{where}: {path} resolves outside the vector directory")
    return path


def read_bounded(path: Path, limit: int, where: str) -> bytes:
    """The bytes of regular file ``path``, at most ``limit`` of them, checked before reading."""
    try:
        info = os.lstat(path)
    except OSError as err:
        raise VectorError(f"{where}: cannot read {path}: {err}") from err
    if stat.S_ISLNK(info.st_mode):
        raise VectorError(f"{where}: {path} is a symbolic link (refused)")
    if not stat.S_ISREG(info.st_mode):
        raise VectorError(f"{where}: {path} is not a regular file")
    if info.st_size > limit:
        raise VectorError(f"{where}: {path} has {info.st_size} bytes, past the limit of {limit}")
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise VectorError(f"{where}: cannot read {path}: {err}") from err
    if len(data) > limit:
        raise VectorError(f"{where}: {path} grew past the limit of {limit} bytes while read")
    return data


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of more than {MAX_NUMBER_CHARS} characters")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a double")
    return value


def _integer(text: str) -> int | float:
    """An integer literal: an int when it fits in 64 bits (signed), else a number that is not
    an integer (so a field that must be an integer refuses it, and one that takes any number
    does not), as the C reader reads it."""
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of more than {MAX_NUMBER_CHARS} characters")
    value = int(text)
    return value if -(1 << 63) <= value < 1 << 63 else _finite(text)


def _object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    if len(pairs) > MAX_MEMBERS:
        raise ValueError(f"an object of more than {MAX_MEMBERS} members")
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_json(data: bytes, where: str) -> object:
    """Strict JSON (see the module docstring); :class:`VectorError` names what is wrong."""
    try:
        value = json.loads(
            data.decode("utf-8"),
            parse_constant=_constant,
            parse_float=_finite,
            parse_int=_integer,
            object_pairs_hook=_object,
        )
    except RecursionError:
        raise VectorError(f"{where}: not valid JSON: nested deeper than {MAX_DEPTH}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise VectorError(f"{where}: not valid JSON: {err}") from err
    _check_depth(value, where)
    return value


def _check_depth(value: object, where: str) -> None:
    """Nesting at most MAX_DEPTH, walked without recursion (so a deep value cannot overflow)."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        if isinstance(item, dict | list) and depth >= MAX_DEPTH:
            raise VectorError(f"{where}: not valid JSON: nested deeper than {MAX_DEPTH}")
        stack.extend((child, depth + 1) for child in children)
