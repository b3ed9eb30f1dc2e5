"""A corpus of malformed test vectors, made by mutating real exported ones.

Each :class:`Case` copies a vector (arrays hard-linked where the file system
allows) and breaks it one way: the cases the hostile-input review found
(issue 21) by name, and systematic ones (every field of one operation of each
kind deleted, an unknown field added to every object). Both readers must
refuse every case as a setup error (tests/test_vectors_hostile.py and
tests/test_vectors_c_hostile.py).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vectors_fixtures import Exported, manifests

from conformance.vectors.format import load_array, save_array

Manifest = dict[str, Any]
Edit = Callable[[Manifest, Path], object]  # what it returns is ignored


@dataclass(frozen=True)
class Case:
    """One way to break a vector: ``edit`` changes the copy's manifest (or files) in place."""

    name: str
    edit: Edit
    fp8: bool = False  # mutate a vector with an fp8 cache and two layers


def ops(m: Manifest, kind: str) -> list[dict[str, Any]]:
    return [o for o in m["operations"] if o["op"] == kind]


def _raw(text: str) -> Edit:
    """Replace the whole manifest file with ``text`` (written after the edit)."""

    def edit(m: Manifest, d: Path) -> None:
        m.clear()
        m["__raw__"] = text

    return edit


def _sub(old: str, new: str) -> Edit:
    """Replace the first ``old`` in the manifest's JSON text by ``new``."""

    def edit(m: Manifest, d: Path) -> None:
        text = json.dumps(m)
        assert old in text, old
        m.clear()
        m["__raw__"] = text.replace(old, new, 1)

    return edit


def _set(path: str, value: object) -> Edit:
    """Set a field given as ``kind:key.key[i]`` (``kind`` the first operation of that kind)."""

    def edit(m: Manifest, d: Path) -> None:
        target: Any = m
        kind, _, rest = path.rpartition(":")
        if kind:
            target = ops(m, kind)[0]
        keys = rest.replace("]", "").replace("[", ".").split(".")
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        last = keys[-1]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return edit


def _both_geometries(key: str, value: object) -> Edit:
    def edit(m: Manifest, d: Path) -> None:
        m["geometry"][key] = value
        m["operations"][0]["geometry"][key] = value

    return edit


def _array(kind: str, key: str, change: Callable[[Path], object]) -> Edit:
    def edit(m: Manifest, d: Path) -> None:
        path = d / ops(m, kind)[0][key]
        path.unlink()  # hard-linked: never change the source's file
        change(path)

    return edit


def _values(kind: str, key: str, fn: Callable[[np.ndarray[Any, Any]], None]) -> Edit:
    def edit(m: Manifest, d: Path) -> None:
        path = d / ops(m, kind)[0][key]
        data = load_array(path).copy()
        path.unlink()
        fn(data)
        save_array(path, data)

    return edit


def _npy(header: str, body: bytes = b"") -> Callable[[Path], None]:
    def write(path: Path) -> None:
        h = header.encode("latin1")
        path.write_bytes(b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + body)

    return write


def _link(kind: str, key: str, target: str) -> Edit:
    def edit(m: Manifest, d: Path) -> None:
        path = d / ops(m, kind)[0][key]
        path.unlink()
        path.symlink_to(target)

    return edit


def _arrays_dir_outside(m: Manifest, d: Path) -> None:
    outside = d.parent / f"{d.name}-outside"
    shutil.copytree(d / "arrays", outside)
    shutil.rmtree(d / "arrays")
    (d / "arrays").symlink_to(outside)


def _sparse(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(300 << 20)  # past the 256 MiB limit; no disk used


def _heads_3_of_2(m: Manifest, d: Path) -> None:
    _both_geometries("num_kv_heads", 2)(m, d)
    m["num_heads"] = 3


def _drop_first_write_slot(m: Manifest, d: Path) -> None:
    ops(m, "write_kv")[0]["slot_mapping"].pop()  # the background write misses the last slot


NAMED: list[Case] = [
    # JSON text
    Case("string ending in backslash", _raw('{"format": "paged-spec-vectors\\')),
    Case("string ending in \\u", _raw('{"format": "paged-spec-vectors\\u')),
    Case("short \\u escape", _raw('{"format": "\\u12"}')),
    Case("unterminated string", _raw('{"format": "paged')),
    Case("array nested 100000 deep", _raw("[" * 100000 + "]" * 100000)),
    Case(
        "manifest nested 100000 deep",
        _sub('"operations": [', '"operations": [' + "[" * 100000 + "]" * 100000 + ", "),
    ),
    Case("empty manifest", _raw("")),
    Case("NUL byte in a string", _sub('"paged-spec-vectors"', '"paged-spec\u0000-vectors"')),
    Case("trailing text", lambda m, d: m.__setitem__("__raw__", json.dumps(m) + " {}")),
    Case("duplicate key", _sub('"version": ', '"version": 2, "version": ')),
    Case("number inf", _sub('"num_layers": ', '"num_layers": Infinity, "x": ')),
    Case("number nan", _sub('"num_layers": ', '"num_layers": NaN, "x": ')),
    Case("number hex", _sub('"num_layers": ', '"num_layers": 0x1, "x": ')),
    Case("number 1e999", _sub('"num_layers": ', '"num_layers": 1e999, "x": ')),
    Case("number with leading zero", _sub('"num_layers": ', '"num_layers": 01, "x": ')),
    Case("NaN scale", _sub('"scale": ', '"scale": NaN, "x": ')),
    # the manifest's fields
    Case("version true", _set("version", True)),
    Case("version 3", _set("version", 3)),
    Case("num_layers 2.5", _both_geometries("num_layers", 2.5)),
    Case("num_heads 0", _set("num_heads", 0)),
    Case("num_heads not a multiple of num_kv_heads", _heads_3_of_2),
    Case("block_size 0", _both_geometries("block_size", 0)),
    Case("head_dim 0", _both_geometries("head_dim", 0)),
    Case("block_size huge", _both_geometries("block_size", 1 << 40)),
    Case("huge block count, whole-pool read", _both_geometries("num_blocks", 1 << 39)),
    Case("huge block count past the limit", _both_geometries("num_blocks", 1 << 62)),
    Case("create_cache with fewer blocks", _set("create_cache:geometry.num_blocks", 1)),
    Case("negative kv scale", _set("geometry.kv_scales[0][0]", -0.5), fp8=True),
    Case("kv scale overflowing float32", _set("geometry.kv_scales[0][1]", 1e300), fp8=True),
    Case("kv_scales missing a layer", _set("geometry.kv_scales", []), fp8=True),
    Case("negative softmax scale", _set("attention:scale", -1.0)),
    Case("zero softmax scale", _set("attention:scale", 0.0)),
    Case("loosened tolerance", _set("tolerance.ratio", 1e9)),
    Case("tolerance of another dtype", _set("tolerance.dtype", "float32")),
    Case("operations 5", _set("operations", 5)),
    Case("operations []", _set("operations", [])),
    Case("operations without create_cache first", lambda m, d: m["operations"].pop(0)),
    Case("a second create_cache", lambda m, d: m["operations"].insert(1, m["operations"][0])),
    Case("unknown operation", _set("finish:op", "explode")),
    Case("write_kv layer past num_layers", _set("write_kv:layer", 7), fp8=True),
    Case("attention layer past num_layers (fp8 scales)", _set("attention:layer", 4095), fp8=True),
    Case("slot 10^12", _set("write_kv:slot_mapping[0]", 10**12)),
    Case("slot -2", _set("write_kv:slot_mapping[0]", -2)),
    Case("background write slot mapping one entry short", _drop_first_write_slot),
    Case(
        "group slot mapping one entry short",
        lambda m, d: ops(m, "attention")[0]["batch"]["group_slots"][0].pop(),
    ),
    Case("update_slots one entry short", lambda m, d: ops(m, "read_kv")[0]["update_slots"].pop()),
    Case("block id 10^12 in a table", _set("attention:batch.group_tables[0][0][0]", 10**12)),
    Case("block id -1 in a table", _set("attention:batch.group_tables[0][0][0]", -1)),
    Case("block id 10^12 in a copy", _set("copy_blocks:copies", [[0, 10**12]])),
    Case("block id -1 in a copy", _set("copy_blocks:copies", [[-1, 0]])),
    Case("block id 10^12 in a read", _set("read_kv:blocks", [10**12])),
    Case("seq_lens past the table", _set("attention:batch.seq_lens[0]", 1 << 62)),
    Case(
        "seq_lens summing past 2^63",
        _set("attention:batch.seq_lens", [(1 << 62) + 1, (1 << 62) + 1]),
    ),
    Case("position past seq_len", _set("attention:batch.positions[0]", 10**9)),
    Case("query_start_loc not ending at T", _set("attention:batch.query_start_loc", [0, 10**9])),
    Case(
        "sinks of the wrong length",
        _set(
            "attention:variant",
            {"window": None, "softcap": None, "sinks": [0.0] * 9, "alibi_slopes": None},
        ),
    ),
    Case(
        "window 0",
        _set(
            "attention:variant", {"window": 0, "softcap": None, "sinks": None, "alibi_slopes": None}
        ),
    ),
    # array files
    Case("array path ../../etc/passwd", _set("write_kv:kv", "../../etc/passwd")),
    Case("absolute array path", _set("write_kv:kv", "/etc/passwd")),
    Case("array path /dev/zero", _set("write_kv:kv", "/dev/zero")),
    Case("array symlink to a file outside", _link("write_kv", "kv", "/etc/hostname")),
    Case("arrays/ a symlink to a directory outside", _arrays_dir_outside),
    Case("array file past the size limit", _array("write_kv", "kv", _sparse)),
    Case(
        "npy truncated",
        _array(
            "write_kv",
            "kv",
            _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 1, 1, 8), }", b"\0" * 8),
        ),
    ),
    Case(
        "npy header past the end",
        _array("write_kv", "kv", lambda p: p.write_bytes(b"\x93NUMPY\x01\x00\xff\xff{'descr'")),
    ),
    Case(
        "npy count wrapping to 0",
        _array(
            "write_kv",
            "kv",
            _npy(
                "{'descr': '<f4', 'fortran_order': False, "
                "'shape': (2, 4294967296, 4294967296, 4), }"
            ),
        ),
    ),
    Case(
        "npy negative dimension",
        _array(
            "write_kv",
            "kv",
            _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -1, 1, 8), }"),
        ),
    ),
    Case(
        "npy of int32",
        _array("write_kv", "kv", _npy("{'descr': '<i4', 'fortran_order': False, 'shape': (0,), }")),
    ),
    Case(
        "npy in Fortran order",
        _array("write_kv", "kv", _npy("{'descr': '<f4', 'fortran_order': True, 'shape': (0,), }")),
    ),
    Case("NaN data", _values("write_kv", "kv", lambda a: a.reshape(-1).__setitem__(0, np.nan))),
    Case(
        "infinite expected output",
        _values("attention", "expected", lambda a: a.reshape(-1).__setitem__(0, np.inf)),
    ),
    Case("num_heads not the query's", lambda m, d: m.__setitem__("num_heads", 2 * m["num_heads"])),
]


def _part(kind: str) -> Callable[[Manifest], dict[str, Any]]:
    """The object ``kind`` names: the manifest, a top-level field, an operation, or its batch."""

    def get(m: Manifest) -> dict[str, Any]:
        if kind == "manifest":
            return m
        if kind in ("source", "geometry", "tolerance"):
            part: dict[str, Any] = m[kind]
            return part
        if kind == "batch":
            batch: dict[str, Any] = ops(m, "attention")[0]["batch"]
            return batch
        return ops(m, kind)[0]

    return get


def _without(kind: str, key: str) -> Edit:
    return lambda m, d: _part(kind)(m).pop(key)


def _with_extra(kind: str) -> Edit:
    return lambda m, d: _part(kind)(m).__setitem__("extra", 0)


_OBJECTS = "manifest source geometry tolerance create_cache write_kv copy_blocks attention"
_OBJECTS += " read_kv finish batch"


OPTIONAL = {"latent_dim"}  # of a geometry: absent is null (the ordinary layout)


def _deletions(m: Manifest) -> Iterator[tuple[str, Edit]]:
    """Delete each required field of the manifest and of the first operation of each kind;
    add one; give an optional field a value the format does not hold."""
    for kind in _OBJECTS.split():
        for key in _part(kind)(m):
            if key not in OPTIONAL:
                yield f"{kind} without {key}", _without(kind, key)
        yield f"{kind} with an unknown field", _with_extra(kind)
    yield "a latent_dim on a version 1 manifest (it has none)", _latent_in_version_1
    yield "a latent_dim the geometry's arrays do not match", _both_geometries("latent_dim", 4)


def _latent_in_version_1(m: Manifest, d: Path) -> None:
    m["version"] = 1
    _both_geometries("latent_dim", 4)(m, d)


def systematic(source: Path) -> list[Case]:
    m = json.loads((source / "manifest.json").read_text())
    return [Case(name, edit) for name, edit in _deletions(m)]


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    shutil.copy(src / "manifest.json", dst / "manifest.json")
    (dst / "arrays").mkdir()
    for f in (src / "arrays").iterdir():
        try:
            os.link(f, dst / "arrays" / f.name)
        except OSError:
            shutil.copy(f, dst / "arrays" / f.name)


def build(case: Case, source: Path, out: Path) -> Path:
    """A broken copy of vector ``source`` under ``out``; its directory."""
    d = out / "".join(c if c.isalnum() else "_" for c in case.name)
    _copy(source, d)
    m = json.loads((d / "manifest.json").read_text())
    case.edit(m, d)
    raw = m.get("__raw__")
    (d / "manifest.json").write_text(raw if isinstance(raw, str) else json.dumps(m))
    return d


def pick_sources(manifests: list[Path]) -> tuple[Path, Path]:
    """A plain vector with attention, copies and whole-pool reads, and an fp8 one."""

    def fits(p: Path, fp8: bool) -> bool:
        m = json.loads(p.read_text())
        kinds = {o["op"] for o in m["operations"]}
        reads = any(o["blocks"] is None for o in ops(m, "read_kv"))
        plain = m["geometry"]["kv_dtype"] is None and reads and "copy_blocks" in kinds
        quant = m["geometry"]["kv_dtype"] is not None
        return "attention" in kinds and (quant if fp8 else plain)

    plain = next((p.parent for p in manifests if fits(p, False)), None)
    quant = next((p.parent for p in manifests if fits(p, True)), None)
    assert plain is not None and quant is not None, "the export has no vector to mutate"
    return plain, quant


def corpus(manifests: list[Path], out: Path) -> list[tuple[str, Path]]:
    """Every case built under ``out``: (name, vector directory)."""
    plain, quant = pick_sources(manifests)
    cases = NAMED + systematic(plain)
    return [(c.name, build(c, quant if c.fp8 else plain, out)) for c in cases]


@pytest.fixture(scope="session")
def malformed(
    exported: Exported, tmp_path_factory: pytest.TempPathFactory
) -> list[tuple[str, Path]]:
    """The corpus, built once per session from the shared quick export."""
    return corpus(manifests(exported.out), tmp_path_factory.mktemp("malformed"))
