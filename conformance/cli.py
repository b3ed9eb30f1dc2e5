"""``paged-spec`` (or ``python -m conformance``): run the suite on a backend or a scheduler,
list backends, self-test, export or check test vectors.

The console script ``paged-spec`` and ``python -m conformance`` are one program;
its usage and messages name it as it was started.

Exit status: 0 the backend conforms (or every planted bug was caught); 1 a
conformance failure; 2 a usage or setup error, with a message saying what to fix
(an unwritable report path among them, found before the run); 3 a partial run:
no failure, but the time budget cut it short (0 with ``--budget-passes``); 130
the user pressed Ctrl-C or sent SIGTERM. Every report path is checked and
marked incomplete before the run (:mod:`conformance.output_files`), and
written after it by the one rule for an output path (a file atomically, a
device or FIFO written through); a setup error leaves a SETUP ERROR report. A
bug on the spec's side (:class:`~conformance.errors.SpecSideBug`) exits 2
too, blamed on the spec or the suite, never the backend. ``run`` runs the backend in a child process
(:mod:`conformance.run.isolation`), so that a crash or a hang is reported like any
other failure; ``--in-process`` runs it here instead (for a debugger).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from conformance.errors import SetupError
from conformance.judges.oracle import memory_limit_from
from conformance.output_files import prepare, setup_errors_reported
from conformance.planted.selftest import selftest
from conformance.reports.report import text_report, write_json, write_junit
from conformance.run.control import (
    DEFAULT_CALL_TIMEOUT_S,
    POISON_MODES,
    RunControl,
    argument_type,
    at_least,
    bounds_mode,
    seconds,
    timeout_seconds,
)
from conformance.run.database import database_location
from conformance.run.discovery import installed_backends, load_backend
from conformance.run.isolation import Request, database_arg, run_isolated
from conformance.run.parallel import MAX_JOBS, run_parallel
from conformance.run.profiles import PROFILES
from conformance.run.result import RunResult
from conformance.run.runner import DATABASE_DIR, run_suite
from conformance.run.shard import parse_shard
from conformance.run.terminate import sigterm_as_sigint
from conformance.scheduler.isolation import SchedulerRequest, run_scheduler_isolated
from conformance.scheduler.suite import DATABASE_DIR as SCHEDULER_DATABASE_DIR
from conformance.scheduler.suite import PROFILES as SCHEDULER_PROFILES
from conformance.scheduler.suite import SchedulerRunResult, load_scheduler, run_scheduler_suite
from spec.kv_geometry import DTYPES

OK, FAILED, USAGE, PARTIAL, INTERRUPTED = 0, 1, 2, 3, 130
_T = TypeVar("_T")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run one command; its exit status. ``prog``: the program's name in usage and messages
    (by default, as it was started: ``paged-spec`` or ``python -m conformance``)."""
    prog = prog or program_name()
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.command == "run":
        _check_run_args(parser, args)
    try:
        with sigterm_as_sigint():
            return _command(args)
    except SetupError as err:
        print(f"{prog}: setup error: {err}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C or SIGTERM)", file=sys.stderr)
        return INTERRUPTED


def _check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (exit 2) the ``run`` options that cannot go together."""
    if args.shard is not None and args.seed is None:
        parser.error(
            "--shard K/N needs --seed, the same on every shard, so that the shards split one "
            "run's examples (in CI, say: --seed $GITHUB_RUN_ID)"
        )
    if args.jobs > MAX_JOBS:
        parser.error(f"--jobs: at most {MAX_JOBS} processes side by side, got {args.jobs}")
    if args.jobs > 1 and args.in_process:
        parser.error(
            "--jobs runs the backend in several child processes; --in-process runs it "
            "in this one: drop one of them"
        )


def program_name(argv0: str | None = None) -> str:
    """How the program was started: the console script's name, or ``python -m conformance``.

    >>> program_name("/venv/bin/paged-spec"), program_name("/src/conformance/__main__.py")
    ('paged-spec', 'python -m conformance')
    """
    name = Path(sys.argv[0] if argv0 is None else argv0).name
    if not name or name.endswith(".py") or name in ("-c", "-m"):
        return "python -m conformance"
    return name


def _command(args: argparse.Namespace) -> int:
    if args.command == "run":
        return _run(args)
    if args.command == "list":
        return _list()
    if args.command == "scheduler":
        return _scheduler(args)
    if args.command == "vectors":
        return _vectors(args)
    return OK if selftest() else FAILED


def _run(args: argparse.Namespace) -> int:
    control = _control(args)
    with _reports_prepared(args, "conformance run"):
        result = _lockstep(args, control)
    print(text_report(result))
    status = _status(result, args.budget_passes)
    return _write_reports(args, result, status, write_json, write_junit)


@contextmanager
def _reports_prepared(args: argparse.Namespace, command: str) -> Iterator[None]:
    """Before the run: every report path writable (or exit 2 now), marked incomplete, and its
    symbolic link resolved once (``args.report`` and ``args.junit`` become the targets); a
    setup error inside writes a SETUP ERROR report at each."""
    given = [(name, Path(p)) for name in ("report", "junit") if (p := getattr(args, name))]
    targets = prepare([path for _, path in given], command)
    for (name, _), target in zip(given, targets, strict=True):
        setattr(args, name, str(target))
    with setup_errors_reported(targets, command):
        yield


def _write_reports(
    args: argparse.Namespace,
    result: Any,
    status: int,
    json_writer: Callable[[Any, Path], None],
    junit_writer: Callable[[Any, Path], None],
) -> int:
    """Write the reports asked for; ``status``, or 2 for a pass whose report could not be written.

    The paths were checked before the run, so a failure here is rare (a full
    disk, a folder removed meanwhile): it is said on standard error, and a
    failure's or an interruption's status is kept (the placeholder left at the
    path says the run is incomplete).
    """
    for path, writer in ((args.report, json_writer), (args.junit, junit_writer)):
        if path:
            try:
                writer(result, Path(path))
            except (OSError, SetupError) as err:
                print(f"conformance: cannot write the report {path}: {err}", file=sys.stderr)
                status = USAGE if status in (OK, PARTIAL) else status
    return status


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
        poison=args.poison,
    )


def _lockstep(args: argparse.Namespace, control: RunControl) -> RunResult:
    """The run: in a child process, unless ``--in-process`` (or no POSIX process groups)."""
    dtypes = [d for item in args.dtype for d in item.split(",") if d] if args.dtype else None
    database = None if args.no_database else (args.database or DATABASE_DIR)
    shard = args.shard
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
            shard=shard,
        )
    request = Request(
        backend=args.backend,
        profile=args.profile,
        seed=random.randrange(2**32) if args.seed is None else args.seed,
        dtypes=dtypes,
        database=database_arg(database),
        max_examples=args.max_examples,
        control=control,
        shard=None if shard is None else shard.describe(),
    )
    if args.jobs > 1:
        return run_parallel(request, args.jobs, _progress)
    return run_isolated(request, _progress)


def _progress(line: str) -> None:
    print(f"  ... {line}", file=sys.stderr, flush=True)


def _status(result: RunResult | SchedulerRunResult, budget_passes: bool = False) -> int:
    """130 interrupted, 1 failed, 3 cut short by the time budget (0 if it counts), else 0."""
    if result.interrupted:
        return INTERRUPTED
    if not result.passed:
        return FAILED
    return PARTIAL if result.stopped and not budget_passes else OK


def _scheduler(args: argparse.Namespace) -> int:
    """The scheduler suite: invariants and token-exact equivalence (conformance.scheduler.suite).

    In a child process (:mod:`conformance.scheduler.isolation`), unless ``--in-process``.
    """
    from conformance.scheduler import report

    with _reports_prepared(args, "conformance scheduler"):
        result = _scheduler_result(args)
    print(report.text_report(result))
    status = _status(result, args.budget_passes)
    return _write_reports(args, result, status, report.write_json, report.write_junit)


def _scheduler_result(args: argparse.Namespace) -> SchedulerRunResult:
    """The scheduler suite's run: in a child process, unless ``--in-process``."""
    database = None if args.no_database else SCHEDULER_DATABASE_DIR
    timeout = args.call_timeout or None
    if args.in_process or os.name != "posix":
        return run_scheduler_suite(
            load_scheduler(args.scheduler),
            args.scheduler,
            profile=args.profile,
            run_seed=args.seed,
            database=database,
            max_examples=args.max_examples,
            shrink=not args.no_shrink,
            progress=_progress,
            call_timeout_s=timeout,
            time_budget_s=args.time_budget,
        )
    else:
        request = SchedulerRequest(
            scheduler=args.scheduler,
            profile=args.profile,
            seed=random.randrange(2**32) if args.seed is None else args.seed,
            database=database_arg(database),
            max_examples=args.max_examples,
            shrink=not args.no_shrink,
            call_timeout_s=timeout,
            time_budget_s=args.time_budget,
        )
    return run_scheduler_isolated(request, _progress)


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

    with _reports_prepared(args, "conformance vectors check"):
        result = check_vectors(load_backend(args.backend), args.backend, Path(args.dir))
    print(text_report(result))
    return _write_reports(args, result, _status(result), write_json, write_junit)


def _list() -> int:
    backends = installed_backends()
    for name, target in sorted(backends.items()):
        print(f"{name:12s} {target}")
    if not backends:
        print("no backends installed (is the package installed? pip install -e .)")
    return OK


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
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
        type=argument_type(at_least(1)),
        help="override the profile's example count (>= 1)",
    )
    run.add_argument(
        "--long-examples",
        type=argument_type(at_least(0)),
        metavar="N",
        help="long-context examples instead of the profile's (0: none)",
    )
    run.add_argument(
        "--time-budget",
        type=argument_type(seconds),
        metavar="SECONDS",
        help="stop drawing new examples after this long; the verdict then says PARTIAL, and "
        "the exit status is 3",
    )
    run.add_argument("--budget-passes", action="store_true", help=_BUDGET_PASSES)
    run.add_argument(
        "--no-shrink", action="store_true", help="report a failing workload as found (faster)"
    )
    run.add_argument(
        "--shrink-time",
        type=argument_type(seconds),
        metavar="SECONDS",
        help="stop minimising a failing workload after this long",
    )
    run.add_argument(
        "--call-timeout",
        type=argument_type(timeout_seconds),
        default=DEFAULT_CALL_TIMEOUT_S,
        metavar="SECONDS",
        help=f"a call taking longer is a hang (default {DEFAULT_CALL_TIMEOUT_S:g}; 0: no limit)",
    )
    run.add_argument(
        "--check-bounds",
        type=argument_type(bounds_mode),
        nargs="?",
        const="default",
        metavar="{default,strict}",
        help="check every memory access of the backend's Triton kernels under TRITON_INTERPRET "
        "(default: outside the launch's tensors; strict: block-table padding reads too); "
        "see docs/bounds-checking.md",
    )
    run.add_argument(
        "--poison",
        choices=POISON_MODES,
        default="nan",
        help="what the slots no live token owns hold: nan (NaN and infinities, the default: a "
        "kernel that reads one, even to multiply it by zero, fails), finite (large finite "
        "values: such reads are not judged for NaN, and the verdict says so), off",
    )
    run.add_argument(
        "--reference-memory",
        type=argument_type(memory_limit_from),
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
        type=argument_type(at_least(1)),
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
        "--shard",
        type=argument_type(parse_shard),
        metavar="K/N",
        help="run shard K of N: every N-th generated example (needs --seed, the same on every "
        "shard); examples saved in the database replay on every shard",
    )
    run.add_argument(
        "--jobs",
        type=argument_type(at_least(1)),
        default=1,
        metavar="N",
        help="run in N processes side by side, each example in the first to claim it (the "
        "same verdict as one process, in about 1/N of the time on N free cores); for a "
        "backend on a CPU, not N processes sharing one GPU",
    )
    saved = run.add_mutually_exclusive_group()
    saved.add_argument(
        "--database",
        type=argument_type(database_location),
        metavar="DIR|redis://HOST:PORT/DB",
        help=f"where failing examples are saved and replayed first (default {DATABASE_DIR}/); "
        "share it between machines so that a failure found on one replays on all",
    )
    saved.add_argument(
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
        type=argument_type(at_least(1)),
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


_BUDGET_PASSES = (
    "a run the time budget cut short, with no failure, exits 0 (its reports still say PARTIAL)"
)


def _bounding_options(cmd: argparse.ArgumentParser, party: str) -> None:
    """The scheduler suite's time budget, per-call timeout and isolation options (as run's)."""
    cmd.add_argument(
        "--time-budget",
        type=argument_type(seconds),
        metavar="SECONDS",
        help="stop drawing new workloads after this long; the verdict then says PARTIAL, and "
        "the exit status is 3",
    )
    cmd.add_argument("--budget-passes", action="store_true", help=_BUDGET_PASSES)
    cmd.add_argument(
        "--call-timeout",
        type=argument_type(timeout_seconds),
        default=DEFAULT_CALL_TIMEOUT_S,
        metavar="SECONDS",
        help=f"a {party} call taking longer is a hang (default {DEFAULT_CALL_TIMEOUT_S:g}; "
        "0: no limit)",
    )
    cmd.add_argument(
        "--in-process",
        action="store_true",
        help=f"run the {party} in this process (for a debugger): a crash or a native hang then "
        "takes the run down with it",
    )


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
        type=argument_type(at_least(1)),
        help="override the profile's example count (>= 1)",
    )
    cmd.add_argument("--report", metavar="FILE.json", help="write a JSON report")
    cmd.add_argument("--junit", metavar="FILE.xml", help="write a JUnit XML report")
    cmd.add_argument(
        "--no-shrink", action="store_true", help="report the first failing workload unshrunk"
    )
    _bounding_options(cmd, "scheduler")
    cmd.add_argument(
        "--no-database",
        action="store_true",
        help=f"do not save or replay failing examples ({SCHEDULER_DATABASE_DIR}/)",
    )
