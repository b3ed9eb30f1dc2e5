"""`vectors check` holds against hostile vectors: every malformed one is a setup error (exit 2).

The corpus (tests/malformed_vectors.py) mutates a real export: the cases of
issue 21 by name, and every field deleted or an unknown one added. None may
pass, be blamed on the backend (exit 1), raise, or take long.
"""

from __future__ import annotations

import io
import json
import time
from contextlib import redirect_stderr, redirect_stdout, suppress
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from malformed_vectors import malformed
from vectors_fixtures import Exported, exported, manifests

from conformance.cli import main
from conformance.vectors.format import VectorError
from conformance.vectors.safe import MAX_DEPTH, parse_json
from conformance.vectors.schema_check import schema_error

__all__ = ["exported", "malformed"]  # the session fixtures, imported for pytest


def _check(directory: Path) -> tuple[int, str, float]:
    err = io.StringIO()
    start = time.monotonic()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        status = main(["vectors", "check", str(directory), "--backend", "reference"])
    return status, err.getvalue(), time.monotonic() - start


def test_every_malformed_vector_is_a_setup_error(malformed: list[tuple[str, Path]]) -> None:
    wrong = []
    for name, directory in malformed:
        status, err, took = _check(directory)
        if status != 2 or "setup error" not in err or took > 5:
            wrong.append(f"{name}: exit {status} in {took:.1f} s: {err.strip()[-200:]}")
    assert not wrong, "\n".join(wrong)
    assert len(malformed) > 100


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("version true", "version True"),
        ("num_layers 2.5", "num_layers: 2.5 is not an integer"),
        ("num_heads 0", "num_heads: 0 is not null or an integer of at least 1"),
        ("negative kv scale", "kv_scales[0][0]: -0.5"),
        ("NaN scale", "NaN is not a JSON number"),
        ("NaN data", "holds a NaN"),
        ("block id 10^12 in a copy", "copies: 1000000000000 is outside 0..13"),
        ("block id -1 in a table", "position 0 is in a released block"),
        ("background write slot mapping one entry short", "update_slots: slot"),
        ("manifest nested 100000 deep", f"nested deeper than {MAX_DEPTH}"),
        ("array path /dev/zero", "kv: '/dev/zero' does not match"),
        ("array symlink to a file outside", "symbolic link"),
        ("arrays/ a symlink to a directory outside", "symbolic link"),
        ("array file past the size limit", "past the limit"),
        ("loosened tolerance", "tolerance.ratio"),
        ("operations 5", "operations: 5 is not an array"),
    ],
)
def test_the_setup_error_names_the_field(
    malformed: list[tuple[str, Path]], case: str, named: str
) -> None:
    directory = dict(malformed)[case]
    status, err, _ = _check(directory)
    assert status == 2 and named in err, err


def test_dev_zero_is_refused_without_reading_it(tmp_path: Path) -> None:
    from conformance.vectors.safe import read_bounded

    start = time.monotonic()
    with pytest.raises(VectorError, match="not a regular file"):
        read_bounded(Path("/dev/zero"), 1 << 20, "kv")
    assert time.monotonic() - start < 1


def test_the_schema_reader_agrees_with_jsonschema(
    exported: Exported, malformed: list[tuple[str, Path]]
) -> None:
    """Every exported manifest valid by both; every corpus manifest that is JSON and breaks the
    schema is refused by both (jsonschema is laxer only on 2.0 as an integer, not in the corpus)."""
    jsonschema = pytest.importorskip("jsonschema")
    from conformance.vectors.schema_check import vectors_schema

    validator = jsonschema.Draft202012Validator(vectors_schema())
    for path in manifests(exported.out):
        manifest = json.loads(path.read_text())
        assert schema_error(manifest) is None and not list(validator.iter_errors(manifest))
    for name, directory in malformed:
        try:
            manifest = parse_json((directory / "manifest.json").read_bytes(), name)
        except VectorError:
            continue
        if not validator.is_valid(manifest):
            assert schema_error(manifest) is not None, name


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=200) | st.text(alphabet='[]{}",:0123456789.eE+-\\untrfalsNI ', max_size=200)
)
def test_strict_json_refuses_with_a_vector_error_only(data: bytes | str) -> None:
    """Any bytes: a value, or VectorError; never another exception (RecursionError included)."""
    raw = data.encode() if isinstance(data, str) else data
    with suppress(VectorError):
        parse_json(raw, "m.json")


def test_deep_nesting_is_refused_not_a_recursion_error() -> None:
    with pytest.raises(VectorError, match="nested deeper"):
        parse_json(b"[" * 100000 + b"]" * 100000, "m.json")
    with pytest.raises(VectorError, match="nested deeper"):
        parse_json(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "m.json")
    assert parse_json(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, "m.json") is not None
