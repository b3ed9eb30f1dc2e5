"""SIGTERM handled as SIGINT: a run told to stop by a CI runner ends as one stopped by Ctrl-C.

A CI job that times out, ``timeout(1)``, ``kill`` and container stops send
SIGTERM. Left to its default, SIGTERM ends the process at once: no report is
written, and a report of an earlier run stays in place. While
:func:`sigterm_as_sigint` is in force, SIGTERM goes to whatever handles SIGINT
now (Python's, which raises ``KeyboardInterrupt``, or a run's own handler,
:mod:`conformance.watchdog`), so the run stops the same way: its child
process killed, its reports written and marked interrupted, exit status 130.
Where SIGINT is ignored (a background job started by a shell ignores it),
SIGTERM still stops the run, with ``KeyboardInterrupt``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def sigterm_as_sigint() -> Iterator[None]:
    """Route SIGTERM to the SIGINT handler for the duration (main thread only; else no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _as_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _as_sigint(signum: int, frame: FrameType | None) -> None:
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
        return
    raise KeyboardInterrupt  # SIGINT ignored or left to the system: stop all the same
