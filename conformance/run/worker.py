"""The child process of an isolated run: load the backend, run the suite, report every event.

Started by :mod:`conformance.run.isolation` as ``python -m conformance.run.worker``,
with its request (what ``run_suite`` should do) in the environment variable
:data:`REQUEST_VAR`. It writes :mod:`conformance.run.protocol` messages to the
pipe the request names; its standard output and error go to the parent, which
shows them and keeps the last lines for a crash report. ``faulthandler``
prints the Python stack on a fatal signal, and on SIGUSR1 (the parent's
request before it kills a hung child). The child dies with its parent (Linux:
``PR_SET_PDEATHSIG``); processes the backend started are the parent's to kill.
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
from typing import Any

from conformance.errors import SetupError
from conformance.run.control import RunControl
from conformance.run.discovery import load_backend
from conformance.run.protocol import encode
from conformance.run.runner import run_suite

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
    request = json.loads(os.environ[REQUEST_VAR])
    _die_with_parent(request["parent"])
    sys.path[:0] = [p for p in request["path"] if p not in sys.path]
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    channel = Channel(request["fd"])
    channel.send({"t": "hello", "pid": os.getpid()})
    _run(request, channel)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: a backend's atexit crash is not the run's result


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
    try:
        result = run_suite(
            backend,
            ref,
            profile=request["profile"],
            run_seed=request["seed"],
            dtypes=request["dtypes"],
            database=None if request["database"] is None else Path(request["database"]),
            max_examples=request["max_examples"],
            progress=lambda line: channel.send({"t": "progress", "line": line}),
            control=control,
            sink=channel.send,
        )
    except SetupError as err:
        channel.send({"t": "setup", "message": str(err)})
        return
    channel.send({"t": "result", "result": result})


def _die_with_parent(parent: int) -> None:
    """Ask Linux to kill this process when the parent dies; exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: a write to a closed pipe still ends us
        pass
    if os.getppid() != parent:
        os._exit(3)


if __name__ == "__main__":
    main()
