"""A planted bug of the device-resident contract, and the self-test lines that go with it.

Under ``tensors="torch"`` the suite builds each step's metadata once, on the
device, and hands the same tensors to every layer of that step
(:mod:`conformance.judges.device_contract`). An engine that captures a CUDA graph
keeps its own input buffers and must copy each step's metadata into them; the
classic bug is a buffer that is filled once and never refreshed.
:class:`StaleCapturedTables` is the torch backend with exactly that bug: it
keeps the first block tables it is given for each table shape and reads those
on every later step with the same shape. Its outputs are right until a step
whose tables differ in content but not in shape (a sequence replaced by
another, a copy-on-write), which is what the suite must find.

Part of ``python -m conformance selftest`` (:mod:`conformance.planted.selftest`):
the project's torch backend under the device contract must pass, and the
planted one must fail on an attention output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from conformance.run.control import RunControl
from conformance.run.result import RunResult
from conformance.run.runner import run_suite

if TYPE_CHECKING:
    from spec.batch import BatchArrays

SEED = 20240601
EXAMPLES = 30
"""Short examples per run: enough for a step that reuses a table shape with new contents."""


def make_stale_tables_backend() -> Any:
    """The torch backend (device contract) with block tables captured once per shape."""
    from backend_gpu.torch_backend import TorchBackend

    class StaleCapturedTables(TorchBackend):
        """Reads the first block tables seen for each shape: a captured buffer never refreshed."""

        def __init__(self) -> None:
            super().__init__("cpu", tensors="torch")
            self._captured: dict[tuple[int, ...], Any] = {}

        def attention(self, *args: Any, arrays: BatchArrays[Any] | None = None, **kw: Any) -> Any:
            if arrays is not None:
                stale = tuple(
                    self._captured.setdefault(tuple(t.shape), t) for t in arrays.group_tables
                )
                arrays = replace(arrays, group_tables=stale, block_tables=stale[0])
            return super().attention(*args, arrays=arrays, **kw)

    return StaleCapturedTables()


def device_selftest(out: Callable[[str], None] = print) -> bool:
    """Print one line per run; True when the torch backend passes and the planted one fails."""
    try:
        from backend_gpu.torch_backend import make_device_backend
    except ImportError as err:
        out(f"  device contract: not run here (the torch backend cannot be imported: {err})")
        return True
    correct = _run(make_device_backend(), "backend_gpu.torch_backend:make_device_backend")
    ok = correct.passed
    verdict = "passes" if ok else "FLAGGED (a false alarm)"
    out(f"  correct backend torch (device contract): {verdict}")
    if correct.difference is not None:
        out(correct.difference.describe())
    ref = "conformance.planted.device:make_stale_tables_backend"
    planted = _run(make_stale_tables_backend(), ref)
    diff = planted.difference
    caught = diff is not None and diff.what in ("output", "outputs")
    if diff is not None and caught:
        out(f"  caught  stale captured block tables\n          {diff.describe().splitlines()[0]}")
    else:
        got = "passed" if diff is None else diff.describe().splitlines()[0]
        out(f"  MISSED  stale captured block tables ({ref}): {got}")
    ok &= caught
    out(f"device contract: caught {int(caught)}/1")
    return ok


def _run(backend: Any, ref: str) -> RunResult:
    control = RunControl(shrink=False, long_examples=0, every_pass=False)
    return run_suite(
        backend,
        ref,
        run_seed=SEED,
        database=None,
        max_examples=EXAMPLES,
        control=control,
        passes=("short",),
    )
