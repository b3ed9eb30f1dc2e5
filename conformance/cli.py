"""``python -m conformance``: run the suite on a backend or a scheduler, list backends, self-test.

Exit status: 0 the backend conforms (or every planted bug was caught); 1 a
conformance failure; 2 a usage or setup error, with a message saying what to fix.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from conformance.discovery import installed_backends, load_backend
from conformance.plan import SetupError
from conformance.report import text_report, write_json, write_junit
from conformance.runner import DATABASE_DIR, PROFILES, run_suite
from conformance.scheduler_suite import DATABASE_DIR as SCHEDULER_DATABASE_DIR
from conformance.scheduler_suite import PROFILES as SCHEDULER_PROFILES
from conformance.scheduler_suite import load_scheduler, run_scheduler_suite
from conformance.selftest import selftest
from spec.backend import DTYPES

OK, FAILED, USAGE = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "list":
            return _list()
        if args.command == "scheduler":
            return _scheduler(args)
        return OK if selftest() else FAILED
    except SetupError as err:
        print(f"conformance: setup error: {err}", file=sys.stderr)
        return USAGE


def _run(args: argparse.Namespace) -> int:
    dtypes = [d for item in args.dtype for d in item.split(",") if d] if args.dtype else None
    backend = load_backend(args.backend)
    result = run_suite(
        backend,
        args.backend,
        profile=args.profile,
        run_seed=args.seed,
        dtypes=dtypes,
        database=None if args.no_database else DATABASE_DIR,
        max_examples=args.max_examples,
        progress=lambda line: print(f"  ... {line}", file=sys.stderr, flush=True),
    )
    print(text_report(result))
    for path, writer in ((args.report, write_json), (args.junit, write_junit)):
        if path:
            try:
                writer(result, Path(path))
            except OSError as err:
                raise SetupError(f"cannot write the report {path}: {err}") from err
    return OK if result.passed else FAILED


def _scheduler(args: argparse.Namespace) -> int:
    """The scheduler suite: invariants and token-exact equivalence (conformance.scheduler_suite)."""
    from conformance import scheduler_suite_report as report

    result = run_scheduler_suite(
        load_scheduler(args.scheduler),
        args.scheduler,
        profile=args.profile,
        run_seed=args.seed,
        database=None if args.no_database else SCHEDULER_DATABASE_DIR,
        max_examples=args.max_examples,
        shrink=not args.no_shrink,
        progress=lambda line: print(f"  ... {line}", file=sys.stderr, flush=True),
    )
    print(report.text_report(result))
    for path, writer in ((args.report, report.write_json), (args.junit, report.write_junit)):
        if path:
            try:
                writer(result, Path(path))
            except OSError as err:
                raise SetupError(f"cannot write the report {path}: {err}") from err
    return OK if result.passed else FAILED


def _list() -> int:
    backends = installed_backends()
    for name, target in sorted(backends.items()):
        print(f"{name:12s} {target}")
    if not backends:
        print("no backends installed (is the package installed? pip install -e .)")
    return OK


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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
        "--max-examples", type=_positive, help="override the profile's example count (>= 1)"
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
    return parser


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
        "--max-examples", type=_positive, help="override the profile's example count (>= 1)"
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
