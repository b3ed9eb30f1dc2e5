"""The simulator's progress lines: whole lines, printed by the parent, one final line per run."""

from __future__ import annotations

import re

import pytest

from paged_spec.sim.config import SimConfig
from paged_spec.sim.progress import progress_line
from paged_spec.sim.run import POLICIES
from paged_spec.simulate import simulate

LINE = re.compile(r" +(\S+) @ (\d+)/s: (\d+)/(\d+) done, t=\d+\.\d+s")
TINY = SimConfig(num_requests=12, rates=(25.0, 50.0), kv_pool_gib=0.5, member_seconds=0.2)


@pytest.mark.parametrize("jobs", [1, 2])
def test_every_progress_line_is_whole_and_reaches_the_parents_stderr(
    jobs: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each run's lines come through the parent's ``sys.stderr`` (a worker that printed
    them itself would write to its own copy, which capsys never sees), each line
    matches the format in full (no line holds part of another), and each run ends
    with a line of every request done."""
    simulate(TINY, jobs=jobs, quiet=False, progress_every=0.0)
    err = capsys.readouterr().err.splitlines()
    assert err, "no progress reached the parent's stderr"
    finals = set()
    for line in err:
        m = LINE.fullmatch(line)
        assert m, f"not one whole progress line: {line!r}"
        if m[3] == m[4] == "12":
            finals.add((m[1], float(m[2])))
    assert finals == {(p, r) for p in POLICIES for r in TINY.rates}


def test_quiet_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    simulate(TINY, jobs=2, quiet=True, progress_every=0.0)
    assert capsys.readouterr().err == ""


def test_the_line_format() -> None:
    assert LINE.fullmatch(progress_line("static-eager", 12.5, 3, 40, 0.04)) is None  # 12.5/s
    assert LINE.fullmatch(progress_line("static-eager", 12.0, 3, 40, 0.04))
