"""What the honest interpreter cannot correct, said as such instead of blamed on a kernel.

A conversion or operation whose compiled result on sm_90 the shim does not
reproduce bit for bit raises :class:`InterpreterLimit` from inside the
kernel. The interpreter wraps it (``InterpreterError``); :func:`limit_in`
finds it again in a backend's exception, so a report can say "the
interpreter cannot run this faithfully" rather than "the kernel is wrong".
"""

from __future__ import annotations

import re

MARKER = "interpreter limit"


class InterpreterLimit(RuntimeError):
    """An operation Triton's interpreter cannot run as compiled Triton would (not a kernel bug)."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{MARKER}: {what}; Triton's interpreter cannot run this as compiled Triton does on "
            "sm_90, so the result says nothing about the kernel (check it on a GPU)"
        )
        self.what = what


_FOUND = re.compile(re.escape(MARKER) + r": [^;]*;[^)'\"]*")


def limit_in(error: BaseException | str) -> str | None:
    """The interpreter limit an exception (or its text, or its causes) reports, or None.

    >>> limit_in(ValueError("InterpreterError(\\"interpreter limit: fp8e4b15; x\\")"))
    'interpreter limit: fp8e4b15; x'
    >>> limit_in(ValueError("index out of range")) is None
    True
    """
    seen: set[int] = set()
    current: BaseException | str | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = _FOUND.search(str(current))
        if found:
            return found.group(0).strip()
        if isinstance(current, str):
            return None
        current = current.__cause__ or current.__context__
    return None
