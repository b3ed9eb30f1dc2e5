"""The child process of an isolated run: load the backend, run the suite, report every event.

Started by :mod:`conformance.run.isolation` as ``python -m conformance.run.worker``,
with its request (what ``run_suite`` should do) in the environment variable
:data:`REQUEST_VAR`. It writes :mod:`conformance.run.protocol` messages to the
pipe the request names; its standard output and error go to the parent, which
shows them and keeps the last lines for a crash report. ``faulthandler``
prints the Python stack on a fatal signal, and on SIGUSR1 (the parent's
request before it kills a hung child). The child dies with its parent (Linux:
``PR_SET_PDEATHSIG``); processes the backend started are the parent's to kill,
or, when the parent itself is killed outright, a guard's (:func:`_guard_the_group`).
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import sys
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

from conformance.errors import SetupError
from conformance.run.control import RunControl
from conformance.run.discovery import load_backend
from conformance.run.protocol import encode
from conformance.run.runner import run_suite
from conformance.run.shard import Claims, parse_shard

REQUEST_VAR = "PAGED_SPEC_WORKER"
_PR_SET_PDEATHSIG = 1


class Channel:
    """The pipe to the parent; a write that fails means the parent is gone: exit at once."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()

    def send(self, event: dict[str, Any]) -> None:
        data = memoryview(encode(event))
        with self._lock:
            try:
                while data:
                    data = data[os.write(self.fd, data) :]
            except OSError:
                os._exit(3)


def main() -> None:
    request, channel = start()
    _run(request, channel)
    finish()


def start() -> tuple[dict[str, Any], Channel]:
    """What every child does first: its request, death with its parent, stacks on a fatal signal
    or SIGUSR1, and the pipe to the parent (with a first ``hello``)."""
    request: dict[str, Any] = json.loads(os.environ[REQUEST_VAR])
    _die_with_parent(request["parent"])
    _guard_the_group()
    sys.path[:0] = [p for p in request["path"] if p not in sys.path]
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    channel = Channel(request["fd"])
    channel.send({"t": "hello", "pid": os.getpid()})
    return request, channel


def finish() -> NoReturn:
    """Exit 0 at once, skipping interpreter teardown: an atexit crash of the code under test is
    not the run's result (the parent already has it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(request: dict[str, Any], channel: Channel) -> None:
    ref = request["backend"]
    channel.send({"t": "call", "what": "load_backend", "step": 0, "layer": None, "log": []})
    try:
        backend = load_backend(ref)
    except SetupError as err:
        channel.send({"t": "setup", "message": str(err)})
        return
    channel.send({"t": "ret"})
    names = {f.name for f in fields(RunControl)}
    control = RunControl(**{k: v for k, v in request["control"].items() if k in names})
    shard = request.get("shard")
    try:
        result = run_suite(
            backend,
            ref,
            profile=request["profile"],
            run_seed=request["seed"],
            dtypes=request["dtypes"],
            database=request["database"],
            max_examples=request["max_examples"],
            progress=lambda line: channel.send({"t": "progress", "line": line}),
            control=control,
            sink=channel.send,
            shard=None if shard is None else parse_shard(shard),
            claims=None if request.get("claims") is None else Claims(Path(request["claims"])),
        )
    except SetupError as err:
        channel.send({"t": "setup", "message": str(err)})
        return
    channel.send({"t": "result", "result": result})


def _die_with_parent(parent: int) -> None:
    """Ask Linux to kill this process when the parent dies; exit now if it already has."""
    _on_parent_death(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(3)


def _on_parent_death(signum: int) -> None:
    """Ask Linux to send ``signum`` to this process when its parent dies (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):  # not Linux: a write to a closed pipe still ends us
        pass


def _guard_the_group() -> None:
    """Fork a guard that kills this child's whole process group when the child dies.

    The parent kills the group when the run ends, so whatever the backend
    started dies with it; but a parent killed outright (SIGKILL) kills
    nothing, and the child dies alone (``PR_SET_PDEATHSIG``). The guard, in
    the same group, is told of the child's death the same way and kills the
    group, helpers of a hung backend included. It holds none of the child's
    pipes, so the parent still sees them close.
    """
    child = os.getpid()
    if os.fork() != 0:
        return
    try:
        os.closerange(3, 1 << 16)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _on_parent_death(signal.SIGTERM)
        if os.getppid() != child:  # the child died before the request took hold
            os.killpg(0, signal.SIGKILL)
        while True:
            signal.pause()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
