"""One quick-profile export shared by the vector tests (few examples: Triton is interpreted)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.cli import main

SEED = 1  # with one example per pass, this export catches every planted bug
EXAMPLES = 1


@dataclass(frozen=True)
class Exported:
    """What ``python -m conformance vectors export`` wrote and printed."""

    out: Path
    printed: str
    examples: int
    passes: list[tuple[str, int]]


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """Vectors of the quick profile with one example per pass, exported by the command line.

    Exported once per session: each test module that imports the fixture finds
    the export of the first under the session's base temporary directory.
    """
    base = tmp_path_factory.getbasetemp()
    out, log = base / "vectors-quick", base / "vectors-quick.txt"
    if not log.exists():
        argv = ["vectors", "export", "--out", str(out), "--seed", str(SEED)]
        printed = io.StringIO()
        with redirect_stdout(printed):
            assert main([*argv, "--examples", str(EXAMPLES)]) == 0
        log.write_text(printed.getvalue())
    found = manifests(out)
    source = json.loads(found[0].read_text())["source"]
    passes = [(str(name), int(n)) for name, n in source["passes"]]
    return Exported(out, log.read_text(), len(found), passes)


def manifests(root: Path) -> list[Path]:
    return sorted(root.glob("*/manifest.json"))
