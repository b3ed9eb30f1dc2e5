"""Data flows one way: the import graph between the project's modules says so.

``spec`` imports nothing of ours and only the standard library and numpy;
``backend_gpu`` imports only ``spec``; ``paged_spec.engine`` (the engine loop and
tiny model) only ``spec``; ``conformance`` imports ``spec``, the engine and (lazily,
by name) backends; the tools in ``paged_spec``, ``benchmarks`` and ``docs_tools``
may use everything. No two modules import each other, directly or through others,
counting imports inside functions too: a cycle is a design knot, lazy or not.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("spec", "backend_gpu", "conformance", "paged_spec", "benchmarks", "docs_tools")
OURS = {*PACKAGES, "tests"}
ENGINE = "paged_spec.engine"
ALLOWED = {  # longest prefix wins
    "spec": {"spec"},
    "backend_gpu": {"spec", "backend_gpu"},
    ENGINE: {"spec", ENGINE},
    "conformance": {"spec", "backend_gpu", "conformance", ENGINE},
}
SPEC_THIRD_PARTY = {"numpy"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }


MODULES = _modules()


def _imported(path: Path) -> Iterator[str]:
    """Every module of ours that ``path`` imports, anywhere in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:  # `from pkg import module` names the module
                sub = f"{node.module}.{alias.name}"
                yield sub if sub in MODULES else node.module


def _graph() -> dict[str, set[str]]:
    return {
        name: {m for m in _imported(path) if m in MODULES and m != name}
        for name, path in MODULES.items()
    }


def _rule(module: str) -> set[str] | None:
    prefixes = [p for p in ALLOWED if module == p or module.startswith(p + ".")]
    return ALLOWED[max(prefixes, key=len)] if prefixes else None


def _within(module: str, allowed: set[str]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


def test_each_package_imports_only_what_it_may() -> None:
    for module, imported in _graph().items():
        allowed = _rule(module)
        if allowed is None:
            continue
        bad = sorted(m for m in imported if not _within(m, allowed))
        assert not bad, f"{module} imports {bad}"


def test_spec_uses_only_the_standard_library_and_numpy() -> None:
    for name, path in MODULES.items():
        if not name.startswith("spec"):
            continue
        tops: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops.add(node.module.split(".")[0])
        outside = {n for n in tops - OURS if n not in sys.stdlib_module_names}
        assert outside <= SPEC_THIRD_PARTY, f"{name} imports {sorted(outside)}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_through_others() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_planted_bugs_live_only_in_the_planted_folder() -> None:
    """Every registered planted bug is defined under conformance/planted, and nothing else is.

    Outside that folder no class derives from the bases planted backends start from.
    """
    from conformance.planted import backends, groups, kernels, schedulers

    registered: list[object] = [*backends.PLANTED.values(), *groups.PLANTED_GROUPS.values()]
    registered += [cls for cls, _ in kernels.PLANTED_BOUNDS.values()]
    registered += list(schedulers.PLANTED.values())
    for planted in registered:
        assert getattr(planted, "__module__", "").startswith("conformance.planted."), planted
    bases = {"NumpyPagedBackend", "TableAdapterBackend"}
    for name, path in MODULES.items():
        if name.startswith("conformance.planted") or not name.startswith("conformance"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                derived = {b.id for b in node.bases if isinstance(b, ast.Name)} & bases
                assert not derived, f"{name} defines {node.name} on {sorted(derived)}"
