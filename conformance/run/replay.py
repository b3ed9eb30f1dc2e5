"""The replay script of a failure: the shrunk workload as Python that raises at its difference.

It loads the same backend by the same name and applies the same operations through a
:class:`~conformance.lockstep.driver.Lockstep`; a run with the bounds check on replays
with a fresh checker of the same mode. The runner uses it to replay a failure once more
(is the backend deterministic?), the reports to print it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def portable_ref(ref: str) -> str:
    """``ref`` with a ``file.py:factory`` path made absolute, so it loads from any directory.

    >>> portable_ref("reference")
    'reference'
    >>> portable_ref("/abs/my_backend.py:make")
    '/abs/my_backend.py:make'
    """
    module, sep, attr = ref.rpartition(":")
    if not sep or not (module.endswith(".py") or "/" in module or os.sep in module):
        return ref
    return f"{Path(module).resolve()}:{attr}"


def script(backend: str, workload: Sequence[str], check_bounds: str | None) -> str:
    """A runnable script: ``workload``'s lines against ``backend``, with the bounds check if on."""
    bounds = ["from conformance.bounds.checker import BoundsChecker"] if check_bounds else []
    return "\n".join(
        [
            f'"""Replays a failing conformance workload for backend {backend!r}.',
            "",
            "Raises conformance.ConformanceFailure at the first difference.",
            '"""',
            "from conformance import Lockstep, WorkloadConfig, load_backend",
            *bounds,
            "from spec.attention import AttentionVariant",
            "from spec.backend import KVGeometry",
            "",
            f"backend = load_backend({portable_ref(backend)!r})",
            *workload,
            'print("no difference: this workload passes")',
            "",
        ]
    )
