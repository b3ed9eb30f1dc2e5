"""What an isolated run's child tells its parent: one JSON object per line, on its own pipe.

The child (:mod:`conformance.run.worker`) writes, the parent
(:mod:`conformance.run.isolation`) reads. Each message has a type ``t``:

========== ============================== ==============================================
``t``      fields                         meaning
========== ============================== ==============================================
hello      pid                            the child started
call       what, step, layer, log, new    a backend call starts; ``log``: the workload
                                          lines logged since the last call (``new``: a
                                          new workload starts with them)
ret                                       that call returned (or raised)
progress   line                           a progress line for the person waiting
start      result                         the run's :class:`~conformance.run.runner.RunResult`
                                          before any example (seed, capabilities, skips),
                                          and again as each pass starts and after each
                                          failing pass (its failures)
stats      stats                          :class:`~conformance.lockstep.machine.RunStats` after
                                          each example
result     result                         the final result
setup      message                        a setup error (the parent exits 2)
found      difference, workload           the run's first failure, as found, before it
                                          is shrunk (a child that dies while shrinking
                                          still has it reported)
workload   workload                       the scheduler suite: the workload it runs now
========== ============================== ==============================================

So the parent always holds the workload so far, the call in flight and the
coverage so far, and can report a crash or a hang without the child's help.
Objects (``result``, ``stats``, ``difference``) travel as base64 pickles of this project's
classes only: capabilities are rebuilt as a plain
:class:`~spec.capabilities.Capabilities` without the ``excludes`` hook, so the parent
never imports the backend's code.

>>> from conformance.lockstep.machine import RunStats
>>> line = encode({"t": "stats", "stats": RunStats(examples=3)})
>>> decode(line)["stats"].examples
3
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Set as AbstractSet
from dataclasses import fields, replace
from typing import Any

from spec.capabilities import Capabilities

_OBJECTS = ("result", "stats", "workload", "difference")
"""Message fields that carry Python objects rather than JSON values."""


def encode(event: dict[str, Any]) -> bytes:
    """One message as a line of JSON (objects pickled)."""
    out = dict(event)
    for key in _OBJECTS:
        if key in out:
            value = _portable(out[key])
            out[key] = base64.b64encode(pickle.dumps(value)).decode("ascii")
    return json.dumps(out, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """The message of one line (objects unpickled); ``ValueError`` if it is not one."""
    event = json.loads(line)
    if not isinstance(event, dict) or "t" not in event:
        raise ValueError(f"not a message: {line[:80]!r}")
    for key in _OBJECTS:
        if key in event:
            event[key] = pickle.loads(base64.b64decode(event[key]))  # our own child's bytes
    return event


def _portable(value: Any) -> Any:
    """``value`` with its capabilities (if any) made of this project's types only."""
    caps = getattr(value, "capabilities", None)
    if isinstance(caps, Capabilities):
        return replace(value, capabilities=plain_capabilities(caps))
    return value


def plain_capabilities(caps: Capabilities) -> Capabilities:
    """A :class:`Capabilities` with the same values, built-in types only, and no hook."""
    values: dict[str, Any] = {}
    for f in fields(Capabilities):
        if f.init and f.name != "excludes":
            value = getattr(caps, f.name)
            values[f.name] = frozenset(value) if isinstance(value, AbstractSet) else value
    return Capabilities(**values)
