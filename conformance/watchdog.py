"""The run around the backend calls: the call in flight, per-call timeouts, and Ctrl-C.

One :class:`RunWatch` per run (:func:`watching`). Every
:class:`~conformance.judges.guard.CallGuard` reports to it when a backend call starts
and ends, with the workload logged so far. What the watch does with that:

* **isolated** (the run is the child process of ``python -m conformance
  run``): it streams each event to the parent (a ``sink``), which owns the
  timeout and kills the child on a hang or reports its crash;
* **in process** (``run_suite`` as a library call, the pytest ways): a
  watchdog thread times the call in flight. Past the timeout it prints the call
  and every thread's traceback to standard error and interrupts the main
  thread, where a :class:`CallTimeout` ends the run with the hang reported. A
  call stuck in native code that never returns to Python cannot be
  interrupted from inside the process: the watchdog then says so on standard
  error and the process must be killed (the CLI's child process exists for
  this).

**A real Ctrl-C, told apart from a backend's own KeyboardInterrupt.** While a
run is watched from the main thread, SIGINT goes to a handler that records it
and then raises ``KeyboardInterrupt``. A ``KeyboardInterrupt`` out of a backend
call with no SIGINT recorded was raised by the backend itself, and is a
conformance failure. Off the main thread no handler can be installed, and every
``KeyboardInterrupt`` counts as the user's. In an isolated child every one is
the backend's: the child runs in its own session, so a terminal's Ctrl-C
reaches only the parent, which stops the child.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

Sink = Callable[[dict[str, Any]], None]
"""Where an isolated run's events go (one JSON-able dict each; :mod:`conformance.run.protocol`)."""

_POLL_S = 0.2
_RET = {"t": "ret"}


class CallTimeout(KeyboardInterrupt):
    """Raised in the main thread when the call in flight passed the per-call timeout.

    Not an ``Exception``, so that neither a backend's ``except Exception`` nor
    Hypothesis (which would replay it while shrinking, one timeout per replay)
    takes it for an ordinary failure; a ``KeyboardInterrupt``, because that is
    the one exception Hypothesis lets through untouched (any other cuts an
    example short and can surface as "inconsistent data generation").
    """


LOADING = {
    "load_backend": "loading the backend (its import and factory)",
    "load_scheduler": "loading the scheduler (its import)",
}
"""Calls that load the code under test (they may take the longer load timeout), as described."""


@dataclass
class Call:
    """One call into the code under test: which method of whose (``owner``), at which step of the
    workload, on which layer."""

    what: str
    step: int
    layer: int | None = None
    started: float = field(default_factory=time.monotonic)
    owner: str = "backend"

    @property
    def loading(self) -> bool:
        """Whether this call loads the code under test (its import, for a backend its factory)."""
        return self.what in LOADING

    def describe(self) -> str:
        """``backend.attention (layer 1) at step 3``, ``scheduler.step() at step 2``.

        >>> Call("factory", 0, owner="scheduler").describe()
        "the scheduler's factory (building one for a workload)"
        """
        if self.loading:
            return LOADING[self.what]
        if self.what == "factory":
            return f"the {self.owner}'s factory (building one for a workload)"
        layer = "" if self.layer is None else f" (layer {self.layer})"
        call = f"{self.what}()" if self.owner == "scheduler" else self.what
        return f"{self.owner}.{call}{layer} at step {self.step}"


class RunWatch:
    """What one run knows about its backend calls, for timeouts, interrupts and the parent."""

    def __init__(
        self, call_timeout_s: float | None, sink: Sink | None = None, isolated: bool = False
    ) -> None:
        self.call_timeout_s = call_timeout_s
        self.sink = sink
        self.isolated = isolated
        self.in_flight: Call | None = None
        self.timed_out: Call | None = None
        self.log: list[str] = []  # the workload of the lockstep making calls now
        self.slowest: tuple[str, float] = ("", 0.0)
        self.user_interrupted = False
        self.handles_sigint = False
        self._delivered = False  # the timeout has been raised once (by the handler or by end)
        self._main = threading.main_thread().ident
        self._stop = threading.Event()

    def begin(self, call: Call, log: list[str], new_lines: list[str], new: bool) -> None:
        """A call starts; ``new_lines`` of ``log`` were logged since the last call."""
        self.log = log
        self.in_flight = call
        if self.sink is not None:
            event = {"t": "call", "what": call.what, "step": call.step, "layer": call.layer}
            self.sink({**event, "log": new_lines, "new": new, "owner": call.owner})

    def end(self, call: Call) -> None:
        """The call returned or raised; a timed-out call raises :class:`CallTimeout` here."""
        self.in_flight = None
        seconds = time.monotonic() - call.started
        if seconds > self.slowest[1]:
            self.slowest = (call.describe(), seconds)
        if self.sink is not None:
            self.sink(_RET)
        if self.timed_out is call and not self._delivered:
            self._delivered = True
            raise CallTimeout(call.describe())

    def is_users(self) -> bool:
        """Whether a KeyboardInterrupt seen now came from the user rather than the backend."""
        if self.isolated:
            return False
        return self.user_interrupted or not self.handles_sigint

    def send(self, event: dict[str, Any]) -> None:
        if self.sink is not None:
            self.sink(event)

    # -- in process ---------------------------------------------------------------

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        call = self.timed_out
        if call is not None and not self.user_interrupted:
            if self._delivered:  # the watchdog's signal, after the timeout already ended the call
                return
            self._delivered = True
            raise CallTimeout(call.describe())
        self.user_interrupted = True
        raise KeyboardInterrupt

    def _watch_calls(self) -> None:
        """The watchdog thread: fire once per run, then warn if the call never returns."""
        timeout = self.call_timeout_s
        assert timeout is not None
        warned = False
        while not self._stop.wait(_POLL_S):
            call = self.in_flight
            if call is None:
                continue
            late = time.monotonic() - call.started - timeout
            if self.timed_out is None and late > 0:
                self._fire(call)
            elif self.timed_out is call and late > max(timeout, 10.0) and not warned:
                warned = True
                _say(
                    f"conformance: {call.describe()} is stuck and cannot be interrupted from "
                    "inside this process (native code holding the interpreter?); kill the "
                    "process. `python -m conformance run` runs the backend in a child process "
                    "and kills it on a hang."
                )

    def _fire(self, call: Call) -> None:
        self.timed_out = call
        _say(
            f"conformance: {call.describe()} has not returned after {self.call_timeout_s:g} s "
            "(the per-call timeout); stopping the run. Where every thread is:"
        )
        _dump_tracebacks()
        if self.handles_sigint and self._main is not None:
            signal.pthread_kill(self._main, signal.SIGINT)


@contextmanager
def watching(
    call_timeout_s: float | None, sink: Sink | None = None, isolated: bool = False
) -> Iterator[RunWatch]:
    """The watch of one run, made current for the guards created inside it."""
    watch = RunWatch(call_timeout_s, sink, isolated)
    token = _current.set(watch)
    previous = _install_sigint(watch)
    thread = None
    if call_timeout_s is not None and not isolated:
        thread = threading.Thread(target=watch._watch_calls, name="conformance-watchdog")
        thread.daemon = True
        thread.start()
    try:
        yield watch
    finally:
        watch._stop.set()
        if thread is not None:
            thread.join()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        _current.reset(token)


def current_watch() -> RunWatch | None:
    """The watch of the run in progress, if any (a replay script runs unwatched)."""
    return _current.get()


_current: ContextVar[RunWatch | None] = ContextVar("conformance_watch", default=None)


def _install_sigint(watch: RunWatch) -> Any:
    """Route SIGINT to the watch while it runs (main thread only); return the old handler."""
    if watch.isolated or threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN or previous is None:
        return None  # someone chose to ignore Ctrl-C (or a C handler we cannot restore)
    signal.signal(signal.SIGINT, watch._on_sigint)
    watch.handles_sigint = True
    return previous


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _dump_tracebacks() -> None:
    stream = sys.__stderr__
    try:
        if stream is not None:
            stream.flush()
            faulthandler.dump_traceback(file=stream, all_threads=True)
    except (OSError, ValueError, AttributeError):  # no file descriptor (an embedding host)
        pass
