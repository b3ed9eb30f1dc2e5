"""How a run is controlled: shrinking, time limits, the long examples, the per-call timeout,
bounds checking.

The same knobs come from command-line flags (:mod:`conformance.cli`) and from
environment variables (for the pytest ways, :mod:`conformance.testing`); this
module holds their defaults and the one parser of the environment, so a flag
and its variable cannot drift apart.

>>> RunControl().call_timeout_s
120.0
>>> options = environment_options({"PAGED_SPEC_SEED": "7", "PAGED_SPEC_NO_SHRINK": "1"})
>>> options.seed, options.control.shrink
(7, False)
>>> environment_options({"PAGED_SPEC_CHECK_BOUNDS": "1"}).control.check_bounds
'default'
>>> environment_options({"PAGED_SPEC_EXAMPLES": "0"})
Traceback (most recent call last):
...
conformance.errors.SetupError: PAGED_SPEC_EXAMPLES='0': must be at least 1, got 0
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from conformance.bounds.checker import MODES
from conformance.errors import SetupError
from conformance.judges.oracle import memory_limit_from

_T = TypeVar("_T")

DEFAULT_CALL_TIMEOUT_S = 120.0
"""Seconds one backend call may take before the run reports it as hung.

Generous on purpose: the slowest calls the project has seen are long-context
attention calls of a Triton kernel under the CPU interpreter (seconds each,
more on a loaded machine) and a kernel's first compile on a GPU (tens of
seconds). Every report prints the slowest call of its run, to size it from.
"""
POISON_MODES = ("nan", "finite", "off")
"""What examples may fill the slots no live token owns with: NaN or infinities, large finite
values, or nothing (:attr:`RunControl.poison`)."""
LOAD_TIMEOUT_S = 60.0
"""The least time loading a backend may take (importing torch can take many seconds)."""


@dataclass(frozen=True)
class RunControl:
    """The knobs that bound a run, and the one that adds a check (``check_bounds``).

    None but ``check_bounds`` changes what a passing backend means.
    ``shrink``: minimise a failing workload (off: report it as found, faster).
    ``shrink_time_s``: stop minimising after this long and report the smallest so far.
    ``long_examples``: how many long-context examples (``None``: the profile's).
    ``time_budget_s``: stop drawing new examples after this long; the report
    then says "passed within the time budget". ``call_timeout_s``: a backend
    call that takes longer is reported as hung (``None``: wait forever).
    ``check_bounds``: ``"default"`` or ``"strict"`` (:data:`conformance.bounds.checker.MODES`)
    checks every memory access of the backend's interpreted Triton kernels
    (:mod:`conformance.bounds.checker`); ``None``: no bounds check.
    ``reference_memory``: bytes the fast reference's temporaries may hold
    (``None``: ``PAGED_SPEC_REFERENCE_MEMORY``, else 1 GiB).
    ``envelope``: draw this envelope (``"cpu"`` or ``"device"``) instead of
    the one ``capabilities.device`` picks; ``envelope_scale``: divide the
    envelope's lengths and widths by this factor
    (:func:`conformance.lockstep.envelope_scale.scaled`).
    ``poison``: what examples may fill the slots no live token owns with
    (:data:`POISON_MODES`): ``"nan"``, NaN or infinities (the default: a kernel
    that reads such a slot, even to multiply it by a zero weight, fails);
    ``"finite"``, large finite values only (a kernel that multiplies masked
    values by zero passes; one that uses them still fails; the verdict says
    that reads of unowned memory were not judged for NaN); ``"off"``, stale
    data only (the vectors export: its format holds finite data). ``True`` and
    ``False`` mean ``"nan"`` and ``"off"``.
    ``every_pass``: a failing pass does not stop the others, so one bug cannot
    hide another (off: stop at the first failure, as the selftest does).
    """

    shrink: bool = True
    shrink_time_s: float | None = None
    long_examples: int | None = None
    time_budget_s: float | None = None
    call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S
    check_bounds: str | None = None
    reference_memory: int | None = None
    envelope: str | None = None
    envelope_scale: int = 1
    every_pass: bool = True
    poison: str = "nan"  # one of POISON_MODES (True: "nan", False: "off")

    def __post_init__(self) -> None:
        if isinstance(self.poison, bool):
            object.__setattr__(self, "poison", "nan" if self.poison else "off")
        if self.poison not in POISON_MODES:
            modes = ", ".join(POISON_MODES)
            raise SetupError(f"poison must be one of {modes}, got {self.poison!r}")
        if self.envelope is not None and self.envelope not in ("cpu", "device"):
            raise SetupError(f"envelope must be cpu or device, got {self.envelope!r}")
        if self.envelope_scale < 1:
            raise SetupError(f"envelope scale must be at least 1, got {self.envelope_scale}")
        if self.reference_memory is not None and self.reference_memory < 1:
            raise SetupError(f"reference memory must be positive, got {self.reference_memory}")
        if self.check_bounds is not None and self.check_bounds not in MODES:
            raise SetupError(
                f"check_bounds must be None or one of {', '.join(MODES)}, got {self.check_bounds!r}"
            )
        for name in ("shrink_time_s", "time_budget_s", "call_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise SetupError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.long_examples is not None and self.long_examples < 0:
            raise SetupError(f"long_examples must be at least 0, got {self.long_examples}")


@dataclass(frozen=True)
class EnvironmentOptions:
    """What the ``PAGED_SPEC_*`` variables ask for (``None``: not set)."""

    profile: str | None = None
    seed: int | None = None
    max_examples: int | None = None
    dtypes: tuple[str, ...] | None = None
    control: RunControl = field(default_factory=RunControl)


ENVIRONMENT = {
    "PAGED_SPEC_PROFILE": "the profile: quick, standard or thorough",
    "PAGED_SPEC_SEED": "the run's seed (every summary prints it)",
    "PAGED_SPEC_EXAMPLES": "examples instead of the profile's (at least 1)",
    "PAGED_SPEC_DTYPES": "only these cache dtypes, comma-separated",
    "PAGED_SPEC_LONG_EXAMPLES": "long-context examples instead of the profile's (0: none)",
    "PAGED_SPEC_TIME_BUDGET": "seconds: stop drawing new examples after this long",
    "PAGED_SPEC_NO_SHRINK": "1: report a failing workload as found, without minimising it",
    "PAGED_SPEC_SHRINK_TIME": "seconds: stop minimising a failure after this long",
    "PAGED_SPEC_CALL_TIMEOUT": (
        f"seconds one backend call may take (default {DEFAULT_CALL_TIMEOUT_S:g}; 0: no limit)"
    ),
    "PAGED_SPEC_REFERENCE_MEMORY": (
        "bytes the fast reference's temporaries may hold (suffix K, M or G; default 1G)"
    ),
    "PAGED_SPEC_CHECK_BOUNDS": (
        "default or strict (1: default, 0: off): bounds-check the backend's interpreted "
        "Triton kernels"
    ),
}
"""The environment variables of the pytest ways, and what each one sets."""


def environment_options(environ: Mapping[str, str] | None = None) -> EnvironmentOptions:
    """Parse the ``PAGED_SPEC_*`` variables; :class:`SetupError` names a bad one."""
    env = os.environ if environ is None else environ

    def get(name: str, parse: Callable[[str], _T]) -> _T | None:
        text = env.get(name, "").strip()
        if not text:
            return None
        try:
            return parse(text)
        except ValueError as err:
            raise SetupError(f"{name}={text!r}: {err}") from None

    timeout = get("PAGED_SPEC_CALL_TIMEOUT", timeout_seconds)
    return EnvironmentOptions(
        profile=get("PAGED_SPEC_PROFILE", str),
        seed=get("PAGED_SPEC_SEED", at_least(0)),
        max_examples=get("PAGED_SPEC_EXAMPLES", at_least(1)),
        dtypes=get("PAGED_SPEC_DTYPES", _names),
        control=RunControl(
            shrink=not get("PAGED_SPEC_NO_SHRINK", _flag),
            shrink_time_s=get("PAGED_SPEC_SHRINK_TIME", seconds),
            long_examples=get("PAGED_SPEC_LONG_EXAMPLES", at_least(0)),
            time_budget_s=get("PAGED_SPEC_TIME_BUDGET", seconds),
            call_timeout_s=DEFAULT_CALL_TIMEOUT_S if timeout is None else timeout or None,
            check_bounds=get("PAGED_SPEC_CHECK_BOUNDS", _bounds_setting) or None,
            reference_memory=get("PAGED_SPEC_REFERENCE_MEMORY", memory_limit_from),
            poison=get("PAGED_SPEC_POISON", poison_mode) or "nan",
        ),
    )


def poison_mode(text: str) -> str:
    """One of :data:`POISON_MODES` (``PAGED_SPEC_POISON``).

    >>> poison_mode("finite")
    'finite'
    """
    if text not in POISON_MODES:
        raise ValueError(f"expected one of {', '.join(POISON_MODES)}")
    return text


def bounds_mode(text: str) -> str:
    """A bounds-check mode of :data:`~conformance.bounds.checker.MODES` (also an argparse ``type``).

    >>> bounds_mode("strict")
    'strict'
    >>> bounds_mode("loose")
    Traceback (most recent call last):
    ...
    ValueError: 'loose' is not a bounds-check mode: choose from default, strict
    """
    if text not in MODES:
        raise ValueError(f"{text!r} is not a bounds-check mode: choose from {', '.join(MODES)}")
    return text


def _bounds_setting(text: str) -> str:
    """A mode, or a flag: 1 (true, yes, on) for ``default``, 0 (false, no, off) for none ("")."""
    if text in MODES:
        return text
    try:
        return "default" if _flag(text) else ""
    except ValueError:
        raise ValueError(f"expected {', '.join(MODES)}, 1 or 0") from None


def seconds(text: str) -> float:
    """A positive, finite number of seconds (also an argparse ``type``)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"must be a positive number of seconds, got {text}")
    return value


def timeout_seconds(text: str) -> float:
    """Seconds, or ``0`` for no limit (returned as 0.0; also an argparse ``type``)."""
    return 0.0 if text in ("0", "0.0") else seconds(text)


def at_least(low: int) -> Callable[[str], int]:
    """A parser of integers of at least ``low`` (also an argparse ``type``, through the CLI)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
        if value < low:
            raise ValueError(f"must be at least {low}, got {value}")
        return value

    return parse


def argument_type(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """``parse`` as an argparse ``type`` whose ``ValueError`` message argparse shows as is."""

    def checked(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    checked.__name__ = getattr(parse, "__name__", "value")
    return checked


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _flag(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1 or 0 (true or false)")
