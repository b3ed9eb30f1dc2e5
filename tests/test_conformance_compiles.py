"""Triton compiles timed apart from the backend's other time, without the suite importing Triton.

:func:`conformance.run.compiles.watching_compiles` puts Triton's JIT hooks around
a run: each compile (the cache hook before it, the post-compile hook after) is
counted and timed into the run's stats, and hooks set before are chained and
restored. It never imports Triton itself: imported before ``TRITON_INTERPRET``
is set, Triton's own ``@triton.jit`` helpers would be compiled-mode functions
that a later interpreted kernel cannot call (the bounds self-test, run after
numpy backends in one process, failed so).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest

from conformance.lockstep.run_stats import RunStats
from conformance.run.compiles import watching_compiles

ROOT = Path(__file__).resolve().parents[1]


def test_each_compile_is_counted_and_timed_and_hooks_set_before_still_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []

    def hook(when: str) -> Any:
        def record(**kw: Any) -> bool:
            seen.append(f"{when} {kw['key']}")
            return False

        return record

    runtime = types.SimpleNamespace(
        jit_cache_hook=hook("before"), jit_post_compile_hook=hook("after")
    )
    fake: Any = types.ModuleType("triton")
    fake.knobs = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "triton", fake)
    own_before, own_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    stats = RunStats()
    with watching_compiles(stats):
        for key in ("k1", "k2"):
            assert runtime.jit_cache_hook(key=key) is False  # False: Triton goes on to compile
            assert runtime.jit_post_compile_hook(key=key) is False
    assert stats.compiles == 2 and stats.compile_seconds >= 0.0
    assert seen == ["before k1", "after k1", "before k2", "after k2"]
    assert runtime.jit_cache_hook is own_before and runtime.jit_post_compile_hook is own_after


def test_a_run_of_a_numpy_backend_imports_no_triton() -> None:
    script = textwrap.dedent(
        """
        import sys
        from conformance import run_suite
        from conformance.lockstep.numpy_backend import NumpyPagedBackend
        r = run_suite(NumpyPagedBackend(), "n", run_seed=1, database=None, max_examples=1,
                      passes=("short",))
        assert r.passed, r.difference
        print("triton" in sys.modules)
        """
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
