"""Progress lines of parallel simulator runs, printed whole, by the parent process only.

Each run reports ``(done, total, clock)`` now and then. Worker processes that
printed those lines themselves would share one stderr, and two writes from two
processes may land inside each other's line. Here a worker only *sends* its
finished line through a queue, and the parent prints every line with one
``print``: the lines of different runs may alternate, but never mix.

>>> progress_line("paged", 40.0, 120, 1000, 12.345)
'       paged @ 40/s: 120/1000 done, t=12.3s'
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import Manager
from typing import Any, Protocol, TypeVar

__all__ = ["LineSink", "progress_line", "run_jobs"]

T = TypeVar("T")


class LineSink(Protocol):
    """Where a run's whole progress lines go: the parent's queue (a worker) or stderr."""

    def put(self, line: str) -> None: ...


class _Stderr:
    """The sink of a run in the parent process itself: print the line at once."""

    def put(self, line: str) -> None:
        print(line, file=sys.stderr)


def progress_line(policy: str, rate: float, done: int, total: int, clock: float) -> str:
    """One run's progress: policy, rate, requests finished of the trace, simulated seconds."""
    return f"  {policy:>10} @ {rate:g}/s: {done}/{total} done, t={clock:.1f}s"


def _drain(lines: queue.Queue[str], timeout: float) -> None:
    """Print each line waiting in ``lines`` with one ``print``; wait ``timeout`` for the first."""
    while True:
        try:
            print(lines.get(timeout=timeout), file=sys.stderr)
        except queue.Empty:
            return
        timeout = 0.0


def run_jobs(
    job: Callable[..., T], tasks: Sequence[tuple[Any, ...]], *, jobs: int, quiet: bool
) -> list[T]:
    """``[job(*task, sink) for task in tasks]``, on ``jobs`` processes; results in task order.

    ``sink`` is ``None`` when ``quiet``; else a :class:`LineSink`. With one job
    every run prints its own lines (there is no other process). With more, each
    worker puts its lines on a manager queue (a put returns once the line is
    queued, so a finished job's lines are all there), and the parent prints them
    while it waits for results, then the rest once every job is done.
    """
    if jobs == 1:
        sink = None if quiet else _Stderr()
        return [job(*task, sink) for task in tasks]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        if quiet:
            return list(pool.map(job, *zip(*tasks, strict=True), [None] * len(tasks)))
        with Manager() as manager:
            lines: queue.Queue[str] = manager.Queue()
            futures: list[Future[T]] = [pool.submit(job, *task, lines) for task in tasks]
            pending = set(futures)
            while pending:
                _drain(lines, timeout=0.0)
                _, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(lines, timeout=0.0)
            return [f.result() for f in futures]
