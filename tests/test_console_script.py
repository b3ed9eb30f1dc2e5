"""``paged-spec`` (the console script) and ``python -m conformance`` are one program; its usage
and messages name it as it was started."""

from __future__ import annotations

import sys

import pytest

from conformance.cli import main, program_name


@pytest.mark.parametrize("command", ["run", "selftest", "scheduler", "vectors", "list"])
@pytest.mark.parametrize(
    ("argv0", "prog"),
    [
        ("/venv/bin/paged-spec", "paged-spec"),
        ("/src/conformance/__main__.py", "python -m conformance"),
    ],
)
def test_every_command_names_the_program_as_started(
    command: str,
    argv0: str,
    prog: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {prog} {command} [-h]")


def test_setup_errors_name_the_program(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--backend", "no_such_module:make"], prog="paged-spec") == 2
    assert capsys.readouterr().err.startswith("paged-spec: setup error:")


def test_the_name_is_taken_from_how_python_started_it() -> None:
    assert program_name("paged-spec") == "paged-spec"
    assert program_name("-c") == program_name("") == "python -m conformance"
