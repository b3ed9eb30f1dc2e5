"""One run in several processes side by side: ``--jobs N``.

Each job is an isolated child (:mod:`conformance.run.isolation`) with the
run's seed, so all of them generate the same examples; each example runs in
full in the first job to claim it (:class:`~conformance.run.shard.Claims`)
and is drawn through the spec alone in the others. A job slowed by a long
example therefore leaves the next ones to the others, and together they run
each example of the run exactly once, whoever ran it: the verdict, the counts
and the coverage are those of the run in one process. One loop watches every
job; their results merge into one :class:`~conformance.run.runner.RunResult`:
counts and coverage added up, every failing pass kept (ordered by pass, then
job), the first of them the headline. With N free cores a run whose time is
the backend's (an interpreted kernel) takes about 1/N of its time, plus the
spec's bookkeeping of the examples the other jobs ran. Each job gets its share of
the cores for its torch and BLAS threads (``OMP_NUM_THREADS``, unless set): two
jobs of two threads each on two cores took 119 s for ``quick`` on Triton here,
of one thread each 67 s.

``--jobs`` composes with ``--shard K/N``: the jobs then share shard K's examples.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

from conformance.errors import SetupError
from conformance.lockstep.run_stats import RunStats
from conformance.run.failures import PassFailure
from conformance.run.isolation import BackendChild, Request, run_together, to_stderr
from conformance.run.result import RunResult, restore_headline, take_failure

MAX_JOBS = 64
"""More jobs than this at once is a mistake (each holds a backend and a GiB or so)."""


def run_parallel(
    request: Request,
    jobs: int,
    progress: Callable[[str], None] | None = None,
    output: Callable[[str], None] | None = None,
) -> RunResult:
    """Run ``request`` in ``jobs`` processes side by side; their merged result.

    Raises :class:`~conformance.errors.SetupError` when any job met one.
    """
    assert 1 <= jobs <= MAX_JOBS and request.claims is None, (jobs, request.claims)
    say = progress or (lambda _: None)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="conformance-claims-") as folder:
        children = [
            BackendChild(
                replace(request, claims=folder),
                _tagged(say, f"job {j + 1}/{jobs}"),
                output or to_stderr,
                threads_per_job(jobs),
            )
            for j in range(jobs)
        ]
        run_together(children)
    outcomes = []
    for j, child in enumerate(children):
        try:
            outcomes.append(child.outcome())
        except SetupError as err:
            raise SetupError(f"job {j + 1} of {jobs}: {err}") from None
    merged = merge(outcomes, jobs)
    merged.wall_time_s = time.monotonic() - start
    return merged


def threads_per_job(jobs: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a job adds: its share of the cores for torch's and BLAS's threads, so
    that N jobs do not each start a thread per core (nothing when the user chose a count).

    >>> threads_per_job(2, {})["OMP_NUM_THREADS"] == str(max(1, _cores() // 2))
    True
    >>> threads_per_job(2, {"OMP_NUM_THREADS": "3"})
    {}
    """
    env = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in env:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, _cores() // jobs))}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def merge(results: list[RunResult], jobs: int) -> RunResult:
    """The jobs' results as one run's: counts added, every failure kept, the first the
    headline (the earliest pass's; between jobs, the lower job's)."""
    first, *rest = results
    stats = RunStats()
    for result in results:
        stats.add(result.stats)
    merged = replace(first, stats=stats, failures=[], jobs=jobs)
    for other in rest:
        merged.skipped = tuple(dict.fromkeys((*merged.skipped, *other.skipped)))
        merged.passes = max(merged.passes, other.passes, key=len)
        merged.stopped = merged.stopped or other.stopped
        merged.interrupted = merged.interrupted or other.interrupted
        merged.slowest_call = max(merged.slowest_call, other.slowest_call, key=lambda c: c[1])
        if merged.bounds is not None and other.bounds is not None:
            merged.bounds = merged.bounds.add(other.bounds)
    order = {name: i for i, (name, _) in enumerate(merged.passes)}
    found = [(r, f) for r in results for f in _failures(r)]
    found.sort(key=lambda rf: order.get(rf[1].pass_name, len(order)))  # stable: job order
    merged.failures = [f for _, f in found]
    merged.diagnostics = next((r.diagnostics for r, _ in found if r.diagnostics), ())
    if merged.failures:
        restore_headline(merged)
    return merged


def _failures(result: RunResult) -> list[PassFailure]:
    """A job's failing passes; a hang or crash with no failure before it counts as one."""
    if result.failures or result.difference is None:
        return list(result.failures)
    return [take_failure(result, "in flight")]


def _tagged(progress: Callable[[str], None], tag: str) -> Callable[[str], None]:
    return lambda line: progress(f"{tag}: {line}")
