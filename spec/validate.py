"""One validation layer for the spec's inputs: every public operation checks its arguments here.

The spec's promise is that a bad call raises a specific :class:`~spec.errors.SpecError`
that names the argument, the value and what was expected, *before* anything
changes. The checks live here, once, so that every operation asks the same
question the same way:

* an id or a count is a Python ``int`` or a numpy integer, never a ``bool``,
  ``float`` or ``str`` (``True`` is not block 1, and ``2.0`` is not token 2);
* token ids are non-negative ints, checked element by element;
* a scale is a finite, positive real number.

numpy is optional here: where it is not installed (the sandbox page runs the
spec in a browser without it) no value can be a numpy value, and the checks
accept Python's own types only.

>>> import numpy as np
>>> check_int("block", np.int64(3), low=0)
3
>>> check_int("block", True)
Traceback (most recent call last):
...
spec.errors.ArgumentTypeError: block must be an int, got bool True
>>> check_token_ids("prompt", np.array([5, 0, 7]))
(5, 0, 7)
>>> check_token_ids("prompt", [1, -2])
Traceback (most recent call last):
...
spec.errors.ArgumentValueError: prompt[1] must be a token id >= 0, got -2
>>> check_scale("scale", float("nan"))
Traceback (most recent call last):
...
spec.errors.ArgumentValueError: scale must be finite and > 0, got nan
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar, cast

from spec.errors import ArgumentTypeError, ArgumentValueError

if TYPE_CHECKING:
    from numpy.typing import NDArray

try:
    from numpy import bool_ as _NpBool
    from numpy import integer as _NpInteger
    from numpy import ndarray as _NdArray
    from numpy import number as _NpNumber
except ModuleNotFoundError:  # no numpy (the browser sandbox), so no value is a numpy value

    class _NoNumpy:
        """Stands for each numpy type: a class that no argument is an instance of."""

    _NpBool = _NpInteger = _NdArray = _NpNumber = _NoNumpy  # type: ignore[misc, assignment]

_T = TypeVar("_T")


def _describe(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def is_array(value: object) -> TypeGuard[NDArray[Any]]:
    """A numpy array (never, where numpy is not installed)."""
    return isinstance(value, _NdArray)


def is_int(value: object) -> bool:
    """A Python int or a numpy integer, and not a bool."""
    if type(value) is int:  # the common case, first: a bool's type is bool, not int
        return True
    return isinstance(value, int | _NpInteger) and not isinstance(value, bool | _NpBool)


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int``, if it is an integer in ``low .. high`` (inclusive bounds)."""
    if not is_int(value):
        raise ArgumentTypeError(f"{name} must be an int, got {_describe(value)}")
    v = int(value)  # type: ignore[call-overload]
    assert isinstance(v, int)
    if low is not None and high is not None and not low <= v <= high:
        raise ArgumentValueError(f"{name} must be in {low}..{high}, got {v}")
    if low is not None and v < low:
        raise ArgumentValueError(f"{name} must be >= {low}, got {v}")
    if high is not None and v > high:
        raise ArgumentValueError(f"{name} must be <= {high}, got {v}")
    return v


def check_positive(name: str, value: object) -> int:
    """A size or a count that must be at least 1."""
    return check_int(name, value, low=1)


def check_bool(name: str, value: object) -> bool:
    """A flag: exactly ``True`` or ``False`` (the string ``'no'`` is not false)."""
    if not isinstance(value, bool | _NpBool):
        raise ArgumentTypeError(f"{name} must be a bool, got {_describe(value)}")
    return bool(value)


def check_real(name: str, value: object, *, low: float | None = None) -> float:
    """A finite real number (int or float, not bool), as a float; at least ``low`` if given."""
    if isinstance(value, bool | _NpBool) or not isinstance(value, int | float | _NpNumber):
        raise ArgumentTypeError(f"{name} must be a real number, got {_describe(value)}")
    v = float(value)  # type: ignore[arg-type, unused-ignore]
    if not math.isfinite(v):
        raise ArgumentValueError(f"{name} must be finite, got {v}")
    if low is not None and v < low:
        raise ArgumentValueError(f"{name} must be >= {low}, got {v}")
    return v


def check_scale(name: str, value: object) -> float:
    """A multiplier that must be finite and positive (a softmax scale, an fp8 scale)."""
    if isinstance(value, bool | _NpBool) or not isinstance(value, int | float | _NpNumber):
        raise ArgumentTypeError(f"{name} must be a real number, got {_describe(value)}")
    v = float(value)  # type: ignore[arg-type, unused-ignore]
    if not (math.isfinite(v) and v > 0):
        raise ArgumentValueError(f"{name} must be finite and > 0, got {v}")
    return v


def check_choice(name: str, value: object, choices: Iterable[_T]) -> _T:
    """One of ``choices`` (compared with ``==``, so the type must match too)."""
    options = tuple(choices)
    for option in options:
        if type(value) is type(option) and value == option:
            return option
    raise ArgumentValueError(f"{name} must be one of {options!r}, got {_describe(value)}")


def check_str(name: str, value: object) -> str:
    """A string (a name or a label), nothing that merely prints like one."""
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a str, got {_describe(value)}")
    return value


def check_instance(name: str, value: object, cls: type[_T]) -> _T:
    """``value`` itself, if it is a ``cls``: a request must be a Request, not a dict like one."""
    if not isinstance(value, cls):
        raise ArgumentTypeError(f"{name} must be a {cls.__name__}, got {_describe(value)}")
    return value


def check_token_id(name: str, value: object) -> int:
    """One token id: an int (or numpy integer) >= 0, as an ``int``."""
    if type(value) is int and value >= 0:  # the common case, first (a hot path: every sample)
        return value
    if not is_int(value):
        raise ArgumentTypeError(f"{name} must be a token id (an int), got {_describe(value)}")
    v = int(value)  # type: ignore[call-overload]
    assert isinstance(v, int)
    if v < 0:
        raise ArgumentValueError(f"{name} must be a token id >= 0, got {v}")
    return v


def check_token_set(name: str, values: object) -> frozenset[int]:
    """A set of token ids (a set, frozenset or sequence of them), as a ``frozenset``.

    A bare int is refused (``stop_tokens=5`` is a mistake for ``{5}``), and so is
    a string (a string of digits is not a set of tokens).
    """
    if isinstance(values, set | frozenset):
        items: Iterable[object] = values
    else:
        items = as_sequence(name, values)
    return frozenset(check_token_id(f"{name} element", v) for v in items)


def as_sequence(name: str, values: object) -> Sequence[object]:
    """A one-dimensional sequence of items: a list, tuple, range or 1-D numpy array.

    Strings, bytes, sets, scalars and arrays of other ranks are refused: a set
    has no order, and a string of digits is not a list of tokens.
    """
    if is_array(values):
        if values.ndim != 1:
            raise ArgumentTypeError(f"{name} must be one-dimensional, got shape {values.shape}")
        out: list[object] = values.tolist()
        return out
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ArgumentTypeError(f"{name} must be a sequence of ints, got {_describe(values)}")
    return values


def check_ints(
    name: str, values: object, *, low: int | None = None, high: int | None = None
) -> tuple[int, ...]:
    """Every element of a sequence checked by :func:`check_int`, as a tuple of ints.

    Plain ints within the bounds (the common case: a slot mapping, a block
    table) are recognised at C speed; anything else is checked one by one, so
    that the error names the first bad element. Bounds are compared as Python
    ints, so an id of ``2**70`` is out of range, never an overflow.
    """
    items = tuple(as_sequence(name, values))
    if set(map(type, items)) <= {int}:
        ints = cast(tuple[int, ...], items)
        below = low is not None and ints and min(ints) < low
        above = high is not None and ints and max(ints) > high
        if not (below or above):
            return ints
    return tuple(check_int(f"{name}[{i}]", v, low=low, high=high) for i, v in enumerate(items))


def check_token_ids(name: str, values: object) -> tuple[int, ...]:
    """Token ids: a sequence of non-negative ints, checked element by element.

    The common case, plain ints, is recognised at C speed (a prompt may hold
    a few hundred thousand tokens); anything else is checked one by one, so
    that the error names the first bad element.
    """
    items = tuple(as_sequence(name, values))
    if set(map(type, items)) <= {int}:
        ints = cast(tuple[int, ...], items)
        if not ints or min(ints) >= 0:
            return ints
    return tuple(check_token_id(f"{name}[{i}]", v) for i, v in enumerate(items))


def check_hash(name: str, value: object) -> bytes:
    """A block's content hash: non-empty ``bytes`` (see :mod:`spec.prefix_cache`).

    Empty bytes are refused: they would read as "no parent" in a chained hash.
    """
    if not isinstance(value, bytes):
        raise ArgumentTypeError(f"{name} must be bytes (a block hash), got {_describe(value)}")
    if not value:
        raise ArgumentValueError(f"{name} must be a non-empty block hash, got b''")
    return value


def check_keys(name: str, values: object) -> tuple[Hashable, ...]:
    """Extra hash keys: a list or tuple of hashable values (a string is one key, not a list)."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ArgumentTypeError(f"{name} must be a list or tuple of keys, got {_describe(values)}")
    for i, key in enumerate(values):
        try:
            hash(key)
        except TypeError:
            raise ArgumentTypeError(f"{name}[{i}] must be hashable, got {_describe(key)}") from None
    return tuple(values)
