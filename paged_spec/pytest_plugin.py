"""The pytest plugin of paged-spec (entry point ``pytest11``: ``paged_spec``).

Installed with the package, and inert unless ``--paged-backend`` is given:
it only declares its options, and imports nothing of the suite, so a test
session that does not ask for it pays nothing. With it, the session also runs
the conformance suite on that backend, next to the project's own tests
(:mod:`conformance.pytest_runs`)::

    pytest --paged-backend my_pkg.backend:make_backend
    pytest --paged-backend triton --paged-profile standard --paged-seed 7 --paged-check-bounds
    pytest --paged-backend torch --paged-seed 7 --paged-shard 2/4    # one job of a CI matrix
    pytest -n 4 --paged-backend torch --paged-shards 4               # four pytest-xdist workers

The options are those of ``paged-spec run``, prefixed with ``paged-``; the
``PAGED_SPEC_*`` variables still override them, as for every pytest way.
"""

from __future__ import annotations

import pytest

_OPTIONS: tuple[tuple[str, str, str], ...] = (
    (
        "backend",
        "REF",
        "run the conformance suite on this backend: an installed name, "
        "module:factory or path/to/file.py:factory",
    ),
    ("profile", "NAME", "quick (default), standard or thorough"),
    ("seed", "N", "the run's seed (every summary prints it)"),
    ("max-examples", "N", "examples instead of the profile's (>= 1)"),
    ("long-examples", "N", "long-context examples instead of the profile's (0: none)"),
    ("time-budget", "SECONDS", "stop drawing new examples after this long"),
    ("shrink-time", "SECONDS", "stop minimising a failing workload after this long"),
    ("call-timeout", "SECONDS", "a backend call taking longer is a hang (default 120; 0: none)"),
    (
        "poison",
        "{nan,finite,off}",
        "what slots no live token owns hold (default nan; finite: reads of them are not "
        "judged for NaN, and the verdict says so)",
    ),
    ("report", "FILE.json", "write the lockstep run's JSON report"),
    ("junit", "FILE.xml", "write the lockstep run's JUnit XML report"),
    ("shard", "K/N", "run shard K of N of the examples (a CI matrix job; needs --paged-seed)"),
    ("shards", "N", "one lockstep test per shard of N, for pytest-xdist workers to share"),
    (
        "database",
        "DIR|redis://HOST:PORT/DB",
        "where failing examples are saved and replayed first, shared between machines",
    ),
)
_FLAGS: tuple[tuple[str, str], ...] = (
    ("no-shrink", "report a failing workload as found, without minimising it"),
    ("no-database", "do not save or replay failing examples"),
    ("in-process", "run the backend in the pytest process (no child process)"),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("paged-spec", "paged-attention conformance (paged-spec)")
    for name, metavar, text in _OPTIONS:
        group.addoption(f"--paged-{name}", metavar=metavar, help=text)
    for name, text in _FLAGS:
        group.addoption(f"--paged-{name}", action="store_true", help=text)
    group.addoption("--paged-dtype", action="append", metavar="DTYPE", help="only these dtypes")
    group.addoption(
        "--paged-check-bounds",
        nargs="?",
        const="default",
        metavar="{default,strict}",
        help="check every memory access of the backend's interpreted Triton kernels",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Nothing, unless ``--paged-backend`` is given: then the suite joins the session."""
    ref = config.getoption("paged_backend")
    if not ref:
        return
    from conformance.pytest_runs import configure  # the suite, only when asked for

    configure(config, str(ref))
