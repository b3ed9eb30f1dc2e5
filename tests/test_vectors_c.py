"""The C reader (conformance/vectors/reader_c/) builds with the system compiler; passes the vectors.

It proves that the format stands without Python: a C99 program with a JSON parser
of its own, libc and libm replays every vector with a naive paged-attention loop.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from vectors_fixtures import Exported, exported, manifests

from conformance.vectors.format import load_array, save_array

__all__ = ["exported"]

SOURCES = Path(__file__).resolve().parent.parent / "conformance" / "vectors" / "reader_c"
COMPILER = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
needs_compiler = pytest.mark.skipif(
    COMPILER is None, reason="no C compiler (cc, gcc or clang) on PATH: apt-get install gcc"
)


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert COMPILER is not None
    exe = tmp_path_factory.mktemp("reader_c") / "vectors_check"
    sources = [str(SOURCES / name) for name in ("vectors_check.c", "json.c", "npy.c")]
    flags = ["-std=c99", "-O2", "-Wall", "-Wextra", "-pedantic", "-Werror"]
    subprocess.run([COMPILER, *flags, "-o", str(exe), *sources, "-lm"], check=True)
    return exe


def _run(reader: Path, paths: list[Path]) -> subprocess.CompletedProcess[str]:
    args = [str(reader), *map(str, paths)]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)


@needs_compiler
def test_the_c_reader_passes_every_vector(reader: Path, exported: Exported) -> None:
    done = _run(reader, manifests(exported.out))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == exported.examples
    assert all(line.startswith("PASS") for line in lines), done.stdout


def _tampered(exported: Exported, tmp_path: Path, op: str, key: str, fp8: bool) -> Path:
    """A copy of the first vector (with an fp8 cache if ``fp8``) with one expected value of its
    first ``op`` changed."""
    paths = manifests(exported.out)
    quantized = [json.loads(p.read_text())["geometry"]["kv_dtype"] is not None for p in paths]
    src = paths[quantized.index(fp8)].parent
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    name = next(o[key] for o in manifest["operations"] if o["op"] == op and o.get(key))
    array = load_array(dst / name).copy()
    if op == "attention":  # both references move, so the allowance stays as it was
        array[:, 0, 0, 0] += 0.25
    else:
        array.reshape(-1)[0] += 0.5
    save_array(dst / name, array)
    return dst / "manifest.json"


@needs_compiler
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(
    ("op", "key", "word"), [("attention", "expected", "ulp"), ("read_kv", "update", "read_kv")]
)
def test_the_c_reader_fails_a_changed_expectation(
    reader: Path, exported: Exported, tmp_path: Path, op: str, key: str, word: str, fp8: bool
) -> None:
    done = _run(reader, [_tampered(exported, tmp_path, op, key, fp8)])
    assert done.returncode == 1, done.stdout
    assert done.stdout.startswith("FAIL") and word in done.stdout


@needs_compiler
def test_the_c_reader_refuses_what_is_not_a_vector(reader: Path, tmp_path: Path) -> None:
    bad = tmp_path / "manifest.json"
    bad.write_text('{"format": "other", "version": 1}')
    done = _run(reader, [bad])
    assert done.returncode == 2 and "not a paged-spec-vectors manifest" in done.stderr
    assert _run(reader, []).returncode == 2
    assert _run(reader, [tmp_path / "missing.json"]).returncode == 2


@needs_compiler
def test_the_c_reader_refuses_a_corrupt_vector(
    reader: Path, exported: Exported, tmp_path: Path
) -> None:
    src = manifests(exported.out)[0].parent
    shutil.copytree(src, tmp_path / "v")
    manifest = tmp_path / "v" / "manifest.json"
    data = json.loads(manifest.read_text())
    array = tmp_path / "v" / data["operations"][1]["kv"]
    array.write_bytes(array.read_bytes()[:-8])
    done = _run(reader, [manifest])
    assert done.returncode == 2 and "data size does not match shape" in done.stderr
    attention = next(op for op in data["operations"] if op["op"] == "attention")
    attention["batch"]["group_tables"] = [[[]]]
    manifest.write_text(json.dumps(data))
    shutil.copy(src / data["operations"][1]["kv"], array)
    done = _run(reader, [manifest])
    assert done.returncode == 2 and "out of range" in done.stderr
