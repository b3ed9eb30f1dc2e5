"""``pytest --paged-backend REF``: the plugin runs the suite in a project's own session, names the
backend (and shard) in node ids, refuses bad options, and is inert without the option."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conformance.pytest_runs import PagedRun, _runs, _seed
from conformance.run.shard import Shard

ROOT = Path(__file__).resolve().parent.parent
OWN_TESTS = """
import sys

def test_the_projects_own_test():
    assert True

def test_zz_the_suite_is_imported_only_when_asked_for(request):
    asked = request.config.getoption("paged_backend") is not None
    assert ("conformance" in sys.modules) == asked
"""


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest in a fresh project of its own, with the plugin loaded as its entry point loads it."""
    (tmp_path / "test_own.py").write_text(OWN_TESTS)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # the same whether or not the package is installed
        "TRITON_INTERPRET": "1",
    }
    for name in [k for k in env if k.startswith("PAGED_SPEC_")]:
        del env[name]
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "paged_spec.pytest_plugin",
        "-p",
        "no:cacheprovider",
    ]
    return subprocess.run(
        [*argv, "-rA", "-q", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_without_the_option_the_plugin_collects_and_imports_nothing(tmp_path: Path) -> None:
    done = _pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout and "TestBackendFromEnvironment" not in done.stdout


def test_the_suite_runs_in_the_session_with_the_backend_in_its_node_ids(tmp_path: Path) -> None:
    report = tmp_path / "out" / "r.json"
    done = _pytest(
        tmp_path,
        "--paged-backend",
        "reference",
        "--paged-seed",
        "3",
        "--paged-time-budget",
        "1",
        "--paged-no-database",
        "--paged-report",
        str(report),
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "PASSED ::TestBackendFromEnvironment::test_lockstep_with_the_spec[reference]" in out
    assert "test_satisfies_the_backend_protocol[reference]" in out
    assert "5 passed" in out, "the project's own tests and the suite's three"
    assert "conformance: backend 'reference' (profile quick, seed 3)" in out
    assert '"seed": 3' in report.read_text()


def test_shards_are_tests_of_their_own(tmp_path: Path) -> None:
    done = _pytest(tmp_path, "--paged-backend", "torch", "--paged-shards", "3", "--collect-only")
    assert done.returncode == 0, done.stdout + done.stderr
    for k in (1, 2, 3):
        assert f"test_lockstep_with_the_spec[torch-shard-{k}-of-3]" in done.stdout
    assert "test_satisfies_the_backend_protocol[torch]" in done.stdout


def test_a_bad_option_fails_the_session_as_a_usage_error(tmp_path: Path) -> None:
    done = _pytest(tmp_path, "--paged-backend", "reference", "--paged-shard", "5/4", "--co")
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--paged-shard 5/4: '5/4': the shard K/N needs 1 <= K <= N" in done.stderr


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"shard": "2/4"}, "--paged-shard K/N needs --paged-seed"),
        ({"seed": "-1"}, "--paged-seed -1: must be at least 0"),
        ({"shard": "1-4", "seed": "1"}, "'1-4' is not a shard: expected K/N"),
        ({"profile": "fast"}, "--paged-profile fast: not a profile"),
        ({"max_examples": "0"}, "--paged-max-examples 0: must be at least 1"),
        ({"time_budget": "-3"}, "--paged-time-budget -3: must be a positive number"),
        ({"check_bounds": "loose"}, "'loose' is not a bounds-check mode"),
        ({"database": "s3://b"}, "not a directory nor a Redis URL"),
        ({"database": "db", "no_database": True}, "--paged-no-database: choose one"),
        ({"shards": "2", "shard": "1/2"}, "--paged-shards N: choose one"),
    ],
)
def test_bad_options_are_usage_errors_naming_the_problem(
    options: dict[str, object], problem: str
) -> None:
    given = {f"paged_{name}": value for name, value in options.items()}
    config = SimpleNamespace(getoption=given.get)
    with pytest.raises(pytest.UsageError, match=re.escape(problem)):
        _runs(config, "reference")  # type: ignore[arg-type]


def test_options_become_the_run() -> None:
    given = {
        "paged_profile": "standard",
        "paged_seed": "9",
        "paged_dtype": ["float16,float32"],
        "paged_call_timeout": "0",
        "paged_check_bounds": "strict",
        "paged_shards": "2",
        "paged_no_database": True,
    }
    runs = _runs(SimpleNamespace(getoption=given.get), "triton")  # type: ignore[arg-type]
    assert [r.shard for r in runs] == [Shard(1, 2), Shard(2, 2)]
    run = runs[0]
    assert (run.profile, run.seed, run.dtypes, run.database) == (
        "standard",
        9,
        ("float16", "float32"),
        None,
    )
    assert run.control is not None and run.control.call_timeout_s is None
    assert run.control.check_bounds == "strict" and run.isolated


def test_xdist_workers_share_the_controllers_seed() -> None:
    def config(workerinput: dict[str, Any] | None) -> Any:
        return SimpleNamespace(workerinput=workerinput) if workerinput is not None else object()

    assert _seed(config({"paged_spec_seed": 41, "testrunuid": "abc"}), None) == 41
    assert _seed(config({"testrunuid": "abc"}), None) == _seed(config({"testrunuid": "abc"}), None)
    assert _seed(config(None), None) is None and _seed(config(None), 5) == 5


def test_several_shards_in_one_session_write_a_report_each() -> None:
    run = PagedRun("torch", report=Path("out/r.json"), junit=Path("out/r.xml"))
    two = run.sharded(Shard(2, 3), 3)
    assert two.report == Path("out/r.shard-2-of-3.json") and two.id == "torch-shard-2-of-3"
    assert run.sharded(Shard(2, 3), 1).report == Path("out/r.json"), "one shard per job: as asked"
