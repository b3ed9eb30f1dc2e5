"""The docs' pictures are drawn from the spec's state, and the committed files are current.

If a test here fails after a change to the spec or the renderer, regenerate the
pictures with ``python -m docs_tools.diagrams`` and look at them before committing.
"""

from __future__ import annotations

import doctest
import xml.etree.ElementTree as ET
from functools import partial
from pathlib import Path

import pytest

import docs_tools.diagrams
import paged_spec.sandbox
import paged_spec.svg
from docs_tools.diagrams import DIAGRAMS, OUT, run_loop
from paged_spec.sandbox import describe, story
from spec.scheduler import ContinuousScheduler, StaticScheduler


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_committed_picture_is_what_the_code_draws(name: str) -> None:
    fresh = DIAGRAMS[name]()
    ET.fromstring(fresh)  # well-formed SVG
    path = OUT / f"{name}.svg"
    assert path.is_file(), f"{path} is missing: run `python -m docs_tools.diagrams`"
    assert path.read_text() == fresh, f"{path.name} is stale: run `python -m docs_tools.diagrams`"


def test_no_stray_pictures() -> None:
    assert sorted(p.stem for p in OUT.glob("*.svg")) == sorted(DIAGRAMS)


@pytest.mark.parametrize("module", [paged_spec.svg, docs_tools.diagrams, paged_spec.sandbox])
def test_doctests(module: object) -> None:
    result = doctest.testmod(module)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0, result


def test_sandbox_follows_the_seed() -> None:
    """Block size 4: 10 tokens take 3 blocks; a fork shares them; a write copies the last."""
    grow, fork, write, free = story()
    [seq] = grow.state.sequences
    assert len(seq.table) == 3 and grow.state.ref_counts[:3] == (1, 1, 1)
    assert [s.table for s in fork.state.sequences] == [seq.table, seq.table]
    assert fork.state.ref_counts[:3] == (2, 2, 2) and fork.state.copies == ()
    ((src, dst),) = write.state.copies
    seq0, seq1 = write.state.sequences
    assert src == seq0.table[-1] and dst == seq1.table[-1] and seq0.table[:2] == seq1.table[:2]
    assert write.state.contents(src)[-1] == 77 and write.state.contents(dst)[-1] == 42
    assert free.state.ref_counts[src] == 0 and free.state.ref_counts[seq0.table[0]] == 1
    assert "3 of 8 blocks free" not in "\n".join(describe(grow.state))


def test_sandbox_with_a_full_last_block_copies_nothing() -> None:
    write = story(block_size=4, tokens=8)[2]
    assert write.state.copies == () and "nothing is copied" in write.lines[1]


def test_sandbox_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        paged_spec.sandbox.main(["--block-size", "16", "--tokens", "20", "--out", str(tmp_path)])
        == 0
    )
    out = capsys.readouterr().out
    assert "block table [0, 1]" in out and "copies handed to the backend" in out, out
    assert len(list(tmp_path.glob("sandbox-*.svg"))) == 4


def test_scattered_table_is_the_seeds_7_3_19() -> None:
    assert (
        "table[5 // 4] = 3 -&gt; slot 3 * 4 + 1 = 13" in docs_tools.diagrams.block_table_scattered()
    )


def test_scheduler_loop_admits_runs_and_finishes() -> None:
    steps = run_loop(ContinuousScheduler)
    admitted = [r for s in steps for r in s.admitted]
    finished = [r for s in steps for r in s.finished]
    n = len(docs_tools.diagrams.LOOP_REQUESTS)
    assert sorted(admitted) == sorted(finished) == list(range(n))
    assert any(len(s.admitted) and len(s.finished) for s in steps)  # a seat refilled at once
    assert steps[-1].used_blocks > 0 and len(steps) < len(run_loop(StaticScheduler))


def test_static_loop_waits_to_fill_then_times_out() -> None:
    """What docs/scheduler.md says of the picture: step 0 idles (two of three seats); r2 fills
    the batch; r3, arriving meanwhile, waits for the whole batch, then starts with r4 on its
    timeout."""
    k = docs_tools.diagrams.STATIC_WAIT_STEPS
    steps = run_loop(partial(StaticScheduler, max_wait_steps=k))
    assert k == 3 and all(cell[0] == "wait" for cell in steps[0].cells.values())
    assert [s.admitted for s in steps[:3]] == [(), (0, 1), (2,)]
    start = next(i for i, s in enumerate(steps) if s.admitted == (3, 4))
    last_of_first = max(i for i, s in enumerate(steps) if set(s.finished) & {0, 1, 2})
    assert start == last_of_first + 1 and start - docs_tools.diagrams.LOOP_REQUESTS[3][0] > k
