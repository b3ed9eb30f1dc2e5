"""Output files that cannot lie and cannot damage anything: checked before the run, marked
incomplete, written by one rule.

A report that CI reads must be this run's and complete, or say that it is
not. So, for every report path a command is given (``--report``, ``--junit``):

* **before the run**, :func:`prepare` checks that the path can be written
  (:func:`check_output`: its folder exists or can be made, a file can be
  created in it, the path is not a folder nor a kind refused below):
  otherwise a :class:`~conformance.errors.SetupError` (exit 2) before
  anything runs, not after the whole run;
* **still before the run**, it replaces whatever is at a regular file (a pass
  of an earlier run, say) with a placeholder that says the run is incomplete
  and did not pass. If the run is then killed (SIGKILL, a lost machine), what
  is left says so, never an older verdict;
* **after the run**, :func:`write_output` writes each report; a setup error
  met after the paths were prepared writes a report saying SETUP ERROR and
  why (:func:`setup_errors_reported`), never leaving the placeholder.

**What a path may be** (the one rule, :func:`output_kind`, for every file the
project writes: reports, exported vectors, the tools' outputs). A symbolic link
is resolved once and its target treated by the same rule:

* a **regular file or a missing path** is written atomically: to a temporary
  file in the same folder, flushed to disk and renamed over the path
  (``os.replace``): a reader sees the old file or the whole new one;
* a **character device or a FIFO** (``/dev/null``, ``/dev/stdout``, a named
  pipe) is *written through*: opened for writing as it is, never created,
  truncated, renamed over or replaced, so ``--report /dev/null`` discards the
  report and leaves ``/dev/null`` a device. It gets no placeholder (a stream
  keeps nothing to mark). A FIFO that no process reads is refused when written
  (the run would otherwise wait forever);
* a **folder, socket or block device** is refused (exit 2): a report written
  to a disk device would destroy what is on it.

>>> import tempfile, json
>>> folder = Path(tempfile.mkdtemp())
>>> _ = (folder / "r.json").write_text('{"passed": true}')
>>> _ = prepare([folder / "r.json"], "conformance run")
>>> json.loads((folder / "r.json").read_text())["verdict"][:10]
'INCOMPLETE'
>>> output_kind(Path("/dev/null"))
'stream'
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import stat
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path

from conformance.errors import SetupError

INCOMPLETE = (
    "INCOMPLETE: the run writing this report has not finished; if no run is in progress, it "
    "was killed before it could write its report. No verdict."
)
"""What a placeholder report says, in every format."""
SETUP_ERROR = "SETUP ERROR"
"""How a report of a run that could not start (or go on) begins its verdict."""
FILE, STREAM = "file", "stream"
"""The two kinds of path written (:func:`output_kind`): replaced atomically, or written through."""


def resolve_output(path: Path) -> Path:
    """``path`` with a symbolic link resolved once (to its final target); others unchanged."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def output_kind(path: Path) -> str:
    """:data:`FILE` (a regular file or nothing yet) or :data:`STREAM` (a character device or
    FIFO) for the resolved ``path``; :class:`SetupError` naming any other kind."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return FILE
    except OSError as err:
        raise SetupError(f"cannot write {path}: {err.strerror}") from err
    if stat.S_ISREG(mode):
        return FILE
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return STREAM
    if stat.S_ISDIR(mode):
        raise SetupError(f"cannot write {path}: it is a folder")
    what = "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else None
    raise SetupError(
        f"cannot write {path}: it is {what or 'not a regular file'}; the suite writes regular "
        "files, character devices (such as /dev/null) and FIFOs, and refuses the rest"
    )


def check_output(path: Path, label: str = "the report") -> Path:
    """The resolved ``path`` if a file can be written there; :class:`SetupError` if not, its
    message starting ``cannot write LABEL PATH``.

    A stream must be writable; a file's folder must exist or be makeable, and writable.
    """
    target = resolve_output(path)
    named = f"{label} {path}" if target == path else f"{label} {path} (a link to {target})"
    try:
        kind = output_kind(target)
    except SetupError as err:
        raise SetupError(str(err).replace(f"write {target}", f"write {named}", 1)) from None
    if kind == STREAM:
        if not os.access(target, os.W_OK):
            raise SetupError(f"cannot write {named}: permission denied")
        return target
    if target.exists() and not os.access(target, os.W_OK) and not os.access(target.parent, os.W_OK):
        raise SetupError(f"cannot write {named}: permission denied")
    folder = _nearest_existing(target.parent)
    if not folder.is_dir():
        raise SetupError(f"cannot write {named}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SetupError(f"cannot write {named}: {folder} is not writable")
    return target


def check_output_folder(folder: Path, option: str) -> Path:
    """The resolved ``folder`` if files can be written into it (it exists as a folder or can be
    made); :class:`SetupError` naming ``option`` if not."""
    target = resolve_output(folder)
    if target.exists() and not target.is_dir():
        raise SetupError(f"{option} {folder}: not a folder")
    nearest = _nearest_existing(target)
    if not nearest.is_dir():
        raise SetupError(f"{option} {folder}: {nearest} is not a folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise SetupError(f"{option} {folder}: {nearest} is not writable")
    return target


def write_output(path: Path, data: str | bytes, *, durable: bool = True) -> None:
    """Write ``data`` (text as UTF-8) at ``path`` by the rule of :func:`output_kind`.

    A file: through a temporary file in its folder (created if missing), flushed
    to disk (``durable``) and renamed over it; on any error the temporary file
    is removed, ``path`` keeps what it held and the error propagates. A stream:
    written through. Any other kind: :class:`SetupError`, nothing written.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if not isinstance(payload, bytes):
        raise TypeError(f"write_output writes str or bytes, got {type(data).__name__}")
    target = resolve_output(path)
    if output_kind(target) == STREAM:
        _write_through(target, payload)
    else:
        _replace_atomically(target, payload, durable)


def _replace_atomically(path: Path, payload: bytes, durable: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if output_kind(path) != FILE:  # became a stream since it was looked at: never replaced
            raise SetupError(f"cannot write {path}: it is no longer a regular file")
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _write_through(path: Path, payload: bytes) -> None:
    """Write into a character device or FIFO as it is: no create, truncate or rename.

    Opened without blocking, so a FIFO that nobody reads is an error (``ENXIO``)
    instead of a wait without end; then written in blocking mode.
    """
    flags = os.O_WRONLY | os.O_NOCTTY | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ENXIO:
            raise SetupError(f"cannot write {path}: a FIFO that no process is reading") from err
        raise
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def prepare(paths: Iterable[Path], command: str) -> list[Path]:
    """Check every report path is writable, and leave an incomplete-run placeholder at each
    file (a stream gets none); the resolved paths, to write the reports at.

    Raises :class:`~conformance.errors.SetupError` naming the first path that
    cannot be written (nothing is changed at the paths checked before it
    except their placeholders, which say no more than that no run finished).
    """
    chosen = [(path, check_output(path)) for path in paths]
    for path, target in chosen:
        if output_kind(target) == STREAM:
            continue
        try:
            write_output(target, placeholder(target, command))
        except OSError as err:
            raise SetupError(f"cannot write the report {path}: {err}") from err
    return [target for _, target in chosen]


@contextmanager
def setup_errors_reported(paths: Iterable[Path], command: str) -> Iterator[None]:
    """Inside: a :class:`SetupError` writes a SETUP ERROR report at each path, then propagates.

    Each report says why (the error's message) and that nothing was judged; a
    path that cannot be written is left as it was (the error still propagates).
    """
    try:
        yield
    except SetupError as err:
        for path in paths:  # a path that fails keeps what it had: the setup error is the news
            with suppress(OSError, SetupError):
                write_output(path, setup_error_report(path, command, str(err)))
        raise


def setup_error_report(path: Path, command: str, message: str) -> str:
    """The report of a run stopped by a setup error: JUnit XML for ``.xml``, JSON otherwise."""
    verdict = f"{SETUP_ERROR}: {message}"
    return _verdict_report(path, command, verdict, True, "ended", {"setup_error": message})


def placeholder(path: Path, command: str) -> str:
    """The incomplete-run report for ``path``: JUnit XML for ``.xml``, JSON otherwise."""
    return _verdict_report(path, command, INCOMPLETE, False, "started", {"pid": os.getpid()})


def _verdict_report(
    path: Path, command: str, verdict: str, complete: bool, when: str, extra: Mapping[str, object]
) -> str:
    """A report holding only a verdict, never a pass: one errored JUnit case, or a JSON object;
    ``when`` names the time it carries (``started``, ``ended``)."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if path.suffix.lower() == ".xml":
        suite = ET.Element("testsuite", name="conformance", tests="1", failures="0", errors="1")
        props = ET.SubElement(suite, "properties")
        fields = (("verdict", verdict), ("complete", str(complete).lower()), (when, now))
        for name, value in fields:
            ET.SubElement(props, "property", name=name, value=value)
        case = ET.SubElement(suite, "testcase", classname="conformance", name=command)
        ET.SubElement(case, "error", message=verdict)
        return ET.tostring(suite, encoding="unicode", xml_declaration=True)
    data = {
        "passed": False,
        "complete": complete,
        "verdict": verdict,
        "command": command,
        when: now,
        **extra,
    }
    return json.dumps(data, indent=2) + "\n"


def _nearest_existing(folder: Path) -> Path:
    """``folder``, or its nearest ancestor that exists (where a missing folder would be made)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def junit_suite(
    name: str, counts: Mapping[str, int], time_s: float, properties: Iterable[tuple[str, str]]
) -> ET.Element:
    """A JUnit ``testsuite`` element: its counts (``tests``, ``failures``, ``errors``,
    ``skipped``), its time, and a ``properties`` element of ``(name, value)`` pairs."""
    suite = ET.Element("testsuite", name=name)
    for key, count in counts.items():
        suite.set(key, str(count))
    suite.set("time", f"{time_s:.3f}")
    props = ET.SubElement(suite, "properties")
    for key, value in properties:
        ET.SubElement(props, "property", name=key, value=value)
    return suite
