"""An isolated run: the backend in a child process, watched, so that nothing it does is silent.

``python -m conformance run`` runs the workload in a child process
(:mod:`conformance.run.worker`) and reads its messages (:mod:`conformance.run.protocol`):
the progress, and each backend call as it starts and ends, with the workload
lines logged before it. So the parent always holds the workload so far, the
call in flight and the coverage so far, and when the child

* **crashes** (a segfault, an abort, heap corruption, ``os._exit``, any exit
  before its result), the parent reports the signal or exit status, the step,
  the call in flight, what the child printed last (``faulthandler`` adds the
  Python stack), and the workload so far as a replay script;
* **hangs** (a call past the per-call timeout, or silence outside any call),
  the parent asks the child for its stack (SIGUSR1), then kills the child's
  whole process group (the child leads its own session, so nothing it
  started is left behind) and reports the call that hung.

Either way the result is a :class:`~conformance.run.runner.RunResult` like any
other, so every report is written. A Ctrl-C reaches only the parent (the
child is in its own session): it stops the child and returns a result marked
``interrupted``.

:class:`ChildProcess` is the part that knows nothing of backends: the
process, its pipes, the call in flight, hangs, crashes and Ctrl-C. The
scheduler suite runs its child with it too (:mod:`conformance.scheduler.isolation`).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from conformance.errors import SetupError
from conformance.judges.compare import Difference
from conformance.lockstep.run_stats import RunStats
from conformance.run.control import LOAD_TIMEOUT_S, RunControl
from conformance.run.database import REDIS_SCHEMES
from conformance.run.failures import PassFailure
from conformance.run.protocol import decode
from conformance.run.result import RunResult, headline_first
from conformance.run.worker import REQUEST_VAR
from conformance.watchdog import Call
from spec.capabilities import Capabilities

_POLL_S = 0.1
_BATCH_S = 0.01
ResultT = TypeVar("ResultT")
StatsT = TypeVar("StatsT")

_TAIL_LINES = 400
"""Lines of the child's output kept, to find the crash message and stack in."""
_SHOWN_BEFORE, _SHOWN_STACK = 5, 10
"""Lines shown before the stack (glibc's abort message, say) and of the stack, innermost first."""
_STACK_STARTS = ("Fatal Python error", "Current thread", "Thread 0x")
_QUIET_S = 60.0
"""The least silence outside any backend call taken for a hang (the suite's own work is fast)."""
_DUMP_WAIT_S = 1.0
"""How long a hung child gets to print its stack before it is killed."""


@dataclass(frozen=True)
class Request:
    """What the child should run: ``run_suite``'s arguments, as JSON-able values."""

    backend: str
    profile: str
    seed: int
    dtypes: list[str] | None
    database: str | None
    max_examples: int | None
    control: RunControl
    shard: str | None = None  # "K/N": one shard's share of the examples (conformance.run.shard)
    claims: str | None = None  # a folder: of those, run the examples claimed here first


def run_isolated(
    request: Request,
    progress: Callable[[str], None] | None = None,
    output: Callable[[str], None] | None = None,
) -> RunResult:
    """Run ``request`` in a child process; the result of the run, whatever the child does.

    ``progress`` gets the progress lines; ``output`` what the child prints
    (by default, this process's standard error). Raises
    :class:`~conformance.errors.SetupError` for a setup error in the child.
    """
    child = BackendChild(request, progress or (lambda _: None), output or to_stderr)
    child.run()
    return child.outcome()


@dataclass(frozen=True)
class Stop:
    """How a child's run ended without its result: a ``"hang"`` or a ``"crash"``, where, and how."""

    kind: str
    step: int
    detail: str
    layer: int | None = None


class ChildProcess(Generic[ResultT, StatsT]):
    """One child process (``python -m MODULE``) and what the parent knows of it so far.

    The child reads its request (``message``, JSON) from :data:`REQUEST_VAR`
    and writes :mod:`conformance.run.protocol` messages. :meth:`run` reads them
    until the child exits, hangs (it is then killed) or the user presses
    Ctrl-C; the messages that are not about calls go to :meth:`on_message`.
    ``party`` names whose code the child runs ("backend", "scheduler").
    """

    party = "backend"

    def __init__(
        self,
        module: str,
        message: dict[str, Any],
        call_timeout_s: float | None,
        progress: Callable[[str], None],
        output: Callable[[str], None],
        stats: StatsT,
        env: dict[str, str] | None = None,
    ) -> None:
        self.template: ResultT | None = None
        self.stats = stats
        self.result: ResultT | None = None
        self.setup_error: str | None = None
        self.call_timeout_s = call_timeout_s
        self.progress = progress
        self.output = output
        self.started = time.monotonic()
        self.workload: list[str] = []
        self.examples_started = 0  # workloads begun (the stats count only finished ones)
        self.in_flight: Call | None = None
        self.last_call: Call | None = None
        self.slowest: tuple[str, float] = ("", 0.0)
        self.last_event = 0.0  # 0: no message yet
        self.hang: Stop | None = None
        self.interrupted = False
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._partial = {"events": b"", "output": b""}
        self._spawn(module, message, env or {})

    def on_message(self, kind: str, event: dict[str, Any]) -> None:
        """A message other than ``call``, ``ret`` and ``progress``: the run's result before
        any example (``start``), its stats so far, its final result and a setup error are
        kept; anything else goes to :meth:`on_other`."""
        if kind == "start":
            self.template = event["result"]
        elif kind == "stats":
            self.stats = event["stats"]
        elif kind == "result":
            self.result = event["result"]
        elif kind == "setup":
            self.setup_error = event["message"]
        else:
            self.on_other(kind, event)

    def on_other(self, kind: str, event: dict[str, Any]) -> None:
        """A message only this kind of child sends (the subclass's to read)."""

    def _spawn(self, module: str, request: dict[str, Any], extra: dict[str, str]) -> None:
        events_r, events_w = os.pipe()
        output_r, output_w = os.pipe()
        message = {
            **request,
            "fd": events_w,
            "parent": os.getpid(),
            "path": sys.path,  # the child imports the code under test as this process would
        }
        env = {**os.environ, **extra, REQUEST_VAR: json.dumps(message)}
        env.update(LIBC_FATAL_STDERR_="1", PYTHONUNBUFFERED="1")  # glibc's abort text: stderr
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module],
                stdin=subprocess.DEVNULL,
                stdout=output_w,
                stderr=output_w,
                pass_fds=(events_w,),
                start_new_session=True,  # its own process group: a Ctrl-C reaches only us
                env=env,
            )
        finally:
            os.close(events_w)
            os.close(output_w)
        self.fds = {events_r: "events", output_r: "output"}

    # -- the loop -----------------------------------------------------------------

    def run(self) -> None:
        """Read the child's messages until it exits, hangs or the user stops the run."""
        run_together([self])

    def poll(self) -> bool:
        """Read what the child has written so far; whether it is done (exited, or hung and
        now being stopped)."""
        if self._exited():
            return True
        self._pump(0)
        overdue = self._overdue()
        if overdue is not None:
            self._stop_hung(overdue)
            return True
        return False

    def finish(self) -> None:
        """Kill what is left of the child's process group, read its last words, reap it."""
        self._kill_group()
        self._pump_until_closed()
        self.proc.wait()
        for fd in list(self.fds):
            os.close(fd)
        self.fds.clear()

    def _exited(self) -> bool:
        """Whether the child has exited (without reaping it: its group is still ours to kill)."""
        info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return info is not None and info.si_pid != 0

    def _pump(self, timeout: float) -> None:
        """Read what the child has written, waiting up to ``timeout`` seconds for it."""
        ready, _, _ = select.select(list(self.fds), [], [], timeout)
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if not data:
                os.close(fd)
                del self.fds[fd]
            elif self.fds[fd] == "events":
                self._lines("events", data, self._event)
            else:
                self.output(data.decode(errors="replace"))
                self._lines("output", data, self.tail.append)

    def _pump_until_closed(self, limit_s: float = 2.0) -> None:
        """Drain both pipes after the child is gone (a grandchild may hold them: stop then)."""
        deadline = time.monotonic() + limit_s
        while self.fds and time.monotonic() < deadline:
            self._pump(0.05)

    def _lines(self, name: str, data: bytes, each: Callable[[Any], None]) -> None:
        *lines, self._partial[name] = (self._partial[name] + data).split(b"\n")
        for line in lines:
            each(line if name == "events" else line.decode(errors="replace"))

    def _event(self, line: bytes) -> None:
        try:
            event = decode(line)
        except ValueError:  # a backend writing into our pipe: not a message
            return
        self.last_event = time.monotonic()
        kind = event["t"]
        if kind == "call":
            if event.get("new"):
                self.workload = []
                self.examples_started += 1
            self.workload += event["log"]
            owner = event.get("owner", "backend")
            self.in_flight = Call(event["what"], event["step"], event["layer"], owner=owner)
        elif kind == "ret" and self.in_flight is not None:
            seconds = time.monotonic() - self.in_flight.started
            if seconds > self.slowest[1] and not self.in_flight.loading:
                self.slowest = (self.in_flight.describe(), seconds)
            self.last_call, self.in_flight = self.in_flight, None
        elif kind == "progress":
            self.progress(event["line"])
        else:
            self.on_message(kind, event)

    # -- hangs ----------------------------------------------------------------------

    def _overdue(self) -> Stop | None:
        """The hang, once the call in flight (or the silence) has passed its limit."""
        limit = self.call_timeout_s
        if limit is None:
            return None
        now, call = time.monotonic(), self.in_flight
        if call is not None:
            allowed = max(limit, LOAD_TIMEOUT_S) if call.loading else limit
            if now - call.started > allowed:
                return Stop(
                    "hang",
                    call.step,
                    f"{call.describe()} did not return within {allowed:g} s (the per-call "
                    f"timeout; --call-timeout sets it): the {self.party} process was killed",
                    layer=call.layer,
                )
            return None
        quiet = max(2 * limit, _QUIET_S)
        since = self.last_event or self.started
        if now - since <= quiet:
            return None
        after = (
            "before its first message"
            if self.last_call is None
            else (f"after {self.last_call.describe()} returned")
        )
        party = self.party
        return Stop(
            "hang",
            0 if self.last_call is None else self.last_call.step,
            f"the {party} process went silent for {quiet:g} s outside any {party} call ({after}), "
            f"for example a thread of the {party} holding the interpreter: it was killed",
        )

    def _stop_hung(self, hang: Stop) -> None:
        """Ask the child for its stack, give it a moment to print it, then kill it."""
        self.hang = hang
        self.tail.clear()  # keep the stack, not what came before it
        self._signal(signal.SIGUSR1, group=False)
        deadline = time.monotonic() + _DUMP_WAIT_S
        while time.monotonic() < deadline and not self._exited():
            before = len(self.tail)
            self._pump(0.2)
            if self.tail and len(self.tail) == before:  # the stack came, then nothing more
                break

    def _signal(self, signum: int, group: bool) -> None:
        try:
            if group:
                os.killpg(self.proc.pid, signum)
            else:
                os.kill(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def _kill_group(self) -> None:
        """Kill the child and everything it started (one process group, led by the child)."""
        self._signal(signal.SIGKILL, group=True)

    # -- how it ended -----------------------------------------------------------------

    def stop(self) -> Stop:
        """The hang, or else the crash: how the child ended without its result."""
        return self.hang or self._crash()

    def diagnostics(self) -> tuple[str, ...]:
        """What the child printed last, for the report: the lines before its stack, and the top."""
        return _diagnostics([line for line in self.tail if line.strip()])

    def _crash(self) -> Stop:
        how = _how_it_ended(self.proc.returncode)
        party, call = self.party, self.in_flight
        if call is not None:
            return Stop(
                "crash",
                call.step,
                f"the {party} process {how} during {call.describe()}",
                call.layer,
            )
        last = self.last_call
        where = (
            f"before its first {party} call"
            if last is None
            else (f"outside any {party} call, after {last.describe()} returned,")
        )
        return Stop(
            "crash",
            0 if last is None else last.step,
            f"the {party} process {how} {where} before the run finished",
        )


def run_together(children: Sequence[ChildProcess[Any, Any]]) -> None:
    """Read every child's messages until each has exited or hung; a Ctrl-C stops them all.

    One loop waits on all the children's pipes at once, so that children run
    side by side (the shards of one run) are watched as closely as one.
    """
    live = list(children)
    try:
        while live:
            fds = [fd for child in live for fd in child.fds]
            select.select(fds, [], [], _POLL_S)
            time.sleep(_BATCH_S)  # let messages gather: one wake-up reads many
            for child in [c for c in live if c.poll()]:
                live.remove(child)
                child.finish()
    except KeyboardInterrupt:
        for child in live:
            child.interrupted = True
    finally:
        for child in live:
            child.finish()


class BackendChild(ChildProcess[RunResult, RunStats]):
    """The child of ``python -m conformance run``: :mod:`conformance.run.worker` on a backend."""

    def __init__(
        self,
        request: Request,
        progress: Callable[[str], None],
        output: Callable[[str], None],
        env: dict[str, str] | None = None,
    ) -> None:
        self.request = request
        self.found: tuple[Difference, list[str]] | None = None  # the first failure, unshrunk
        worker = "conformance.run.worker"
        timeout = request.control.call_timeout_s
        super().__init__(worker, asdict(request), timeout, progress, output, RunStats(), env)

    def on_other(self, kind: str, event: dict[str, Any]) -> None:
        """``found``: the first failure, sent before shrinking began (kept, in case the child
        dies while shrinking it)."""
        if kind == "found" and self.found is None:
            self.found = (event["difference"], list(event["workload"]))

    def outcome(self) -> RunResult:
        """The child's result, or one built from what it sent before it hung or crashed."""
        if self.result is not None and not self.interrupted:
            return self.result
        if self.setup_error is not None:
            raise SetupError(self.setup_error)
        result = self._so_far()
        if self.interrupted:
            result.interrupted = True
            return result
        stop = self.stop()
        result.difference = Difference(stop.kind, stop.step, stop.detail, layer=stop.layer)
        result.workload = self.workload
        result.shrink_note = (
            "not shrunk: each replay of a hang costs the whole timeout"
            if self.hang
            else "not shrunk: the backend process crashed"
        )
        result.diagnostics = self.diagnostics()
        result.stats.note_failure()
        name = result.passes[-1][0] if result.passes else "in flight"
        later = PassFailure(
            name,
            result.difference,
            tuple(result.workload),
            False,
            result.shrink_note,
            False,
            result.stats.examples,
        )
        if self.found is not None:  # it died shrinking a failure: that one first, as found
            difference, workload = self.found
            cause = stop.detail.split(" during ")[0].split(" before ")[0]
            note = f"not shrunk: {cause} while shrinking it (the next failure)"
            found = PassFailure(name, difference, tuple(workload), False, note, False, None)
            result.failures.append(found)
        if result.failures:  # earlier failures stay the headline; the crash or hang follows
            headline_first(result, later)
        return result

    def _so_far(self) -> RunResult:
        """The result the child would have sent, from what it sent so far."""
        r = self.request
        result = self.template or RunResult(
            r.backend, r.profile, r.seed, Capabilities("not loaded"), (), RunStats()
        )
        result.stats = self.stats
        self.stats.examples = max(self.stats.examples, self.examples_started)
        result.control = r.control
        result.isolated = True
        result.slowest_call = self.slowest
        result.wall_time_s = time.monotonic() - self.started
        return result


def _diagnostics(lines: list[str]) -> tuple[str, ...]:
    """What to show of the child's last output: the lines before its stack, the stack's top.

    >>> for line in _diagnostics(["free(): invalid pointer", "Fatal Python error: Aborted",
    ...                           "Current thread 0x1:", '  File "k.py", line 3']):
    ...     print(line)
    free(): invalid pointer
    Fatal Python error: Aborted
    Current thread 0x1:
      File "k.py", line 3
    """
    starts = [i for i, line in enumerate(lines) if line.startswith(_STACK_STARTS)]
    if not starts:
        return tuple(lines[-_SHOWN_STACK:])
    first = starts[0]
    shown = lines[max(0, first - _SHOWN_BEFORE) : first + _SHOWN_STACK]
    if len(lines) > first + _SHOWN_STACK:
        shown.append("  ... (the rest of the stack is in the output above)")
    return tuple(shown)


def _how_it_ended(returncode: int) -> str:
    """``was killed by signal SIGSEGV (Segmentation fault)`` or ``exited with status 3``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        text = signal.strsignal(-returncode) or ""
        return f"was killed by signal {name} ({text})" if text else f"was killed by {name}"
    return f"exited with status {returncode}"


def to_stderr(text: str) -> None:
    """Show what a child printed, as it comes."""
    sys.stderr.write(text)
    sys.stderr.flush()


def database_arg(database: Path | str | None) -> str | None:
    """The database as the child gets it: a folder made absolute (so the child's cwd cannot
    matter), or a Redis URL as it is."""
    if database is None:
        return None
    if isinstance(database, str) and database.startswith(REDIS_SCHEMES):
        return database
    return str(Path(database).resolve())
