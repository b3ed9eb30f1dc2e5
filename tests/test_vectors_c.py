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

from conformance.vectors.check import check_vectors
from conformance.vectors.format import load_array, save_array
from spec.backend import ReferenceBackend

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


LAYOUTS = ["plain", "fp8", "latent", "latent fp8"]


def _layout(manifest: Path) -> str:
    g = json.loads(manifest.read_text())["geometry"]
    words = ["latent"] * (g.get("latent_dim") is not None) + ["fp8"] * (g["kv_dtype"] is not None)
    return " ".join(words) or "plain"


def _tampered(exported: Exported, tmp_path: Path, op: str, key: str, layout: str) -> Path:
    """A copy of the first vector of ``layout`` (:data:`LAYOUTS`) with one expected value of
    its first ``op`` changed."""
    paths = manifests(exported.out)
    src = next(p for p in paths if _layout(p) == layout).parent
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    name = next(o[key] for o in manifest["operations"] if o["op"] == op and o.get(key))
    array = load_array(dst / name).copy()
    if op == "attention":  # both references move, so the allowance stays as it was
        array[:, 0, 0, 0] += 0.25
    else:  # another value the cache's format holds (fp8 included): a wrong, not a bad, value
        flat = array.reshape(-1)
        flat[0] = 2.0 if flat[0] == 1.0 else 1.0
    save_array(dst / name, array)
    return dst / "manifest.json"


@needs_compiler
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("op", "key", "word"), [("attention", "expected", "ulp"), ("read_kv", "update", "read_kv")]
)
def test_the_c_reader_fails_a_changed_expectation(
    reader: Path, exported: Exported, tmp_path: Path, op: str, key: str, word: str, layout: str
) -> None:
    done = _run(reader, [_tampered(exported, tmp_path, op, key, layout)])
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
    assert done.returncode == 2 and "table row" in done.stderr


@needs_compiler
def test_both_readers_still_read_a_version_1_vector(
    reader: Path, exported: Exported, tmp_path: Path
) -> None:
    """Version 2 only added the latent layout: a vector of per-head K and V written as
    version 1 (as earlier exports were) passes both readers unchanged."""
    src = next(p for p in manifests(exported.out) if _layout(p) == "plain").parent
    shutil.copytree(src, tmp_path / "v1")
    manifest = tmp_path / "v1" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["version"] = 1
    manifest.write_text(json.dumps(data))
    done = _run(reader, [manifest])
    assert done.returncode == 0 and done.stdout.startswith("PASS"), done.stdout + done.stderr
    result = check_vectors(ReferenceBackend(), "reference", tmp_path)
    assert result.passed and result.stats.examples == 1
