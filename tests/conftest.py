"""Hypothesis settings profiles shared by every test.

* ``ci``: chosen automatically when the ``CI`` environment variable is set:
  derandomized, no deadline, few examples, so CI is fast and repeatable.
* ``dev``: the default for a person at a terminal: random, more examples.
* ``thorough``: ``HYPOTHESIS_PROFILE=thorough``: many examples, long runs.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

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
