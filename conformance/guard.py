"""Every call the suite makes into a backend goes through one guard.

The guard is the one place that decides what counts as the backend failing a
call: today, raising. It is also the hook for everything else the suite watches
at that boundary (inputs a backend must not change, calls that hang, memory
accesses out of bounds), so that the lockstep itself stays a plain sequence of
operations.

>>> guard = CallGuard()
>>> guard.call("read_cache", lambda layer: layer + 1, 41)
42
>>> guard.call("attention", lambda: 1 / 0)
Traceback (most recent call last):
...
conformance.guard.BackendFault: backend.attention raised ZeroDivisionError: division by zero
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


class BackendFault(Exception):
    """A backend call failed; the message says which call and how."""

    def __init__(self, call: str, detail: str) -> None:
        super().__init__(detail)
        self.call = call
        self.detail = detail


class CallGuard:
    """Runs backend calls and turns whatever goes wrong in them into a :class:`BackendFault`."""

    def call(self, what: str, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        """``fn(*args, **kwargs)``, where ``fn`` is the backend's method named ``what``."""
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            raise BackendFault(what, f"backend.{what} raised {type(err).__name__}: {err}") from err
