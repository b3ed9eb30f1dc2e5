"""``python -m conformance``: run the suite on a backend or a scheduler, list backends, self-test.

Exit status: 0 the backend conforms (or every planted bug was caught); 1 a
conformance failure; 2 a usage or setup error, with a message saying what to fix;
130 the user pressed Ctrl-C. ``run`` runs the backend in a child process
(:mod:`conformance.run.isolation`), so that a crash or a hang is reported like any
other failure; ``--in-process`` runs it here instead (for a debugger).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from conformance.errors import SetupError
from conformance.judges.oracle import memory_limit_from
from conformance.planted.selftest import selftest
from conformance.reports.report import text_report, write_json, write_junit
from conformance.run.control import (
    DEFAULT_CALL_TIMEOUT_S,
    RunControl,
    at_least,
    bounds_mode,
    seconds,
    timeout_seconds,
)
from conformance.run.discovery import installed_backends, load_backend
from conformance.run.isolation import Request, database_arg, run_isolated
from conformance.run.runner import DATABASE_DIR, PROFILES, RunResult, run_suite
from conformance.scheduler.suite import DATABASE_DIR as SCHEDULER_DATABASE_DIR
from conformance.scheduler.suite import PROFILES as SCHEDULER_PROFILES
from conformance.scheduler.suite import load_scheduler, run_scheduler_suite
from spec.backend import DTYPES

OK, FAILED, USAGE, INTERRUPTED = 0, 1, 2, 130
_T = TypeVar("_T")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "list":
            return _list()
        if args.command == "scheduler":
            return _scheduler(args)
        if args.command == "vectors":
            return _vectors(args)
        return OK if selftest() else FAILED
    except SetupError as err:
        print(f"conformance: setup error: {err}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print("conformance: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED


def _run(args: argparse.Namespace) -> int:
    result = _lockstep(args, _control(args))
    print(text_report(result))
    for path, writer in ((args.report, write_json), (args.junit, write_junit)):
        if path:
            try:
                writer(result, Path(path))
            except OSError as err:
                raise SetupError(f"cannot write the report {path}: {err}") from err
    return _status(result)


def _control(args: argparse.Namespace) -> RunControl:
    return RunControl(
        shrink=not args.no_shrink,
        shrink_time_s=args.shrink_time,
        long_examples=args.long_examples,
        time_budget_s=args.time_budget,
        call_timeout_s=args.call_timeout or None,
        check_bounds=args.check_bounds,
        reference_memory=args.reference_memory,
        envelope=args.envelope,
        envelope_scale=args.scale,
    )


def _lockstep(args: argparse.Namespace, control: RunControl) -> RunResult:
    """The run: in a child process, unless ``--in-process`` (or no POSIX process groups)."""
    dtypes = [d for item in args.dtype for d in item.split(",") if d] if args.dtype else None
    database = None if args.no_database else DATABASE_DIR
    if args.in_process or os.name != "posix":
        return run_suite(
            load_backend(args.backend),
            args.backend,
            profile=args.profile,
            run_seed=args.seed,
            dtypes=dtypes,
            database=database,
            max_examples=args.max_examples,
            progress=_progress,
            control=control,
        )
    request = Request(
        backend=args.backend,
        profile=args.profile,
        seed=random.randrange(2**32) if args.seed is None else args.seed,
        dtypes=dtypes,
        database=database_arg(database),
        max_examples=args.max_examples,
        control=control,
    )
    return run_isolated(request, _progress)


def _progress(line: str) -> None:
    print(f"  ... {line}", file=sys.stderr, flush=True)


def _status(result: RunResult) -> int:
    if result.interrupted:
        return INTERRUPTED
    return OK if result.passed else FAILED


def _scheduler(args: argparse.Namespace) -> int:
    """The scheduler suite: invariants and token-exact equivalence (conformance.scheduler.suite)."""
    from conformance.scheduler import report

    result = run_scheduler_suite(
        load_scheduler(args.scheduler),
        args.scheduler,
        profile=args.profile,
        run_seed=args.seed,
        database=None if args.no_database else SCHEDULER_DATABASE_DIR,
        max_examples=args.max_examples,
        shrink=not args.no_shrink,
        progress=_progress,
    )
    print(report.text_report(result))
    for path, writer in ((args.report, report.write_json), (args.junit, report.write_junit)):
        if path:
            try:
                writer(result, Path(path))
            except OSError as err:
                raise SetupError(f"cannot write the report {path}: {err}") from err
    return OK if result.passed else FAILED


def _vectors(args: argparse.Namespace) -> int:
    """Test vectors: export the suite's workloads, or check a backend against exported ones."""
    if args.action == "export":
        from conformance.vectors.export import export_vectors

        summary = export_vectors(
            Path(args.out), profile=args.profile, seed=args.seed, examples=args.examples
        )
        print(summary.describe())
        return OK
    from conformance.vectors.check import check_vectors

    result = check_vectors(load_backend(args.backend), args.backend, Path(args.dir))
    print(text_report(result))
    for path, writer in ((args.report, write_json), (args.junit, write_junit)):
        if path:
            try:
                writer(result, Path(path))
            except OSError as err:
                raise SetupError(f"cannot write the report {path}: {err}") from err
    return _status(result)


def _list() -> int:
    backends = installed_backends()
    for name, target in sorted(backends.items()):
        print(f"{name:12s} {target}")
    if not backends:
        print("no backends installed (is the package installed? pip install -e .)")
    return OK


def _argtype(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """``parse`` (a parser of :mod:`conformance.run.control`) with its message shown by argparse."""

    def checked(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return checked


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Check a paged-attention backend against the executable spec.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the lockstep suite against one backend")
    run.add_argument(
        "--backend",
        required=True,
        help="an installed name (see 'list'), module:factory, or path/to/file.py:factory",
    )
    run.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    run.add_argument("--seed", type=int, help="reproduce a run (every report prints its seed)")
    run.add_argument(
        "--dtype", action="append", help=f"limit to these dtypes ({', '.join(DTYPES)})"
    )
    run.add_argument(
        "--max-examples",
        type=_argtype(at_least(1)),
        help="override the profile's example count (>= 1)",
    )
    run.add_argument(
        "--long-examples",
        type=_argtype(at_least(0)),
        metavar="N",
        help="long-context examples instead of the profile's (0: none)",
    )
    run.add_argument(
        "--time-budget",
        type=_argtype(seconds),
        metavar="SECONDS",
        help="stop drawing new examples after this long; the verdict then says so",
    )
    run.add_argument(
        "--no-shrink", action="store_true", help="report a failing workload as found (faster)"
    )
    run.add_argument(
        "--shrink-time",
        type=_argtype(seconds),
        metavar="SECONDS",
        help="stop minimising a failing workload after this long",
    )
    run.add_argument(
        "--call-timeout",
        type=_argtype(timeout_seconds),
        default=DEFAULT_CALL_TIMEOUT_S,
        metavar="SECONDS",
        help=f"a call taking longer is a hang (default {DEFAULT_CALL_TIMEOUT_S:g}; 0: no limit)",
    )
    run.add_argument(
        "--check-bounds",
        type=_argtype(bounds_mode),
        nargs="?",
        const="default",
        metavar="{default,strict}",
        help="check every memory access of the backend's Triton kernels under TRITON_INTERPRET "
        "(default: outside the launch's tensors; strict: block-table padding reads too); "
        "see docs/bounds-checking.md",
    )
    run.add_argument(
        "--reference-memory",
        type=_argtype(memory_limit_from),
        metavar="BYTES",
        help="bytes the fast reference's temporaries may hold (suffix K, M or G; default 1G, "
        "or PAGED_SPEC_REFERENCE_MEMORY)",
    )
    run.add_argument(
        "--envelope",
        choices=("cpu", "device"),
        help="draw this workload envelope instead of the one capabilities.device picks",
    )
    run.add_argument(
        "--scale",
        type=_argtype(at_least(1)),
        default=1,
        metavar="N",
        help="divide the envelope's prompt lengths, chunks, pool and batch widths by N",
    )
    run.add_argument(
        "--in-process",
        action="store_true",
        help="run the backend in this process (for a debugger): a crash or a native hang then "
        "takes the run down with it",
    )
    run.add_argument("--report", metavar="FILE.json", help="write a JSON report")
    run.add_argument("--junit", metavar="FILE.xml", help="write a JUnit XML report")
    run.add_argument(
        "--no-database",
        action="store_true",
        help=f"do not save or replay failing examples ({DATABASE_DIR}/)",
    )
    sub.add_parser("list", help="list installed backends (entry points paged_spec.backends)")
    sub.add_parser("selftest", help="check that the suite catches a set of planted bugs")
    _scheduler_parser(sub)
    _vectors_parser(sub)
    return parser


def _vectors_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmd = sub.add_parser("vectors", help="export language-neutral test vectors, or check them")
    actions = cmd.add_subparsers(dest="action", required=True)
    export = actions.add_parser("export", help="write the suite's workloads as test vectors")
    export.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory")
    export.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    export.add_argument("--seed", type=int, help="the run to record (default: a random one)")
    export.add_argument(
        "--examples",
        type=_argtype(at_least(1)),
        metavar="N",
        help="override the profile's example count (>= 1), as run --max-examples",
    )
    check = actions.add_parser("check", help="replay exported vectors against one backend")
    check.add_argument("dir", metavar="DIR", help="a directory written by 'vectors export'")
    check.add_argument(
        "--backend",
        required=True,
        help="an installed name (see 'list'), module:factory, or path/to/file.py:factory",
    )
    check.add_argument("--report", metavar="FILE.json", help="write a JSON report")
    check.add_argument("--junit", metavar="FILE.xml", help="write a JUnit XML report")


def _scheduler_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmd = sub.add_parser("scheduler", help="run the scheduler suite against one scheduler")
    cmd.add_argument(
        "--scheduler",
        required=True,
        help="module:factory or path/to/file.py:factory; the factory takes a SchedulerConfig",
    )
    cmd.add_argument("--profile", choices=sorted(SCHEDULER_PROFILES), default="quick")
    cmd.add_argument("--seed", type=int, help="reproduce a run (every report prints its seed)")
    cmd.add_argument(
        "--max-examples",
        type=_argtype(at_least(1)),
        help="override the profile's example count (>= 1)",
    )
    cmd.add_argument("--report", metavar="FILE.json", help="write a JSON report")
    cmd.add_argument("--junit", metavar="FILE.xml", help="write a JUnit XML report")
    cmd.add_argument(
        "--no-shrink", action="store_true", help="report the first failing workload unshrunk"
    )
    cmd.add_argument(
        "--no-database",
        action="store_true",
        help=f"do not save or replay failing examples ({SCHEDULER_DATABASE_DIR}/)",
    )
