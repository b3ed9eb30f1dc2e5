"""Render the spec well on the docs site (griffe extensions for mkdocstrings).

* The spec's docstrings teach with bare doctest examples and Sphinx-style
  roles. Markdown would read ``>>>`` as nested quotes, so each run of doctest
  lines is fenced as a ``pycon`` code block, and each role becomes a code span
  (:class:`DoctestFences`). The docstrings themselves stay plain text that
  ``pytest --doctest-modules`` runs.
* A dataclass field's meaning is written as a trailing comment
  (``block_size: int = 16  # tokens per block``); :class:`FieldComments` makes
  that comment the field's docstring, so the API pages list every field with
  its meaning.
* The API pages show public members only. A public function's entry ends with
  the private rules it calls (``self._x(`` or a module's ``_x(``), and the ones
  those call, each with its source, so the spec's whole rule still reads in
  one place: :class:`PrivateCalls`.

>>> fence_doctests("Grows:\\n\\n>>> 1 + 1\\n2\\n\\nSee :class:`BlockPool`.").splitlines()
['Grows:', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'See `BlockPool`.']
>>> trailing_comment("    num_host_blocks: int = 0  # the host pool for swapping")
'the host pool for swapping'
>>> trailing_comment('    sep: str = "#"'), called_names("x = self._a(1) + _b(self._c)")
(None, ['_a', '_b'])
"""

from __future__ import annotations

import io
import re
import tokenize
from typing import Any

import griffe

_ROLE = re.compile(r":(?:mod|class|meth|func|attr|data|exc|obj):`~?([^`]+)`")
_CALL = re.compile(r"(?<![\w.])(?:self\.|cls\.)?(_[a-z]\w*)\(")


def fence_doctests(text: str) -> str:
    """Wrap every doctest example run (up to the next blank line) in a ``pycon`` fence."""
    out: list[str] = []
    in_example, indent = False, ""
    for line in text.splitlines():
        if not in_example and line.lstrip().startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(indent + "```pycon")
            in_example = True
        elif in_example and not line.strip():
            out.append(indent + "```")
            in_example = False
        out.append(line if in_example else _ROLE.sub(r"`\1`", line))
    if in_example:
        out.append(indent + "```")
    return "\n".join(out)


def trailing_comment(line: str) -> str | None:
    """The ``# comment`` at the end of one source line, if any (never a ``#`` inside a string)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    comments = [t.string for t in tokens if t.type == tokenize.COMMENT]
    return comments[-1].lstrip("#").strip() if comments else None


def called_names(source: str) -> list[str]:
    """Private names called in ``source`` (``self._x(``, ``_x(``), in first-call order."""
    return list(dict.fromkeys(_CALL.findall(source)))


class DoctestFences(griffe.Extension):
    """Apply :func:`fence_doctests` to every docstring as griffe loads it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)


class FieldComments(griffe.Extension):
    """A class attribute without a docstring takes its trailing comment as one."""

    def on_attribute(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is not None or not attr.parent or not attr.parent.is_class:
            return
        lines = attr.lines
        comment = trailing_comment(lines[0]) if lines else None
        if comment:
            attr.docstring = griffe.Docstring(comment, parent=attr)


def _private_target(func: griffe.Function, name: str) -> griffe.Function | None:
    """The private function ``name`` that ``func`` calls: its class's method, else its module's."""
    parent = func.parent
    target = parent.all_members.get(name) if parent is not None and parent.is_class else None
    if target is None:
        target = func.module.members.get(name)
    if target is not None and target.is_alias:  # inherited from a base class: its definition
        try:
            target = target.final_target  # type: ignore[union-attr]
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None  # a name from outside the package: not a rule of ours
    if target is None or not target.is_function or target.path == func.path:
        return None
    return target  # type: ignore[return-value]


def private_rules(func: griffe.Function) -> list[griffe.Function]:
    """The private functions ``func`` calls, and those they call, each once, in first-call order."""
    found: dict[str, griffe.Function] = {}
    todo = [func]
    while todo:
        caller = todo.pop(0)
        for name in called_names(caller.source):
            target = _private_target(caller, name)
            if target is not None and target.path not in found and target.path != func.path:
                found[target.path] = target
                todo.append(target)
    return list(found.values())


class PrivateCalls(griffe.Extension):
    """End each public function's docstring with the private rules it calls, source included.

    Private members are not rendered (the API pages show the public surface), so
    the rules a public function delegates to are shown inside its entry instead.
    """

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Once the whole package is loaded: a rule inherited from a base class in another
        module resolves only then."""
        for func in _functions(pkg):
            self._note(func)

    def _note(self, func: griffe.Function) -> None:
        if func.name.startswith("_") or func.parent is None:
            return
        rules = private_rules(func)
        if not rules:
            return
        names = ", ".join(f"`{r.name}`" for r in rules)
        blocks = "\n\n".join(f"```python\n{r.source.rstrip()}\n```" for r in rules)
        note = f"Private rules it calls ({names}):\n\n{blocks}"
        if func.docstring is None:
            func.docstring = griffe.Docstring(note, parent=func)
        else:
            func.docstring.value = func.docstring.value.rstrip() + "\n\n" + note


def _functions(obj: griffe.Object) -> list[griffe.Function]:
    """Every function defined in ``obj`` (a module or class), its submodules and classes."""
    found: list[griffe.Function] = []
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_function:
            found.append(member)  # type: ignore[arg-type]
        elif member.is_class or member.is_module:
            found += _functions(member)  # type: ignore[arg-type]
    return found
