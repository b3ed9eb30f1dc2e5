"""Both readers give every vector the same verdict: a seeded differential fuzz test.

:mod:`vector_mutations` changes real exported vectors once each (a value, a field, a
list item, the manifest's bytes or an array's) and judges every mutant with both
readers: ``vectors check --backend reference`` (in this process) and the C reader
built with AddressSanitizer and UBSan (one process over all mutants). They must
agree on each: PASS, FAIL, or refused (a setup error). The C reader must not crash,
hang or trip a sanitizer on any of them.

The run is seeded (the same mutants every time) and sized to about a minute on
one CPU (:data:`MUTANTS`); ``python tests/vector_mutations.py --mutants N --seed S``
searches further. The mutants must reach all three verdicts, so the test cannot
pass by refusing everything.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vector_mutations import FAIL, PASS, REFUSED, build_reader, differential
from vectors_fixtures import Exported, exported, manifests

__all__ = ["exported"]  # the session fixture, imported for pytest

SEED = 20260
MUTANTS = 240


@pytest.mark.slow
def test_both_readers_give_every_mutated_vector_the_same_verdict(
    exported: Exported, tmp_path: Path
) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc on PATH: the C reader's sanitizer build needs it")
    reader = build_reader(tmp_path)
    vectors = [m.parent for m in manifests(exported.out)]
    found = differential(vectors, reader, tmp_path / "mutants", SEED, MUTANTS)
    disagree = [
        f"{m.directory.name} ({m.source}, {m.change}): vectors check {ours}, C reader {theirs}"
        for m, ours, theirs in found.disagreements
    ]
    assert not disagree, "\n".join(disagree)
    assert found.mutants == MUTANTS
    assert {PASS, FAIL, REFUSED} <= set(found.verdicts), found.verdicts
