"""The child process of an isolated scheduler run: load the scheduler, run the suite, report.

Started by :mod:`conformance.scheduler.isolation` as ``python -m
conformance.scheduler.worker``; it starts as the backend suite's child does
(:func:`conformance.run.worker.start`: its request, death with its parent,
stacks on a fatal signal or SIGUSR1, the pipe to the parent) and sends the
same messages (:mod:`conformance.run.protocol`), plus the workload each
example runs. Loading is two calls, so that each is timed as what it is: the
import (which may take the longer load timeout) and the factory's first call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conformance.errors import SetupError
from conformance.run.discovery import load_callable
from conformance.run.worker import Channel, finish, start
from conformance.scheduler.suite import SchedulerFactory, probe_scheduler, run_scheduler_suite
from conformance.watchdog import Call, RunWatch


def main() -> None:
    request, channel = start()
    _run(request, channel)
    finish()


def _run(request: dict[str, Any], channel: Channel) -> None:
    ref = request["scheduler"]
    watch = RunWatch(None, channel.send, isolated=True)
    try:
        factory = _load(ref, watch)
        result = run_scheduler_suite(
            factory,
            ref,
            profile=request["profile"],
            run_seed=request["seed"],
            database=None if request["database"] is None else Path(request["database"]),
            max_examples=request["max_examples"],
            shrink=request["shrink"],
            progress=lambda line: channel.send({"t": "progress", "line": line}),
            call_timeout_s=request["call_timeout_s"],
            time_budget_s=request["time_budget_s"],
            sink=channel.send,
        )
    except SetupError as err:
        channel.send({"t": "setup", "message": str(err)})
        return
    channel.send({"t": "result", "result": result})


def _load(ref: str, watch: RunWatch) -> SchedulerFactory:
    """Import the factory (one call), then build the probe scheduler with it (another)."""
    if ":" not in ref:
        raise SetupError(f"{ref!r} is not module:factory or path/to/file.py:factory")
    loading = Call("load_scheduler", 0, owner="scheduler")
    watch.begin(loading, [], [], False)
    try:
        attr, factory = load_callable(ref)
    finally:
        watch.end(loading)
    probing = Call("factory", 0, owner="scheduler")
    watch.begin(probing, [], [], False)
    try:
        return probe_scheduler(ref, attr, factory)
    finally:
        watch.end(probing)


if __name__ == "__main__":
    main()
