"""Data flows one way: the import graph between the project's packages says so.

``spec`` imports nothing of ours and only the standard library and numpy;
``backend_gpu`` imports only ``spec``; ``conformance`` imports ``spec`` and
(lazily, by name) backends; ``tools`` may use everything.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = {"spec", "backend_gpu", "conformance", "tools", "tests"}
ALLOWED = {
    "spec": {"spec"},
    "backend_gpu": {"spec", "backend_gpu"},
    "conformance": {"spec", "backend_gpu", "conformance"},
}
SPEC_THIRD_PARTY = {"numpy"}


def _imports(package: str) -> dict[str, set[str]]:
    """Top-level module names imported by each file of ``package``."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_it_may(package: str) -> None:
    for path, names in _imports(package).items():
        ours = names & OURS
        assert ours <= ALLOWED[package], f"{path} imports {sorted(ours - ALLOWED[package])}"


def test_spec_uses_only_the_standard_library_and_numpy() -> None:
    for path, names in _imports("spec").items():
        outside = {n for n in names - OURS if n not in sys.stdlib_module_names}
        assert outside <= SPEC_THIRD_PARTY, f"{path} imports {sorted(outside)}"
