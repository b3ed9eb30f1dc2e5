"""What ``pytest --paged-backend`` runs: the suite's tests, parametrized by backend and shard.

The plugin (:mod:`paged_spec.pytest_plugin`, entry point ``pytest11``) stays
inert and imports nothing of the suite until ``--paged-backend`` is given;
then :func:`configure` checks the options, adds :mod:`conformance.pytest_suite`
to the session's collection (the :class:`~conformance.testing.BackendConformance`
checks, the lockstep run in a child process) and registers :class:`Parametrize`,
which names the backend, and the shard, in each node id
(``...::test_lockstep_with_the_spec[my_pkg.backend:make_backend]``).
``--paged-shards N`` makes one lockstep test per shard, for pytest-xdist to
spread: every shard runs under one seed (``--paged-seed``, or one the
session draws and hands to every worker), so that together they run the
run's examples once.
"""

from __future__ import annotations

import importlib.util
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import pytest

from conformance.run.control import (
    DEFAULT_CALL_TIMEOUT_S,
    RunControl,
    at_least,
    bounds_mode,
    poison_mode,
    seconds,
    timeout_seconds,
)
from conformance.run.database import database_location
from conformance.run.profiles import PROFILES
from conformance.run.runner import DATABASE_DIR
from conformance.run.shard import Shard, parse_shard
from conformance.testing import BackendConformance

SUITE_MODULE = "conformance.pytest_suite"
_SEED_KEY = "paged_spec_seed"
"""The session's seed, as pytest-xdist hands it to each worker (``workerinput``)."""
_PLUGIN = "paged-spec-suite"
_T = TypeVar("_T")


@dataclass(frozen=True)
class PagedRun:
    """One backend's run of the suite: what ``--paged-*`` (or ``PAGED_SPEC_BACKEND``) asks for.

    ``source`` names where the backend came from, for messages. A field left
    ``None`` leaves the :class:`BackendConformance` default (and the
    environment's variables) in charge.
    """

    ref: str
    source: str = "--paged-backend"
    profile: str | None = None
    seed: int | None = None
    dtypes: tuple[str, ...] | None = None
    examples: int | None = None
    control: RunControl | None = None
    isolated: bool = True
    shard: Shard | None = None
    database: Path | str | None = DATABASE_DIR
    report: Path | None = None
    junit: Path | None = None

    @property
    def id(self) -> str:
        """The test's parameter id: the backend, and the shard when there is one.

        >>> PagedRun("torch", shard=Shard(2, 4)).id
        'torch-shard-2-of-4'
        """
        return (
            self.ref
            if self.shard is None
            else f"{self.ref}-shard-{self.shard.index}-of-{self.shard.count}"
        )

    def apply(self, test: BackendConformance) -> None:
        """Set the run's settings on ``test`` (one test's instance)."""
        test.backend_ref = self.ref
        test.conformance_isolated = self.isolated
        test.conformance_shard = self.shard
        test.conformance_database = self.database
        test.conformance_report = self.report
        test.conformance_junit = self.junit
        for name, value in (
            ("conformance_profile", self.profile),
            ("conformance_seed", self.seed),
            ("conformance_dtypes", self.dtypes),
            ("conformance_examples", self.examples),
            ("conformance_control", self.control),
        ):
            if value is not None:
                setattr(test, name, value)

    def sharded(self, shard: Shard, count: int) -> PagedRun:
        """This run as ``shard``; with several in one session, each report file its own."""
        if count == 1:
            return replace(self, shard=shard)
        suffix = f".shard-{shard.index}-of-{shard.count}"
        return replace(
            self,
            shard=shard,
            report=None if self.report is None else _suffixed(self.report, suffix),
            junit=None if self.junit is None else _suffixed(self.junit, suffix),
        )


def _suffixed(path: Path, suffix: str) -> Path:
    return path.with_name(path.stem + suffix + path.suffix)


def configure(config: pytest.Config, ref: str) -> None:
    """Check the ``--paged-*`` options (a bad one is a usage error naming it), add the suite."""
    runs = _runs(config, ref)
    path = _suite_path()
    if path not in config.args:
        config.args.append(path)
    config.pluginmanager.register(Parametrize(runs), _PLUGIN)


class Parametrize:
    """Registered with ``--paged-backend``: parametrizes the suite's tests by backend and shard."""

    def __init__(self, runs: list[PagedRun]) -> None:
        self.runs = runs

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "paged_run" not in metafunc.fixturenames:
            return
        lockstep = metafunc.function.__name__ == "test_lockstep_with_the_spec"
        runs = self.runs if lockstep else [replace(self.runs[0], shard=None)]
        metafunc.parametrize("paged_run", runs, indirect=True, ids=[r.id for r in runs])

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: object) -> None:
        """pytest-xdist, on the controller: every worker runs under the session's seed."""
        workerinput = getattr(node, "workerinput", None)
        if isinstance(workerinput, dict):
            workerinput[_SEED_KEY] = self.runs[0].seed


def _runs(config: pytest.Config, ref: str) -> list[PagedRun]:
    """The session's runs: one, or one per shard (``--paged-shards``); usage errors named."""
    opt = _Options(config)
    shard, shards = opt.get("shard", parse_shard), opt.get("shards", at_least(1))
    if shard is not None and shards is not None:
        raise pytest.UsageError("--paged-shard K/N and --paged-shards N: choose one")
    database = opt.get("database", database_location)
    if database is not None and config.getoption("paged_no_database"):
        raise pytest.UsageError("--paged-database and --paged-no-database: choose one")
    seed = _seed(config, opt.get("seed", at_least(0)))
    if shard is not None and seed is None:
        raise pytest.UsageError(
            "--paged-shard K/N needs --paged-seed, the same on every shard, so that the shards "
            "split one run's examples (in CI, say: --paged-seed $GITHUB_RUN_ID)"
        )
    if shards is not None and seed is None:
        seed = random.randrange(2**32)  # one for the session: every shard's test runs under it
    run = PagedRun(
        ref,
        profile=opt.get("profile", _profile),
        seed=seed,
        dtypes=_dtypes(config.getoption("paged_dtype")),
        examples=opt.get("max_examples", at_least(1)),
        control=_control(config, opt),
        isolated=not config.getoption("paged_in_process"),
        database=None if config.getoption("paged_no_database") else database or DATABASE_DIR,
        report=_path(config.getoption("paged_report")),
        junit=_path(config.getoption("paged_junit")),
    )
    if shard is not None:
        return [run.sharded(shard, 1)]
    if shards is not None:
        return [run.sharded(Shard(k, shards), shards) for k in range(1, shards + 1)]
    return [run]


class _Options:
    """The ``--paged-*`` options given as text, parsed on demand; a bad one is a usage error."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def get(self, name: str, parse: Callable[[str], _T]) -> _T | None:
        text = self.config.getoption(f"paged_{name}")
        if text is None:
            return None
        try:
            return parse(str(text))
        except ValueError as err:
            flag = "--paged-" + name.replace("_", "-")
            raise pytest.UsageError(f"{flag} {text}: {err}") from None


def _control(config: pytest.Config, opt: _Options) -> RunControl:
    timeout = opt.get("call_timeout", timeout_seconds)
    bounds = config.getoption("paged_check_bounds")
    return RunControl(
        shrink=not config.getoption("paged_no_shrink"),
        shrink_time_s=opt.get("shrink_time", seconds),
        long_examples=opt.get("long_examples", at_least(0)),
        time_budget_s=opt.get("time_budget", seconds),
        call_timeout_s=DEFAULT_CALL_TIMEOUT_S if timeout is None else timeout or None,
        check_bounds=None if bounds is None else opt.get("check_bounds", bounds_mode),
        poison=opt.get("poison", poison_mode) or "nan",
    )


def _profile(text: str) -> str:
    if text not in PROFILES:
        raise ValueError(f"not a profile: choose from {', '.join(PROFILES)}")
    return text


def _dtypes(items: list[str] | None) -> tuple[str, ...] | None:
    return tuple(d for item in items or [] for d in item.split(",") if d) or None


def _seed(config: pytest.Config, seed: int | None) -> int | None:
    """``--paged-seed``; on a pytest-xdist worker, the controller's seed for the session."""
    workerinput = getattr(config, "workerinput", None)
    if seed is None and isinstance(workerinput, dict) and workerinput.get(_SEED_KEY) is not None:
        return int(workerinput[_SEED_KEY])
    if seed is None and isinstance(workerinput, dict) and "testrunuid" in workerinput:
        return zlib.crc32(str(workerinput["testrunuid"]).encode())  # the same on every worker
    return seed


def _path(text: str | None) -> Path | None:
    return None if text is None else Path(text)


def _suite_path() -> str:
    spec = importlib.util.find_spec(SUITE_MODULE)
    if spec is None or spec.origin is None:  # pragma: no cover - the package is broken
        raise pytest.UsageError(f"--paged-backend: cannot find {SUITE_MODULE}")
    return spec.origin


__all__ = ["PagedRun"]
