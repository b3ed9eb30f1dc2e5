"""Launch options (``kernel[grid](..., num_warps=4)``) under the interpreter, as compiled Triton
takes them.

Compiled Triton accepts as keywords the kernel's parameters and the fields of
its backend's options (``CUDAOptions``: ``num_warps``, ``num_stages``,
``num_ctas``, ``maxnreg``, ``enable_fp_fusion``, ``launch_pdl``, ...), and
refuses anything else ("Keyword argument ... was specified but
unrecognised"). The interpreter runs every program in turn on the CPU, so
options that size warps, stages, registers or clusters change no value and
are honoured by ignoring them. So is ``default_dot_input_precision``: compiled
Triton 3.6 and 3.9 resolve a ``tl.dot``'s precision before reading it (a
float32 dot stays TF32 with ``default_dot_input_precision="ieee"``; the PTX
test checks it), and so does the interpreter. A few cannot be honoured
(:data:`UNHONOURED`): they raise
:class:`~conformance.interpreter.limits.InterpreterLimit`, so the suite says
NOT JUDGED and names the option, rather than blaming the kernel.

>>> split_options(lambda x, BLOCK: None, {"x": 1, "num_warps": 8, "maxnreg": 128})
({'x': 1}, {'num_warps': 8, 'maxnreg': 128})
>>> split_options(lambda x: None, {"num_wraps": 8})
Traceback (most recent call last):
...
KeyError: 'Keyword argument num_wraps was specified but unrecognised'
>>> split_options(lambda x: None, {"launch_cooperative_grid": True})
... # doctest: +ELLIPSIS
Traceback (most recent call last):
...
conformance.interpreter.limits.InterpreterLimit: interpreter limit: the launch option ...
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from conformance.interpreter.limits import InterpreterLimit

KNOWN_OPTIONS = (
    "num_warps",
    "num_ctas",
    "num_stages",
    "warp_size",
    "maxnreg",
    "ptx_version",
    "ptx_options",
    "ir_override",
    "enable_fp_fusion",
    "sched4reg",
    "enable_reflect_ftz",
    "launch_cooperative_grid",
    "launch_pdl",
    "clc",
    "supported_fp8_dtypes",
    "deprecated_fp8_dot_operand_dtypes",
    "default_dot_input_precision",
    "allowed_dot_input_precisions",
    "max_num_imprecise_acc_default",
    "extern_libs",
    "debug",
    "backend_name",
    "sanitize_overflow",
    "arch",
    "instrumentation_mode",
    "min_shared_mem",
)
"""Triton 3.9's ``CUDAOptions`` fields: the options this module knows when the installed Triton
has no NVIDIA backend to read them from (:func:`launch_options`)."""

UNHONOURED: dict[str, Callable[[Any], bool]] = {
    "launch_cooperative_grid": bool,  # a grid-wide barrier: programs run one after another here
    "ir_override": lambda v: v is not None,  # compiled from other IR than the Python source
    "instrumentation_mode": bool,  # instrumented code: nothing the interpreter runs
    "clc": bool,  # cluster launch control (sm_100): a scheduler the interpreter does not have
}
"""Options whose effect the interpreter cannot reproduce, with the test of a value that asks
for it."""


@functools.cache
def launch_options() -> frozenset[str]:
    """The launch options the installed Triton accepts for NVIDIA GPUs (its ``CUDAOptions``)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # no NVIDIA backend in this Triton: the fields of the one we read
        return frozenset(KNOWN_OPTIONS)
    return frozenset(CUDAOptions.__dataclass_fields__)


def split_options(fn: Any, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` of a launch of ``fn`` as (its parameters, the launch options), checked.

    An option compiled Triton does not know raises ``KeyError`` with compiled
    Triton's message; an option the interpreter cannot honour raises
    :class:`~conformance.interpreter.limits.InterpreterLimit`.
    """
    spec = inspect.getfullargspec(fn)
    params = set(spec.args) | set(spec.kwonlyargs)
    arguments = {k: v for k, v in kwargs.items() if k in params}
    options = {k: v for k, v in kwargs.items() if k not in params}
    known = launch_options()
    for name, value in options.items():
        if name not in known:
            raise KeyError(f"Keyword argument {name} was specified but unrecognised")
        asks = UNHONOURED.get(name)
        if asks is not None and asks(value):
            raise InterpreterLimit(f"the launch option {name}={value!r}")
    return arguments, options
