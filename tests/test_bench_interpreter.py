"""``benchmarks.interpreter``: its baseline is the shim without its two speed-ups, values kept."""

from __future__ import annotations

import pytest

from benchmarks.interpreter import _without_speed_ups

pytestmark = pytest.mark.needs_interpreter


def test_the_baseline_puts_back_only_the_speed_ups() -> None:
    from triton.runtime import interpreter as interp

    from conformance.interpreter import install, installed, uninstall
    from conformance.interpreter.shim import SHIM

    depth = 0
    while installed():  # an earlier test's suite run may have installed it for good
        uninstall()
        depth += 1
    own_call = interp.InterpretedFunction.__dict__["__call__"]
    own_launch = interp.GridExecutor.__dict__["__call__"]
    _without_speed_ups()
    try:
        assert SHIM.installed
        assert interp.interpreter_builder.options.sanitize_overflow  # the interpreter's own
        assert interp.InterpretedFunction.__dict__["__call__"] is own_call
        assert interp.GridExecutor.__dict__["__call__"] is not own_launch  # corrections stay
    finally:
        uninstall()
        for _ in range(depth):
            install()
    assert depth > 0 or interp.InterpretedFunction.__dict__["__call__"] is own_call
