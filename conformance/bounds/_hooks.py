"""The seam between the bounds checker and Triton's interpreter: install, forward, undo.

Under ``TRITON_INTERPRET=1`` a kernel launch is a ``GridExecutor`` call that
copies the arguments to host tensors (``_init_args_hst``) and then runs every
program, and every memory access of every program goes through one object,
``triton.runtime.interpreter.interpreter_builder``: ``create_masked_load`` and
``create_masked_store`` (plain loads and stores, atomic loads and stores and
tensor-descriptor accesses all end there), ``create_atomic_rmw`` and
``create_atomic_cas``. Those six names are the whole seam (triton 3.x).

:func:`installed` wraps them for the duration of a ``with`` block only, so an
unchecked run executes the interpreter's own code, untouched, and restores the
exact attributes it found on exit, also when the block raises. The wrappers
hand each access's byte addresses, mask and element size to a
:class:`Listener`, which may answer with a narrower mask: lanes it refuses are
not performed (a refused load reads ``other`` or zero, a refused store or
atomic does nothing), so a kernel that writes past a tensor cannot corrupt the
host process that is checking it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

Addresses = NDArray[np.uint64]
Mask = NDArray[np.bool_]

_BUILDER_OPS = (
    "create_masked_load",
    "create_masked_store",
    "create_atomic_rmw",
    "create_atomic_cas",
)
_EXECUTOR_OPS = ("__call__", "_init_args_hst")
_MISSING = object()


class Listener(Protocol):
    """What the hooks report to: launches (with their host arguments) and accesses."""

    def launch(self, kernel: str, args: dict[str, object]) -> None:
        """A launch of ``kernel`` begins; ``args`` maps parameter names to host values."""

    def launch_done(self) -> None:
        """The launch that began last is over (also called when it raised, or never began)."""

    def access(
        self, op: str, ptrs: Addresses, mask: Mask, size: int, program: tuple[int, ...]
    ) -> Mask | None:
        """``op`` ("load", "store", "atomic") of ``size``-byte elements at ``ptrs[mask]``.

        Returns ``None`` to let every unmasked lane through, or the mask of
        lanes that may be performed.
        """


_active: list[Listener] = []


def interpreter_available() -> str | None:
    """``None`` when the seam exists in the installed triton, else why the checker cannot run."""
    try:
        from triton.runtime import interpreter
    except ImportError as err:
        return f"triton's interpreter cannot be imported ({err})"
    missing = [n for n in _BUILDER_OPS if not hasattr(interpreter.interpreter_builder, n)]
    missing += [n for n in _EXECUTOR_OPS if n not in vars(interpreter.GridExecutor)]
    if missing:
        return f"triton's interpreter lacks {', '.join(missing)} (the checker needs triton 3.x)"
    return None


@contextmanager
def installed(listener: Listener) -> Iterator[None]:
    """Route every interpreted launch and memory access to ``listener`` inside the block."""
    reason = interpreter_available()
    if reason is not None:
        raise RuntimeError(reason)
    if _active:
        raise RuntimeError("a bounds checker is already watching; watch() calls cannot nest")
    from triton.runtime import interpreter

    builder, executor = interpreter.interpreter_builder, interpreter.GridExecutor
    saved_builder = {n: vars(builder).get(n, _MISSING) for n in _BUILDER_OPS}
    saved_executor = {n: vars(executor)[n] for n in _EXECUTOR_OPS}
    _active.append(listener)
    try:
        for name, wrapper in _builder_wrappers(builder, listener).items():
            setattr(builder, name, wrapper)
        for name, wrapper in _executor_wrappers(saved_executor, listener).items():
            setattr(executor, name, wrapper)
        yield
    finally:
        for name, value in saved_builder.items():
            if value is _MISSING:
                vars(builder).pop(name, None)
            else:
                setattr(builder, name, value)
        for name, value in saved_executor.items():
            setattr(executor, name, value)
        _active.clear()


def _builder_wrappers(builder: Any, listener: Listener) -> dict[str, Any]:
    """Wrappers of the builder's bound memory operations that ask ``listener`` first."""
    from triton.runtime.interpreter import TensorHandle

    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas
    scratch = np.zeros(2, dtype=np.uint64)  # where refused compare-and-swap lanes go (8 bytes)

    def ask(op: str, ptrs: Any, mask: Any) -> Any:
        """``mask`` (a handle), or a narrower one if the listener refuses some lanes."""
        bits = ptrs.get_element_ty().primitive_bitwidth
        allowed = listener.access(op, ptrs.data, mask.data, max(1, bits // 8), builder.grid_idx)
        return mask if allowed is None else TensorHandle(allowed, mask.dtype)

    def masked_load(ptrs: Any, mask: Any, other: Any, cache_policy: Any, is_volatile: Any) -> Any:
        return load(ptrs, ask("load", ptrs, mask), other, cache_policy, is_volatile)

    def masked_store(ptrs: Any, value: Any, mask: Any, cache_policy: Any) -> Any:
        return store(ptrs, value, ask("store", ptrs, mask), cache_policy)

    def atomic_rmw(op: Any, ptr: Any, val: Any, mask: Any, sem: Any, scope: Any) -> Any:
        return rmw(op, ptr, val, ask("atomic", ptr, mask), sem, scope)

    def atomic_cas(ptr: Any, cmp: Any, val: Any, sem: Any, scope: Any) -> Any:
        lanes = np.ones(np.shape(ptr.data), dtype=bool)
        bits = ptr.get_element_ty().primitive_bitwidth
        allowed = listener.access("atomic", ptr.data, lanes, max(1, bits // 8), builder.grid_idx)
        if allowed is not None:  # cas has no mask: refused lanes go to a scratch word
            data = np.where(allowed, ptr.data, np.uint64(scratch.ctypes.data))
            ptr = TensorHandle(data.astype(np.uint64), ptr.dtype)
        return cas(ptr, cmp, val, sem, scope)

    return {
        "create_masked_load": masked_load,
        "create_masked_store": masked_store,
        "create_atomic_rmw": atomic_rmw,
        "create_atomic_cas": atomic_cas,
    }


def _executor_wrappers(original: dict[str, Any], listener: Listener) -> dict[str, Any]:
    """``GridExecutor`` methods that announce each launch and its host arguments."""
    call, init_args = original["__call__"], original["_init_args_hst"]

    def init_args_hst(self: Any, args_dev: Any, kwargs: Any) -> Any:
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        named = dict(zip(self.arg_names, args_hst, strict=False))
        named.update(kwargs_hst)
        listener.launch(self.fn.__name__, named)
        return args_hst, kwargs_hst

    def executor_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(self, *args, **kwargs)
        finally:
            listener.launch_done()

    return {"__call__": executor_call, "_init_args_hst": init_args_hst}
