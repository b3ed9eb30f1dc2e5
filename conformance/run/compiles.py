"""Triton compiles during a run, timed apart from the backend's other time.

On a GPU the first launch of each kernel specialisation compiles it (or loads
it from Triton's on-disk cache): seconds each, cold, inside a backend call.
:func:`watching_compiles` puts Triton's JIT hooks around every compile of the
run (the cache hook before it, the post-compile hook after), so the report
can say how much of the backend's time was compiling. Under the interpreter
nothing is compiled; :mod:`conformance.interpreter.specialisations` counts
what would be instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from conformance.lockstep.run_stats import RunStats


@contextmanager
def watching_compiles(stats: RunStats) -> Iterator[None]:
    """Count and time every Triton JIT compile in the block into ``stats`` (nothing without
    Triton's hooks). Hooks set before are called too, and restored after.

    Triton is never imported here: imported before ``TRITON_INTERPRET`` is set, its own
    ``@triton.jit`` helpers would be compiled-mode functions that a later interpreted kernel
    cannot call. A backend that compiles has imported it already.
    """
    triton = sys.modules.get("triton")
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        yield
        return
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    started: dict[str, float] = {}

    def on_cache(**kwargs: Any) -> bool:
        started[str(kwargs.get("key"))] = time.perf_counter()
        return bool(before(**kwargs)) if before is not None else False

    def on_compiled(**kwargs: Any) -> bool:
        begun = started.pop(str(kwargs.get("key")), None)
        if begun is not None:
            stats.compiles += 1
            stats.compile_seconds += time.perf_counter() - begun
        return bool(after(**kwargs)) if after is not None else False

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_cache, on_compiled
    try:
        yield
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
