"""The spec's memory bookkeeping and scheduler run where numpy is not installed.

The sandbox page runs them in the browser, where there is no numpy. Each test
here starts a Python whose imports of numpy fail, as they do there, and checks
that the block pool, prefix cache, block manager, batch layout, scheduler and
the sandbox's drawing import and give the same answers as with numpy; that the
modules that do need numpy say so; and that ``spec``'s public names are all
still there, the numpy ones loaded on first use.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from docs_tools.sandbox_check import CELLS, RUNAWAY, cell_source
from paged_spec.cells import run

ROOT = Path(__file__).resolve().parent.parent

BLOCK_NUMPY = """
import sys

class _NoNumpy:
    \"\"\"Every import of numpy fails, as where it is not installed.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoNumpy())
"""

MODULES = [
    "spec",
    "spec.errors",
    "spec.validate",
    "spec.kv_budget",
    "spec.block_pool",
    "spec.prefix_cache",
    "spec.block_manager",
    "spec.kv_groups",
    "spec.batch",
    "spec.request",
    "spec.swap",
    "spec.metrics",
    "spec.sched_policy",
    "spec.sched_queue",
    "spec.cache_manager",
    "spec.speculative",
    "spec.sched_types",
    "spec.sched_continuous",
    "spec.sched_static",
    "spec.scheduler",
    "paged_spec.svg",
    "paged_spec.cells",
    "paged_spec.sandbox",
]
NEED_NUMPY = ["spec.kv_memory", "spec.attention", "spec.backend", "spec.kv_geometry"]
CELL_NAMES = sorted(p.stem for p in CELLS.glob("*.py") if p.stem not in ("conftest", RUNAWAY))


def without_numpy(script: str) -> object:
    """Run ``script`` in a Python that cannot import numpy; the JSON it printed last."""
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_NUMPY + script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _run(code: str) -> list[object]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        r = run(code)
    return [out.getvalue(), r.error.splitlines()[-1:], list(r.pictures)]


def test_the_sandbox_runs_without_numpy() -> None:
    """Every module the cells use imports, and every cell prints and draws the same."""
    got = without_numpy(
        f"""
import contextlib, importlib, io, json
for name in {MODULES!r}:
    importlib.import_module(name)
from paged_spec.cells import run
from docs_tools.sandbox_check import cell_source
cells = {{}}
for name in {CELL_NAMES!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        r = run(cell_source(name))
    cells[name] = [out.getvalue(), r.error.splitlines()[-1:], list(r.pictures)]
import paged_spec.sandbox
with contextlib.redirect_stdout(io.StringIO()):
    paged_spec.sandbox.main(["--block-size", "16", "--tokens", "20"])
missing = {{}}
for name in {NEED_NUMPY!r}:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing[name] = e.name
try:
    from spec import KVMemory
except ModuleNotFoundError as e:
    missing["spec.KVMemory"] = e.name
print(json.dumps({{"cells": cells, "missing": missing, "numpy": "numpy" in sys.modules}}))
"""
    )
    assert isinstance(got, dict)
    assert got["numpy"] is False
    assert got["missing"] == {name: "numpy" for name in [*NEED_NUMPY, "spec.KVMemory"]}
    expected = {name: _run(cell_source(name)) for name in CELL_NAMES}
    assert got["cells"] == expected


def test_every_public_name_of_spec_is_there() -> None:
    """The names that need numpy are loaded on first use, and are the modules' own."""
    import spec.kv_memory

    assert set(spec.__all__) <= set(dir(spec))
    assert spec.KVMemory is spec.kv_memory.KVMemory
    namespace: dict[str, object] = {}
    exec("from spec import *", namespace)
    assert set(spec.__all__) <= set(namespace)
    try:
        spec.NotAName  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as e:
        assert "no attribute 'NotAName'" in str(e)
    else:
        raise AssertionError("spec.NotAName did not raise AttributeError")
    assert without_numpy("import json, spec; print(json.dumps(spec.BlockManager.__name__))") == (
        "BlockManager"
    )


# What each check of spec.validate says about each value: its result or its error. Code,
# not a function of this module, so that the Python without numpy runs it without
# importing this module (and Hypothesis).
ANSWERS = """
import spec.validate as v

def answers(values):
    checks = [
        lambda x: v.check_int("x", x),
        lambda x: v.check_bool("x", x),
        lambda x: v.check_real("x", x),
        lambda x: v.check_scale("x", x),
        lambda x: v.check_token_ids("x", x),
        lambda x: v.is_array(x),
    ]
    out = []
    for x in values:
        row = []
        for check in checks:
            try:
                row.append(repr(check(x)))
            except Exception as e:
                row.append(f"{type(e).__name__}: {e}")
        out.append(row)
    return out
"""

_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(),
    st.text(max_size=3),
    st.none(),
    st.lists(st.integers(-3, 10**6), max_size=4),
    st.lists(st.booleans(), max_size=2),
)


@settings(max_examples=3)
@given(st.lists(_VALUES, min_size=20, max_size=60))
def test_validation_answers_the_same_without_numpy(values: list[object]) -> None:
    """For values of Python's own types, numpy's absence changes no answer."""
    namespace: dict[str, Any] = {}
    exec(ANSWERS, namespace)
    sent = json.dumps(json.dumps(values))
    got = without_numpy(ANSWERS + f"import json\nprint(json.dumps(answers(json.loads({sent}))))")
    assert got == namespace["answers"](values)
