"""Argument types for the tools' command lines: bad values are argparse errors (exit 2).

Each function is an argparse ``type=``: it converts the string or raises
``argparse.ArgumentTypeError``, which argparse reports as
``argument --flag: ...`` with a usage line and exit status 2, before the tool
does any work. So ``--layers 0`` or ``--utilization nan`` never reaches the
arithmetic as a traceback.

>>> positive_int("16"), nonnegative_float("0"), fraction("0.9"), positive_floats("4,8.5")
(16, 0.0, 0.9, (4.0, 8.5))
>>> fraction("nan")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: must be a number in (0, 1], got 'nan'
"""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _finite(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _finite(text, "a finite number > 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _finite(text, "a finite number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A share of something: a number in ``(0, 1]``."""
    value = _finite(text, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def positive_floats(text: str) -> tuple[float, ...]:
    """A comma-separated, non-empty list of finite numbers > 0."""
    parts = [p.strip() for p in text.split(",")]
    try:
        return tuple(positive_float(p) for p in parts)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated finite numbers > 0, got {text!r}"
        ) from None
