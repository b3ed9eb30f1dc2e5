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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import FlakyFailure
from hypothesis.stateful import run_state_machine_as_test

from conformance.compare import Difference
from conformance.lockstep import ConformanceFailure
from conformance.machine import LockstepMachine, RunStats, timed_progress
from conformance.plan import Plan, SetupError, plan_for
from spec.backend import Backend, Capabilities

DATABASE_DIR = Path(".hypothesis") / "conformance"
_NO_SHRINK = [p for p in Phase if p not in (Phase.shrink, Phase.explain)]


@dataclass(frozen=True)
class Profile:
    """How hard to look: examples (random workloads), steps (rules) per example, long examples.

    The long-context examples run as a second pass, after the others pass: each
    costs seconds on an interpreted kernel, so their number is fixed, not left
    to chance.
    """

    name: str
    max_examples: int
    steps: int
    long_examples: int
    description: str

    def examples(self, override: int | None) -> tuple[int, int]:
        """Short and long examples; an override scales the long ones (at least one).

        >>> PROFILES["quick"].examples(None), PROFILES["quick"].examples(12)
        ((60, 5), (12, 1))
        """
        if override is None:
            return self.max_examples, self.long_examples
        return override, max(1, override * self.long_examples // self.max_examples)


PROFILES = {
    p.name: p
    for p in (
        Profile(
            "quick", 60, 20, 5, "the default: about a minute on 2 CPU cores, Triton interpreted"
        ),
        Profile("standard", 300, 40, 25, "before a release or after a kernel change"),
        Profile("thorough", 2000, 60, 150, "nightly, or when hunting a rare bug"),
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
    if max_examples is not None and max_examples < 1:
        raise SetupError(f"max_examples must be at least 1, got {max_examples}")
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
    short, long = chosen.examples(max_examples)
    start = time.monotonic()
    passes = ((plan, short, ""), (replace(plan, long_context=True), long, "-long"))
    for plan_now, count, suffix in passes:
        config = _settings(count, chosen.steps, _database(database, backend_ref + suffix), shrink)
        _run_pass(result, backend, plan_now, config, tick)
        if not result.passed:
            break
    result.wall_time_s = time.monotonic() - start
    return result


def _settings(
    count: int, steps: int, database: DirectoryBasedExampleDatabase | None, shrink: bool
) -> settings:
    return settings(
        max_examples=count,
        stateful_step_count=steps,
        deadline=None,
        derandomize=False,  # the seed decides, even where a CI profile derandomizes
        database=database,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
        print_blob=False,
        phases=list(Phase) if shrink else _NO_SHRINK,
    )


def _run_pass(
    result: RunResult,
    backend: Backend,
    plan: Plan,
    config: settings,
    tick: Callable[[], None],
) -> None:
    """One Hypothesis run of the machine; a failure is recorded in ``result``."""

    def factory() -> LockstepMachine:
        return LockstepMachine(backend, plan, result.stats, tick)

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


def _database(root: Path | None, backend_ref: str) -> DirectoryBasedExampleDatabase | None:
    if root is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", backend_ref).strip("_") or "backend"
    return DirectoryBasedExampleDatabase(str(root / slug))
