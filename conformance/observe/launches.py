"""Every Triton kernel launch inside a block of code: kernel, grid and scalar arguments.

A report may say that a kernel path ran only if it ran. Triton launches a
kernel through one method whether it compiles it or interprets it:
``kernel[grid](*args, **kwargs)`` is ``run(*args, grid=grid, warmup=False,
**kwargs)`` on a ``JITFunction`` (compiled) or an ``InterpretedFunction``
(``TRITON_INTERPRET=1``). :func:`recording` wraps that method of both
classes and notes each launch made inside its block: the kernel's name and
module, the grid as launched (a callable grid evaluated on the launch's
arguments, as Triton does), and every argument that is a plain number, bool
or string (the constexprs and scalars that select a path: a split count, a
tile size, ``SPLIT=True``). Tensors are not kept.

Triton is never imported here (imported before ``TRITON_INTERPRET`` is set,
its helpers would be built for the wrong mode): a backend that launches
kernels has imported it already, and without it there is nothing to record.
The wrapper stays installed once placed and records nothing outside a
:func:`recording` block; placed again if something restored the method it
wrapped (the interpreter shim does, when it is uninstalled).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

Scalar = int | float | bool | str


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel`` (its function's name) in ``module``, its 3-d ``grid``, and
    its scalar arguments by parameter name."""

    kernel: str
    module: str
    grid: tuple[int, int, int]
    args: Mapping[str, Scalar] = field(default_factory=dict)

    def arg(self, name: str, default: Scalar = 0) -> Scalar:
        """The scalar argument ``name`` (``default`` when it was a tensor or absent)."""
        return self.args.get(name, default)


_RECORDING: list[list[Launch]] = []
"""The lists of the :func:`recording` blocks open now, innermost last."""
_LAUNCHING = [0]
"""Wrapped launches in progress: a launch wrapped twice is recorded once."""
_CLASSES = (
    ("triton.runtime.jit", "JITFunction"),
    ("triton.runtime.interpreter", "InterpretedFunction"),
)
_MARK = "_paged_spec_records_launches"


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """The launches made inside the block, in order (each open block gets every launch).

    >>> with recording() as launches:
    ...     pass
    >>> launches
    []
    """
    _install()
    launches: list[Launch] = []
    _RECORDING.append(launches)
    try:
        yield launches
    finally:
        _RECORDING.remove(launches)


def _install() -> None:
    """Wrap ``run`` of Triton's kernel classes, where Triton is imported and it is not wrapped."""
    for module_name, class_name in _CLASSES:
        cls: Any = getattr(sys.modules.get(module_name), class_name, None)
        run = None if cls is None else cls.__dict__.get("run")
        if run is not None and not getattr(run, _MARK, False):
            cls.run = _wrapped(run)


def _wrapped(run: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(run)
    def run_recorded(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        if warmup or not _RECORDING or _LAUNCHING[0]:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        launch = _describe(self, args, kwargs, grid)
        for launches in _RECORDING:
            launches.append(launch)
        _LAUNCHING[0] += 1
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            _LAUNCHING[0] -= 1

    setattr(run_recorded, _MARK, True)
    return run_recorded


def _describe(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grid: Any) -> Launch:
    """The :class:`Launch` of ``kernel[grid](*args, **kwargs)``; what cannot be read is left out
    (a launch is never stopped by its description)."""
    fn = getattr(kernel, "fn", kernel)
    name, module = getattr(fn, "__name__", repr(fn)), getattr(fn, "__module__", "") or ""
    try:
        named = _bound(fn, args, kwargs)
    except TypeError:  # arguments the kernel would refuse: Triton's error, not ours
        return Launch(name, module, (0, 0, 0))
    try:
        shape = grid(named) if callable(grid) else grid
        dims = (*(int(x) for x in shape), 1, 1)[:3]
    except Exception:  # a grid Triton itself cannot read raises in the launch, as it should
        dims = (0, 0, 0)
    scalars = {k: s for k, v in named.items() if (s := _scalar(v)) is not None}
    return Launch(name, module, (dims[0], dims[1], dims[2]), scalars)


def _bound(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every parameter's value (defaults applied); launch options are not parameters."""
    signature = _signature(fn)
    params = {k: v for k, v in kwargs.items() if k in signature.parameters}
    bound = signature.bind_partial(*args, **params)
    bound.apply_defaults()
    return dict(bound.arguments)


@functools.cache
def _signature(fn: Any) -> inspect.Signature:
    return inspect.signature(fn)


def _scalar(value: Any) -> Scalar | None:
    """``value`` as a plain scalar (a ``tl.constexpr`` unwrapped), or ``None`` for anything else."""
    if type(value).__name__ == "constexpr" and hasattr(value, "value"):
        value = value.value
    return value if isinstance(value, bool | int | float | str) else None
