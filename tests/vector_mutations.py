"""Seeded mutations of exported test vectors, and the verdict each reader gives a vector.

The differential test (tests/test_vectors_differential.py) mutates real
vectors, one change each, and requires the two readers to agree on every
one: ``vectors check`` with the reference backend (run in this process) and
the C reader (one process over all of them). A verdict is its class:

* ``PASS``: replayed, nothing differs;
* ``FAIL``: replayed, a value differs (exit 1 for that vector);
* ``refused``: the vector breaks a rule of the format (a setup error, exit 2).

The changes (:data:`KINDS`) are those a careless exporter, a hand edit or a
hostile file makes: a value of the manifest replaced (an integer moved by one,
to 0, -1 or past a limit; a float, a bool, ``null``, a string, a list or an
object where something else stood), a field or list item deleted, added,
duplicated or swapped, a value copied from elsewhere in the same manifest, the
manifest's bytes edited (a byte flipped, inserted or cut, bytes that are not
UTF-8), or an array's file edited (a value moved, made NaN, huge or
subnormal, its header or its length changed, the same values stored as the
other float dtype). A value moved within a tolerance's width is not among
them: two readers that compute the same reference in a different order may
then both be right and disagree, as any two implementations would.

Run by hand for a longer search (exports the vectors itself)::

    python tests/vector_mutations.py --mutants 5000 --seed 7
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conformance.errors import SetupError
from conformance.vectors.check import check_vectors
from spec.backend import ReferenceBackend

PASS, FAIL, REFUSED = "PASS", "FAIL", "refused"
KINDS = ("value", "delete", "add", "swap", "copy", "text", "array")
WEIGHTS = (8, 2, 2, 2, 2, 2, 3)  # values of the manifest most: what both readers must range-check
READER_C = Path(__file__).resolve().parent.parent / "conformance" / "vectors" / "reader_c"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
C_ENV = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0:allocator_may_return_null=0"}
_VERDICT = re.compile(r"^(PASS|FAIL|ERROR) (\S+?):", re.MULTILINE)


@dataclass(frozen=True)
class Mutant:
    """One vector changed once: its directory, the vector it came from, and what changed."""

    directory: Path
    source: str
    change: str


def build_reader(out: Path, cc: str = "gcc", sanitize: bool = True) -> Path:
    """The C reader, built with AddressSanitizer and UBSan (``sanitize``) by ``cc``."""
    sources = [str(READER_C / n) for n in ("vectors_check.c", "json.c", "npy.c")]
    flags = ["-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-pedantic", "-Werror"]
    exe = out / "vectors_check"
    argv = [cc, *flags, *(SANITIZE if sanitize else []), "-o", str(exe), *sources, "-lm"]
    subprocess.run(argv, check=True, capture_output=True)
    return exe


def mutants(vectors: Sequence[Path], out: Path, seed: int, count: int) -> Iterator[Mutant]:
    """``count`` mutants of the vector directories ``vectors``, written under ``out``."""
    rng = random.Random(seed)
    for i in range(count):
        source = rng.choice(list(vectors))
        target = out / f"{i:05d}"
        shutil.copytree(source, target, copy_function=os.link)  # arrays shared, not copied
        (target / "manifest.json").unlink()  # the manifest is edited: a copy of its own
        shutil.copyfile(source / "manifest.json", target / "manifest.json")
        kind = rng.choices(KINDS, WEIGHTS)[0]
        change = _mutate(kind, target, rng)
        yield Mutant(target, source.name, f"{kind}: {change}")


def python_verdict(directory: Path) -> str:
    """``vectors check --backend reference``'s verdict on one vector directory."""
    try:
        result = check_vectors(ReferenceBackend(), "reference", directory)
    except SetupError:
        return REFUSED
    if result.skipped:
        return f"skipped ({'; '.join(result.skipped)})"
    return PASS if result.passed else FAIL


def c_verdicts(reader: Path, directories: Sequence[Path]) -> dict[Path, str]:
    """The C reader's verdict on each directory, in one process; a crash, a sanitizer report
    or a hang is an AssertionError naming the vector it stopped at."""
    args = [str(reader), *(str(d / "manifest.json") for d in directories)]
    done = subprocess.run(
        args, capture_output=True, text=True, errors="replace", env=C_ENV, timeout=600
    )
    found: dict[Path, str] = {}
    for word, where in _VERDICT.findall(done.stdout):
        found.setdefault(Path(where), REFUSED if word == "ERROR" else word)
    missing = [d for d in directories if d not in found]
    ok = done.returncode in (0, 1, 2) and "Sanitizer" not in done.stderr
    assert ok and not missing, (
        f"the C reader stopped (exit {done.returncode}) at {missing[:1]}:\n{done.stderr[-3000:]}"
    )
    return found


def _mutate(kind: str, vector: Path, rng: random.Random) -> str:
    path = vector / "manifest.json"
    if kind == "text":
        return _edit_text(path, rng)
    tree = json.loads(path.read_text())
    if kind == "array":
        return _edit_array(vector, tree, rng)
    nodes = list(_paths(tree))
    where = rng.choice(nodes)
    parent, key = _parent(tree, where)
    what = _change_tree(kind, tree, parent, key, nodes, rng)
    path.write_text(json.dumps(tree))
    return f"{_named(where)}: {what}"


def _change_tree(
    kind: str,
    tree: Any,
    parent: Any,
    key: Any,
    nodes: list[tuple[Any, ...]],
    rng: random.Random,
) -> str:
    old = parent[key]
    if kind == "value":
        parent[key] = _other_value(old, rng)
        return f"{old!r:.40} -> {parent[key]!r:.40}"
    if kind == "delete":
        del parent[key]
        return "deleted"
    if kind == "add":
        if isinstance(parent, dict):
            parent["unknown_field"] = old
            return "an unknown field added beside it"
        parent.insert(key, copy.deepcopy(old))
        return "duplicated"
    if kind == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = rng.randrange(len(parent))
        parent[key], parent[other] = parent[other], parent[key]
        return f"swapped with item {other}"
    donors = [p for p in nodes if p and p[-1] == _named_key(key, parent)]
    donor = rng.choice(donors) if donors else rng.choice(nodes)
    dparent, dkey = _parent(tree, donor)
    parent[key] = copy.deepcopy(dparent[dkey])
    return f"copied from {_named(donor)}"


def _named_key(key: Any, parent: Any) -> Any:
    return key if isinstance(parent, dict) else None


def _other_value(old: Any, rng: random.Random) -> Any:
    """A value that could stand where ``old`` stood, or one of another JSON type."""
    if type(old) is int and rng.random() < 0.7:
        return rng.choice(
            [old + 1, old - 1, 0, -1, 1, old * 2 + 1, -old, 2**31, 2**40 + 1, 2**62, 2**63, 7]
        )
    if isinstance(old, float) and rng.random() < 0.6:
        return rng.choice([-old, old * 4, 0.0, 1e308, -1e-310, old + 1.0, 1e-30])
    return rng.choice(
        [1.5, -2.0, True, False, None, "x", "float16", [], {}, [old], 3, -7, 2**64, 1e300]
    )


def _edit_text(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    at = rng.randrange(len(data))
    edit = rng.choice(("flip", "insert", "cut", "utf8", "nul"))
    if edit == "flip":
        data[at] ^= 1 << rng.randrange(8)
    elif edit == "insert":
        data[at:at] = rng.choice([b",", b"]", b"{", b'"', b"0", b" -", b"e9", b"\\u00e9"])
    elif edit == "cut":
        del data[at : at + rng.randrange(1, 16)]
    elif edit == "utf8":
        data[at:at] = rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])
    else:
        data[at:at] = b"\x00"
    path.write_bytes(bytes(data))
    return f"manifest byte {at}: {edit}"


def _edit_array(vector: Path, tree: Any, rng: random.Random) -> str:
    ops = tree.get("operations") if isinstance(tree, dict) else None
    names = sorted(
        {
            op[k]
            for op in (ops if isinstance(ops, list) else [])
            if isinstance(op, dict)
            for k in ("kv", "query", "expected", "update")
            if isinstance(op.get(k), str) and (vector / op[k]).is_file()
        }
    )
    if not names:
        return "no array to edit"
    name = rng.choice(names)
    path = vector / name
    data = path.read_bytes()
    path.unlink()  # the file is a link to the original: write a new one
    header = 10 + int.from_bytes(data[8:10], "little")
    edit = rng.choice(("value", "value", "nan", "truncate", "header", "dtype"))
    if edit in ("value", "nan") and len(data) > header:
        itemsize = 4 if b"<f4" in data[:header] else 8
        a = np.frombuffer(data[header:], dtype=f"<f{itemsize}").copy()
        i = rng.randrange(a.size)
        a[i] = (
            float("nan")
            if edit == "nan"
            else rng.choice(
                [a[i] * 2 + 1, -a[i] - 0.5, 1e30, 1e-42, a[i] + 2.0**-9, 65519.0, 448.5]
            )
        )
        data = data[:header] + a.tobytes()
    elif edit == "truncate":
        data = data[: rng.randrange(len(data))]
    elif edit == "header":
        at = rng.randrange(8, header)
        data = data[:at] + bytes([rng.randrange(32, 127)]) + data[at + 1 :]
    else:
        a = _load(data)
        other = a.astype(np.float64 if a.dtype == np.float32 else np.float32)
        with path.open("wb") as f:
            np.lib.format.write_array(f, other, version=(1, 0), allow_pickle=False)
        return f"{name}: the same values as {other.dtype}"
    path.write_bytes(data)
    return f"{name}: {edit}"


def _load(data: bytes) -> np.ndarray[Any, Any]:
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        out: np.ndarray[Any, Any] = np.load(f, allow_pickle=False)
        return out


def _paths(node: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every value under ``node`` (not ``node`` itself), items of long lists
    sampled so that a big table does not drown the rest."""
    if isinstance(node, dict):
        items: list[tuple[Any, Any]] = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))[:24]
    else:
        return
    for key, child in items:
        yield (*at, key)
        yield from _paths(child, (*at, key))


def _parent(tree: Any, path: tuple[Any, ...]) -> tuple[Any, Any]:
    node = tree
    for key in path[:-1]:
        node = node[key]
    return node, path[-1]


def _named(path: tuple[Any, ...]) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


@dataclass
class Agreement:
    """The outcome of one differential run."""

    mutants: int
    verdicts: Counter[str]
    disagreements: list[tuple[Mutant, str, str]]  # (mutant, Python's, C's)
    seconds: float


def differential(
    vectors: Sequence[Path], reader: Path, out: Path, seed: int, count: int
) -> Agreement:
    """Mutate, then judge every mutant with both readers."""
    start = time.monotonic()
    made = list(mutants(vectors, out, seed, count))
    ours = {m.directory: python_verdict(m.directory) for m in made}
    theirs = c_verdicts(reader, [m.directory for m in made])
    differ = [(m, ours[m.directory], theirs[m.directory]) for m in made]
    return Agreement(
        mutants=len(made),
        verdicts=Counter(ours.values()),
        disagreements=[d for d in differ if d[1] != d[2]],
        seconds=time.monotonic() - start,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mutants", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--vectors", type=Path, help="an export (default: export the quick profile)")
    p.add_argument("--keep", type=Path, help="keep the mutants in this folder")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="vector-mutants-"))
    vectors_dir = args.vectors
    if vectors_dir is None:
        from conformance.cli import main as cli

        vectors_dir = work / "vectors"
        cli(["vectors", "export", "--out", str(vectors_dir), "--seed", "1", "--examples", "1"])
    out = args.keep or work / "mutants"
    out.mkdir(parents=True, exist_ok=True)
    reader = build_reader(work)
    vectors = sorted(p.parent for p in vectors_dir.glob("*/manifest.json"))
    found = differential(vectors, reader, out, args.seed, args.mutants)
    print(f"{found.mutants} mutants in {found.seconds:.1f} s; Python's verdicts {found.verdicts}")
    for mutant, ours, theirs in found.disagreements:
        print(f"  {mutant.directory.name} ({mutant.source}, {mutant.change}): {ours} vs C {theirs}")
    print(f"{len(found.disagreements)} disagreements")
    return 1 if found.disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
