"""Render the spec's docstrings well on the docs site (a griffe extension for mkdocstrings).

The spec's docstrings teach with bare doctest examples and Sphinx-style roles.
Markdown would read ``>>>`` as nested quotes, so each run of doctest lines is
fenced as a ``pycon`` code block, and each role becomes a code span. The
docstrings themselves stay plain text that ``pytest --doctest-modules`` runs.

>>> fence_doctests("Grows:\\n\\n>>> 1 + 1\\n2\\n\\nSee :class:`BlockPool`.").splitlines()
['Grows:', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'See `BlockPool`.']
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:mod|class|meth|func|attr|data|exc|obj):`~?([^`]+)`")


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


class DoctestFences(griffe.Extension):
    """Apply :func:`fence_doctests` to every docstring as griffe loads it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
