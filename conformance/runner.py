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
from hypothesis.errors import FlakyFailure, Unsatisfiable
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
    """How hard to look: examples (random workloads), steps (rules) per example, and passes.

    After the short examples, each further pass (:data:`conformance.plan.PASSES`)
    runs a fixed number of examples, because each costs seconds on an
    interpreted kernel and a chance draw would either miss or repeat them:
    long contexts, wide batches, a large pool, and each production shape.
    """

    name: str
    max_examples: int
    steps: int
    long_examples: int
    description: str
    wide_examples: int = 2
    large_pool_examples: int = 1
    production_examples: int = 1  # per production shape

    def pass_examples(self, kind: str, override: int | None = None) -> int:
        """Examples of one pass; an override scales the fixed passes (at least one each).

        >>> from conformance.plan import PASSES
        >>> [PROFILES["quick"].pass_examples(k) for k in PASSES]
        [60, 2, 5, 1, 1]
        """
        fixed = {
            "wide": self.wide_examples,
            "long": self.long_examples,
            "large pool": self.large_pool_examples,
            "production": self.production_examples,
        }
        if kind == "short":
            return self.max_examples if override is None else override
        if override is None:
            return fixed[kind]
        return max(1, override * fixed[kind] // self.max_examples)

    def pass_steps(self, kind: str) -> int:
        """Rules per example of a pass: fewer where each step runs many sequences or blocks."""
        return max(3, self.steps // 4) if kind in ("wide", "production") else self.steps


PROFILES = {
    p.name: p
    for p in (
        Profile(
            "quick", 60, 20, 5, "the default: about two minutes on 2 CPU cores, Triton interpreted"
        ),
        Profile("standard", 300, 40, 25, "before a release or after a kernel change", 8, 4, 3),
        Profile("thorough", 2000, 60, 150, "nightly, or when hunting a rare bug", 40, 15, 10),
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
    notes: tuple[str, ...] = ()  # what was drawn, and from where (declared sets, the envelope)
    envelope: str = "cpu"
    passes: list[tuple[str, int]] = field(default_factory=list)  # (pass, examples asked)
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
    passes: Iterable[str] | None = None,
) -> RunResult:
    """Run the lockstep machine against ``backend`` (named ``backend_ref`` in reports).

    Raises :class:`~conformance.plan.SetupError` if the backend can run nothing.
    ``shrink=False`` reports the first failing workload as found, unminimized (faster).
    ``passes`` limits the run to those kinds of example (:data:`conformance.plan.PASSES`).
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
        notes=plan.notes,
        envelope=plan.envelope.device,
    )
    tick = timed_progress(stats, progress)
    start = time.monotonic()
    kinds = None if passes is None else set(passes)
    for plan_now in plan.passes():
        if kinds is not None and plan_now.kind not in kinds:
            continue
        why = _pass_unavailable(backend, plan_now)
        if why:
            result.skipped += (why,)
            continue
        count = chosen.pass_examples(plan_now.kind, max_examples)
        name = _pass_name(plan_now)
        result.passes.append((name, count))
        suffix = "" if plan_now.kind == "short" else "-" + name.replace(" ", "-")
        db = _database(database, backend_ref + suffix)
        config = _settings(count, chosen.pass_steps(plan_now.kind), db, shrink)
        _run_pass(result, backend, plan_now, config, tick)
        if not result.passed:
            break
    result.wall_time_s = time.monotonic() - start
    return result


def _pass_name(plan: Plan) -> str:
    """``short``, ``long``, ..., or ``production (head dim 128, 8/2 heads, block size 16)``."""
    return plan.kind if plan.shape is None else f"{plan.kind} ({plan.shape.describe()})"


def _pass_unavailable(backend: Backend, plan: Plan) -> str | None:
    """Why a pass cannot run on this backend (``None`` when it can)."""
    if plan.kind == "large pool" and not callable(getattr(backend, "read_blocks", None)):
        return (
            "large pool pass (KV offsets past 2^31 elements): the backend has no "
            "read_blocks(layer, blocks), and copying a pool of 2^31 elements is not an option"
        )
    return None


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
    except Unsatisfiable:
        result.skipped += (f"{_pass_name(plan)} pass: no example the backend supports",)


def _database(root: Path | None, backend_ref: str) -> DirectoryBasedExampleDatabase | None:
    if root is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", backend_ref).strip("_") or "backend"
    return DirectoryBasedExampleDatabase(str(root / slug))
