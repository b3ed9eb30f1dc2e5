"""Every call the suite makes into a backend goes through one guard.

The guard is the one place that decides what counts as the backend failing a
call, so that the lockstep itself stays a plain sequence of operations. A
call fails when the backend:

* raises, or leaves by any other exit: ``sys.exit``, ``KeyboardInterrupt``
  raised by the backend itself (a real Ctrl-C stops the run instead: see
  :mod:`conformance.watchdog`), any other ``BaseException``;
* changes its inputs. Arrays go in read-only (a write raises in the backend,
  and the failure names the argument it tried to change); lists and the batch's
  arrays are compared after the call too, since a backend can write around the
  flag (``torch.from_numpy`` and ``np.frombuffer`` ignore it);
* returns from ``read_cache`` memory that is not the caller's own: results that
  share memory with each other or with an earlier read, or that change when a
  later call writes the cache (a live view);
* takes longer than the per-call timeout (:mod:`conformance.watchdog` times it).

>>> guard = CallGuard()
>>> guard.call("read_cache", lambda layer: layer + 1, 41)
42
>>> guard.call("attention", lambda: 1 / 0)
Traceback (most recent call last):
...
conformance.judges.guard.BackendFault: backend.attention raised ZeroDivisionError: division by zero
>>> import sys
>>> guard.call("attention", sys.exit, 0)
Traceback (most recent call last):
...
conformance.judges.guard.BackendFault: backend.attention called sys.exit(0) ...
>>> import numpy as np
>>> def scribble(layer, query):
...     query[0] = 0
>>> guard.call("attention", scribble, 0, np.ones(3))
Traceback (most recent call last):
...
conformance.judges.guard.BackendFault: backend.attention tried to write into its input `query`...
"""

from __future__ import annotations

import ast
import inspect
import linecache
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import TracebackType
from typing import Any, Protocol, TypeVar

import numpy as np

from conformance.watchdog import Call, CallTimeout, RunWatch, current_watch
from spec.backend import Backend
from spec.batch import BatchMetadata

_T = TypeVar("_T")

_READS = ("read_cache", "read_blocks")
"""Calls whose results must be the caller's own copies."""
_WRITES = ("create_cache", "write_kv", "copy_blocks")
"""Calls that change the cache: a live view returned earlier would change with them."""


class BackendFault(Exception):
    """A backend call failed; the message says which call and how.

    ``kind``: ``"exception"`` (raised or exited), ``"input"`` (changed an
    input) or ``"alias"`` (returned memory that is not the caller's own).
    """

    def __init__(
        self, call: str, detail: str, kind: str = "exception", layer: int | None = None
    ) -> None:
        super().__init__(detail)
        self.call = call
        self.detail = detail
        self.kind = kind
        self.layer = layer


class Watched(Protocol):
    """What the guard reads from the lockstep it serves: its workload log and step."""

    log: list[str]
    step_index: int


class CallGuard:
    """Runs backend calls and turns whatever goes wrong in them into a :class:`BackendFault`.

    One guard per :class:`~conformance.lockstep.driver.Lockstep`; it reports each call
    to the run's :class:`~conformance.watchdog.RunWatch`, when there is one.
    """

    def __init__(self, watch: RunWatch | None = None) -> None:
        self.watch = current_watch() if watch is None else watch
        self._lockstep: Watched | None = None
        self._sent = 0  # workload lines already reported to the watch
        self._reads: dict[tuple[str, int], _Read] = {}

    def attach(self, lockstep: Watched) -> None:
        """Report ``lockstep``'s workload and step with each call (before its first call)."""
        self._lockstep = lockstep

    def call(self, what: str, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        """``fn(*args, **kwargs)``, where ``fn`` is the backend's method named ``what``."""
        inputs = _Inputs(what, fn, args, kwargs)
        call = self._begin(what, args)
        try:
            result = fn(*inputs.args, **inputs.kwargs)
        except CallTimeout:
            raise
        except KeyboardInterrupt as err:
            if self.watch is None or self.watch.is_users():
                raise
            raise self._fault(what, args, _exit_detail(what, err)) from err
        except BaseException as err:
            raise self._fault(what, args, *inputs.describe_failure(err)) from err
        finally:
            if call is not None and self.watch is not None:
                self.watch.end(call)
        changed = inputs.changed()
        if changed:
            raise self._fault(what, args, changed, "input")
        self._check_reads(what, args, result)
        return result

    # -- internals ----------------------------------------------------------------

    def _begin(self, what: str, args: tuple[object, ...]) -> Call | None:
        if self.watch is None:
            return None
        ls = self._lockstep
        log = [] if ls is None else ls.log
        call = Call(what, 0 if ls is None else ls.step_index, _layer(what, args))
        new_lines, new = log[self._sent :], self._sent == 0
        self._sent = len(log)
        self.watch.begin(call, log, new_lines, new)
        return call

    def _fault(
        self, what: str, args: tuple[object, ...], detail: str, kind: str = "exception"
    ) -> BackendFault:
        return BackendFault(what, detail, kind, _layer(what, args))

    def _step(self) -> int:
        return 0 if self._lockstep is None else self._lockstep.step_index

    def _check_reads(self, what: str, args: tuple[object, ...], result: object) -> None:
        """Earlier reads unchanged by this call; this read's memory its own."""
        for key, read in list(self._reads.items()):
            if what in _WRITES and read.changed():
                raise self._fault(key[0], (key[1],), read.live_view(what, args), "alias")
        if what == "create_cache":
            self._reads.clear()
        if what not in _READS:
            return
        arrays = _arrays_of(result)
        key = (what, _layer(what, args) or 0)
        held = [(k, r) for k, r in self._reads.items() if k != key]
        problem = _shared(what, args, arrays, held)
        if problem:
            raise self._fault(what, args, problem, "alias")
        self._reads[key] = _Read(f"backend.{what}({_args(args)})", self._step(), arrays)


@dataclass
class _Read:
    """What a read returned (the backend's arrays) and a copy of it, to see a live view."""

    call: str
    step: int
    arrays: list[np.ndarray[Any, Any]]

    def __post_init__(self) -> None:
        self.copies = [a.copy() for a in self.arrays]

    def changed(self) -> bool:
        return not all(_same(a, c) for a, c in zip(self.arrays, self.copies, strict=True))

    def live_view(self, what: str, args: tuple[object, ...]) -> str:
        return (
            f"what {self.call} returned at step {self.step} changed when backend.{what}"
            f"({_args(args)}) ran later: it returned a live view of the cache, not a copy "
            "(read_cache must return arrays the caller owns)"
        )


def _shared(
    what: str,
    args: tuple[object, ...],
    arrays: list[np.ndarray[Any, Any]],
    held: list[tuple[tuple[str, int], _Read]],
) -> str | None:
    """Why this read's arrays are not the caller's own, or None."""
    call = f"backend.{what}({_args(args)})"
    if len(arrays) == 2 and np.may_share_memory(arrays[0], arrays[1]):
        return f"{call} returned K and V that share memory (read_cache must return copies)"
    for _, read in held:
        for mine in arrays:
            if any(np.may_share_memory(mine, theirs) for theirs in read.arrays):
                return (
                    f"{call} returned memory that {read.call} also returned at step "
                    f"{read.step}: views of the cache, not copies (read_cache must return "
                    "arrays the caller owns)"
                )
    return None


class _Inputs:
    """A call's arguments as the backend gets them: arrays read-only, everything snapshotted."""

    def __init__(
        self,
        what: str,
        fn: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> None:
        names = _parameter_names(what, fn)
        self.checks: list[tuple[str, object, object]] = []  # (name, value handed, snapshot)
        self.frozen: dict[str, np.ndarray[Any, Any]] = {}
        self.args = tuple(
            self._hand(names[i] if i < len(names) else f"argument {i + 1}", a)
            for i, a in enumerate(args)
        )
        self.kwargs = {k: self._hand(k, v) for k, v in kwargs.items()}
        self.what = what

    def _hand(self, name: str, value: object) -> object:
        if isinstance(value, np.ndarray):
            value = _read_only(value)
            self.frozen[name] = value
            self.checks.append((name, value, value.copy()))
        elif isinstance(value, list):
            self.checks.append((name, value, list(value)))
        elif isinstance(value, BatchMetadata):
            for field_name, array in _batch_arrays(value):
                array.flags.writeable = False  # cached in the batch: frozen in place
                self.frozen[f"{name}.arrays().{field_name}"] = array
                self.checks.append((f"{name}.arrays().{field_name}", array, array.copy()))
        return value

    def changed(self) -> str | None:
        """Why an input differs from its snapshot after the call, or None."""
        for name, value, snapshot in self.checks:
            if not _same(value, snapshot):
                flag = (
                    " (it is passed read-only: the write went around the flag, e.g. through "
                    "torch.from_numpy or np.frombuffer)"
                    if isinstance(value, np.ndarray)
                    else ""
                )
                return (
                    f"backend.{self.what} changed its input `{name}` during the call{flag}; "
                    "a backend must not change its inputs"
                )
        return None

    def describe_failure(self, err: BaseException) -> tuple[str, str]:
        """What the exception out of the call means (and its kind), naming an input it wrote."""
        if isinstance(err, ValueError) and "read-only" in str(err) and self.frozen:
            name = _written_argument(err.__traceback__, self.frozen)
            target = f"its input `{name}`" if name else f"one of its inputs ({_names(self)})"
            return (
                f"backend.{self.what} tried to write into {target}, which the suite passes "
                f"read-only ({type(err).__name__}: {err}); a backend must not change its inputs"
            ), "input"
        if not isinstance(err, Exception):
            return _exit_detail(self.what, err), "exception"
        return f"backend.{self.what} raised {type(err).__name__}: {err}", "exception"


def _names(inputs: _Inputs) -> str:
    return ", ".join(f"`{n}`" for n in inputs.frozen)


def _exit_detail(what: str, err: BaseException) -> str:
    """A backend that left its call by an exit rather than an exception."""
    if isinstance(err, SystemExit):
        return (
            f"backend.{what} called sys.exit({err.code!r}) (SystemExit): a backend must raise "
            "an exception, never exit the process"
        )
    if isinstance(err, KeyboardInterrupt):
        return (
            f"backend.{what} raised KeyboardInterrupt itself (no Ctrl-C was pressed): a backend "
            "must raise an exception, never interrupt the run"
        )
    return (
        f"backend.{what} raised {type(err).__name__}, a BaseException that is not an Exception: "
        f"{err}"
    )


def _read_only(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A read-only view of ``array`` over a read-only base: its flag cannot be turned back on."""
    array.flags.writeable = False
    view = array.view()
    view.flags.writeable = False
    return view


def _batch_arrays(batch: BatchMetadata) -> list[tuple[str, np.ndarray[Any, Any]]]:
    """The numpy arrays of ``batch.arrays()`` (cached in the batch), by field name."""
    found: list[tuple[str, np.ndarray[Any, Any]]] = []
    arrays = batch.arrays()
    for name in vars(arrays):
        value = getattr(arrays, name)
        items = enumerate(value) if isinstance(value, tuple) else [(None, value)]
        for i, item in items:
            if isinstance(item, np.ndarray):
                found.append((name if i is None else f"{name}[{i}]", item))
    return found


def _arrays_of(result: object) -> list[np.ndarray[Any, Any]]:
    """The arrays a read returned, viewed without copying (nothing when they are not arrays)."""
    items = result if isinstance(result, tuple | list) else (result,)
    out = []
    for item in items:
        try:
            array = np.asarray(item)
        except Exception:  # a device tensor: its memory is not ours to inspect
            return []
        if array.dtype == object:
            return []
        out.append(array)
    return out


def _same(a: object, b: object) -> bool:
    """Bit for bit (a NaN equals itself; -0.0 does not equal 0.0).

    >>> _same(np.array([np.nan, 0.0]), np.array([np.nan, 0.0])), _same(np.zeros(1), -np.zeros(1))
    (True, False)
    """
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        bits = _BITS.get(a.dtype.itemsize)
        contiguous = a.flags.c_contiguous and b.flags.c_contiguous
        if a.size < _COPY_BELOW or bits is None or a.dtype.hasobject or not contiguous:
            return a.tobytes() == b.tobytes()  # small: copying is cheaper than comparing
        return bool(np.array_equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits)))
    try:
        return bool(a == b)
    except Exception:  # elements whose == is not a truth value
        return False


_BITS = {n: np.dtype(f"u{n}") for n in (1, 2, 4, 8)}
"""Unsigned integers as wide as an element: its bits compared without copying them."""
_COPY_BELOW = 8192
"""Arrays of fewer elements are compared as bytes (measured: faster below about 5,000)."""


def _layer(what: str, args: tuple[object, ...]) -> int | None:
    """The layer a per-layer call works on (its first argument)."""
    if what in ("write_kv", "attention", "read_cache", "read_blocks") and args:
        first = args[0]
        if isinstance(first, int | np.integer) and not isinstance(first, bool):
            return int(first)
    return None


def _args(args: tuple[object, ...]) -> str:
    return ", ".join(str(a) for a in args[:1] if isinstance(a, int | np.integer))


def _parameter_names(what: str, fn: Callable[..., object]) -> tuple[str, ...]:
    """Positional parameter names, from the contract (else the backend's own signature)."""
    contract = getattr(Backend, what, None)
    if callable(contract):
        return _signature_names(contract)[1:]  # without self
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


@cache
def _signature_names(fn: Callable[..., object]) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _written_argument(tb: TracebackType | None, frozen: dict[str, np.ndarray[Any, Any]]) -> str:
    """Which frozen argument the failing write targeted: found from the failing lines' names.

    The innermost frame first; on its line, the names written to first
    (assignment targets, ``out=``), then every other name; a name whose value
    shares memory with a frozen argument identifies it. "" when none does.
    """
    for frame, lineno in reversed(list(traceback.walk_tb(tb))):
        line = linecache.getline(frame.f_code.co_filename, lineno).strip()
        for name in _names_written_first(line):
            value = frame.f_locals.get(name)
            if isinstance(value, np.ndarray):
                for arg, array in frozen.items():
                    if np.may_share_memory(value, array):
                        return arg
    return ""


def _names_written_first(line: str) -> list[str]:
    """Identifiers of a source line, the ones it writes to first.

    >>> _names_written_first("q[0] = k[0]")
    ['q', 'k']
    >>> _names_written_first("np.add(k, 1, out=v)")
    ['v', 'np', 'add', 'k', 'out']
    """
    written: list[str] = []
    try:
        tree = ast.parse(line)
    except SyntaxError:  # one line of a longer statement
        tree = None
    for node in ast.walk(tree) if tree is not None else ():
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        elif isinstance(node, ast.keyword) and node.arg == "out":
            targets = [node.value]
        for target in targets:
            written += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    every = re.findall(r"[A-Za-z_]\w*", line)
    return list(dict.fromkeys(written + every))
