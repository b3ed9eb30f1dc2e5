"""Report files that cannot lie: checked before the run, marked incomplete, replaced atomically.

A report that CI reads must be this run's and complete, or say that it is
not. So, for every report path a command is given (``--report``, ``--junit``):

* **before the run**, :func:`prepare` checks that the path can be written
  (its folder exists or can be made, a file can be created in it, the path is
  not a folder): otherwise a :class:`~conformance.errors.SetupError` (exit 2)
  before anything runs, not after the whole run;
* **still before the run**, it replaces whatever is there (a pass of an
  earlier run, say) with a placeholder that says the run is incomplete and
  did not pass. If the run is then killed (SIGKILL, a lost machine), what is
  left says so, never an older verdict;
* **after the run**, :func:`write_atomic` writes each report to a temporary
  file in the same folder, flushes it to disk and renames it over the path
  (``os.replace``, atomic on POSIX): a reader sees the placeholder or the
  whole new report, never half of one.

>>> import tempfile, json
>>> folder = Path(tempfile.mkdtemp())
>>> _ = (folder / "r.json").write_text('{"passed": true}')
>>> prepare([folder / "r.json"], "conformance run")
>>> json.loads((folder / "r.json").read_text())["verdict"][:10]
'INCOMPLETE'
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from pathlib import Path

from conformance.errors import SetupError

INCOMPLETE = (
    "INCOMPLETE: the run writing this report has not finished; if no run is in progress, it "
    "was killed before it could write its report. No verdict."
)
"""What a placeholder report says, in every format."""


def prepare(paths: Iterable[Path], command: str) -> None:
    """Check every report path is writable, and leave an incomplete-run placeholder at each.

    Raises :class:`~conformance.errors.SetupError` naming the first path that
    cannot be written (nothing is changed at the paths checked before it
    except their placeholders, which say no more than that no run finished).
    """
    chosen = list(paths)
    for path in chosen:
        _check_writable(path)
    for path in chosen:
        try:
            write_atomic(path, placeholder(path, command))
        except OSError as err:
            raise SetupError(f"cannot write the report {path}: {err}") from err


def placeholder(path: Path, command: str) -> str:
    """The incomplete-run report for ``path``: JUnit XML for ``.xml``, JSON otherwise."""
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if path.suffix.lower() == ".xml":
        suite = ET.Element("testsuite", name="conformance", tests="1", failures="0", errors="1")
        props = ET.SubElement(suite, "properties")
        for name, value in (("verdict", INCOMPLETE), ("complete", "false"), ("started", started)):
            ET.SubElement(props, "property", name=name, value=value)
        case = ET.SubElement(suite, "testcase", classname="conformance", name=command)
        ET.SubElement(case, "error", message=INCOMPLETE)
        return ET.tostring(suite, encoding="unicode", xml_declaration=True)
    data = {
        "passed": False,
        "complete": False,
        "verdict": INCOMPLETE,
        "command": command,
        "started": started,
        "pid": os.getpid(),
    }
    return json.dumps(data, indent=2) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder and a rename.

    The folder is created if missing. On any error the temporary file is
    removed and ``path`` keeps what it held; the error propagates.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _check_writable(path: Path) -> None:
    """:class:`SetupError` unless a report can be written at ``path``."""
    if path.is_dir():
        raise SetupError(f"cannot write the report {path}: it is a folder")
    if path.exists() and not os.access(path, os.W_OK) and not os.access(path.parent, os.W_OK):
        raise SetupError(f"cannot write the report {path}: permission denied")
    folder = _nearest_existing(path.parent)
    if not folder.is_dir():
        raise SetupError(f"cannot write the report {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SetupError(f"cannot write the report {path}: {folder} is not writable")


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
