"""Running the lockstep machine against one backend, under a profile, and collecting the result.

Every run is seeded (a random seed is drawn and reported when none is given),
so ``--seed`` reproduces it; and failing examples are saved in a Hypothesis
example database, so the next run replays them first.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import FlakyFailure
from hypothesis.stateful import run_state_machine_as_test

from conformance.compare import Difference
from conformance.lockstep import ConformanceFailure
from conformance.machine import LockstepMachine, RunStats, timed_progress
from conformance.plan import plan_for
from spec.backend import Backend, Capabilities

DATABASE_DIR = Path(".hypothesis") / "conformance"
_NO_SHRINK = [p for p in Phase if p not in (Phase.shrink, Phase.explain)]


@dataclass(frozen=True)
class Profile:
    """How hard to look: examples (random workloads) and steps (rules) per example."""

    name: str
    max_examples: int
    steps: int
    description: str


PROFILES = {
    p.name: p
    for p in (
        Profile("quick", 60, 20, "the default: about a minute on 2 CPU cores, Triton interpreted"),
        Profile("standard", 300, 40, "before a release or after a kernel change"),
        Profile("thorough", 2000, 60, "nightly, or when hunting a rare bug"),
    )
}


@dataclass
class RunResult:
    """The outcome of one run: passed, or the first difference and the workload that shows it."""

    backend: str
    profile: str
    seed: int
    capabilities: Capabilities
    skipped: tuple[str, ...]
    stats: RunStats
    wall_time_s: float = 0.0
    difference: Difference | None = None
    workload: list[str] = field(default_factory=list)
    flaky: bool = False

    @property
    def passed(self) -> bool:
        return self.difference is None


def run_suite(
    backend: Backend,
    backend_ref: str,
    *,
    profile: str = "quick",
    run_seed: int | None = None,
    dtypes: Iterable[str] | None = None,
    database: Path | None = DATABASE_DIR,
    max_examples: int | None = None,
    progress: Callable[[str], None] | None = None,
    shrink: bool = True,
) -> RunResult:
    """Run the lockstep machine against ``backend`` (named ``backend_ref`` in reports).

    Raises :class:`~conformance.plan.SetupError` if the backend can run nothing.
    ``shrink=False`` reports the first failing workload as found, unminimized (faster).
    """
    chosen = PROFILES[profile]
    caps = backend.capabilities
    plan = plan_for(caps, dtypes)
    stats = RunStats()
    result = RunResult(
        backend=backend_ref,
        profile=profile,
        seed=random.randrange(2**32) if run_seed is None else run_seed,
        capabilities=caps,
        skipped=plan.skipped,
        stats=stats,
    )
    tick = timed_progress(stats, progress)

    def factory() -> LockstepMachine:
        return LockstepMachine(backend, plan, stats, tick)

    config = settings(
        max_examples=max_examples or chosen.max_examples,
        stateful_step_count=chosen.steps,
        deadline=None,
        derandomize=False,  # the seed decides, even where a CI profile derandomizes
        database=_database(database, backend_ref),
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
        print_blob=False,
        phases=list(Phase) if shrink else _NO_SHRINK,
    )
    start = time.monotonic()
    try:
        # Hypothesis accepts any zero-argument callable that returns a machine.
        machine_factory: Any = seed(result.seed)(factory)
        run_state_machine_as_test(machine_factory, settings=config)
    except ConformanceFailure as failure:
        result.difference, result.workload = failure.difference, failure.log
    except FlakyFailure as group:
        inner = [e for e in group.exceptions if isinstance(e, ConformanceFailure)]
        if not inner:
            raise
        result.difference, result.workload, result.flaky = inner[0].difference, inner[0].log, True
    result.wall_time_s = time.monotonic() - start
    return result


def _database(root: Path | None, backend_ref: str) -> DirectoryBasedExampleDatabase | None:
    if root is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", backend_ref).strip("_") or "backend"
    return DirectoryBasedExampleDatabase(str(root / slug))
