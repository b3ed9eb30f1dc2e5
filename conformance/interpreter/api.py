"""The public functions: install the shim, for a process or for a ``with`` block."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

from conformance.interpreter.shim import SHIM


def install() -> None:
    """Patch Triton's interpreter with the corrections (nested calls count; harmless twice)."""
    SHIM.install()


def install_when_interpreting() -> bool:
    """Install the corrections once when ``TRITON_INTERPRET`` is on; whether they are in place.

    The suite calls this wherever it runs kernels (before and after
    :func:`~conformance.run.discovery.load_backend`, which the run's worker
    and every replay script start with, and in
    :func:`~conformance.run.runner.run_suite`), so an interpreted kernel is
    judged on what compiled Triton would compute. Without Triton installed there is no
    kernel to correct (the eager torch backend sets ``TRITON_INTERPRET`` too): nothing is
    installed.
    """
    on = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
    if on and not SHIM.installed and importlib.util.find_spec("triton") is not None:
        SHIM.install()
    return SHIM.installed


def uninstall() -> None:
    """Undo one :func:`install`; the last one restores Triton's own interpreter."""
    SHIM.uninstall()


def installed() -> bool:
    """Whether the corrections are in place."""
    return SHIM.installed


@contextmanager
def honest_interpreter() -> Iterator[None]:
    """The corrections for the block, then Triton's interpreter as it was.

    >>> import os; os.environ.setdefault("TRITON_INTERPRET", "1") and None
    >>> with honest_interpreter():
    ...     installed()
    True
    """
    SHIM.install()
    try:
        yield
    finally:
        SHIM.uninstall()
