"""What every test shares: Hypothesis settings profiles, and the session's devices.

* ``ci``: chosen automatically when the ``CI`` environment variable is set:
  derandomized, no deadline, few examples, so CI is fast and repeatable.
* ``dev``: the default for a person at a terminal: random, more examples.
* ``thorough``: ``HYPOTHESIS_PROFILE=thorough``: many examples, long runs.

Devices (the rule is in ``tests/devices.py``): a session that interprets the kernels
(``TRITON_INTERPRET``, as ``make test`` sets it) hides any GPU from itself and its children,
so that on a CUDA machine it runs exactly as on CI; tests marked ``needs_interpreter`` or
``gpu_only`` are skipped, saying why, in a session that cannot run them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

if "TRITON_INTERPRET" not in os.environ and importlib.util.find_spec("torch") is not None:
    import backend_gpu  # noqa: F401  (its rule, no CUDA: interpret; before triton is imported)

if importlib.util.find_spec("triton") is not None:
    from triton import knobs

    if knobs.runtime.interpret:  # Triton's own reading of TRITON_INTERPRET
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks torch for a GPU

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "ci",
    max_examples=30,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=_SLOW_OK
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``heavy`` (minutes each) run first, so that parallel workers
    (``pytest -n``) share them out early and finish together, instead of one worker
    starting a long test when the others are nearly done."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
    if any(item.get_closest_marker(m) for item in items for m in ("needs_interpreter", "gpu_only")):
        from devices import MARKS  # torch and backend_gpu: only for a session that needs them

        for item in items:
            for name, (skips, reason) in MARKS.items():
                if skips and item.get_closest_marker(name):
                    item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header() -> str:
    """Which kernels this session tests, in the header of every run."""
    if knobs.runtime.interpret:
        return "kernels: interpreted on the CPU (TRITON_INTERPRET set; any GPU hidden)"
    if "TRITON_INTERPRET" in os.environ:
        return f"kernels: compiled (TRITON_INTERPRET={os.environ['TRITON_INTERPRET']})"
    return "kernels: compiled where CUDA is present, else interpreted (TRITON_INTERPRET unset)"
