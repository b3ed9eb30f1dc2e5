"""An honest Triton interpreter: corrections to what ``TRITON_INTERPRET=1`` gets wrong.

``install()`` patches Triton's interpreter for the rest of the process (the
suite does this wherever it runs interpreted kernels); ``honest_interpreter()``
does it for a ``with`` block (kernel authors' own tests). What is corrected,
and what cannot be, is in :mod:`conformance.interpreter.shim` and
docs/plugging-in.md.
"""

from conformance.interpreter.api import (
    honest_interpreter,
    install,
    install_when_interpreting,
    installed,
    uninstall,
)
from conformance.interpreter.limits import InterpreterLimit, limit_in

__all__ = [
    "InterpreterLimit",
    "honest_interpreter",
    "install",
    "install_when_interpreting",
    "installed",
    "limit_in",
    "uninstall",
]
