"""The reading order in spec/__init__.py is true: each module imports only those listed before."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import spec

SPEC = Path(spec.__file__).resolve().parent
SUPPORT = ("errors", "validate")


def _order() -> list[str]:
    doc = spec.__doc__ or ""
    return re.findall(r"^\d+\. :mod:`spec\.(\w+)`", doc, flags=re.M)


def _imports(module: str) -> set[str]:
    tree = ast.parse((SPEC / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("spec."):
            found.add(node.module.split(".")[1])
    return found


def test_every_module_is_in_the_reading_order() -> None:
    modules = {p.stem for p in SPEC.glob("*.py")} - {"__init__"}
    assert set(_order()) | set(SUPPORT) == modules


def test_each_module_imports_only_those_before_it() -> None:
    order = _order()
    for i, module in enumerate(order):
        allowed = set(SUPPORT) | set(order[:i])
        assert _imports(module) <= allowed, f"{module} imports {_imports(module) - allowed}"
    assert _imports("validate") <= {"errors"} and not _imports("errors")
