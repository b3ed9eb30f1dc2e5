"""The docs site: every printed output on every page is generated, and the site builds strictly.

Numbers on the pages are doctest output (``>>>`` examples) or command output
(``console`` blocks under an ``<!-- output: COMMAND -->`` marker, see
``docs_tools/outputs.py``), so a change in the code that changes a number
fails here until the page says the new number. The strict build fails on a
broken link, a missing nav page, or a bad API reference.
"""

from __future__ import annotations

import doctest
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import docs_tools.griffe_pycon
import docs_tools.outputs
from docs_tools.griffe_pycon import fence_doctests
from docs_tools.outputs import Block, find_blocks, render, run_command, stale, unmarked_blocks

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def test_there_are_pages() -> None:
    assert (DOCS / "index.md") in PAGES and len(PAGES) >= 9, PAGES


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_examples(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the page's ``>>>`` examples from the repository root (pages may read ``docs/assets``)."""
    monkeypatch.chdir(ROOT)
    result = doctest.testfile(
        str(page),
        module_relative=False,
        globs={},
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        raise_on_error=False,
        verbose=False,
    )
    assert result.failed == 0, f"{page.name}: {result.failed} of {result.attempted} examples failed"


OUTPUTS = [(page, block) for page in PAGES for block in find_blocks(page.read_text(), page.name)]


@pytest.mark.parametrize(("page", "block"), OUTPUTS, ids=[f"{p.name}:{b.line}" for p, b in OUTPUTS])
def test_command_output_is_current(page: Path, block: Block) -> None:
    """The console block is what its command prints today (``vary`` parts masked)."""
    diff = stale(block, render(block, run_command(block)))
    assert diff is None, (
        f"{page.name}:{block.line}: `{block.command}` prints otherwise; regenerate with "
        f"`python -m docs_tools.outputs --write docs/{page.name}`\n{diff}"
    )


def test_no_output_is_typed_in_by_hand() -> None:
    """Every console/text block is generated: a block a reader types goes in ``sh``."""
    unmarked = {p.name: unmarked_blocks(p.read_text()) for p in PAGES}
    assert not any(unmarked.values()), f"output blocks without a marker (page: lines): {unmarked}"
    assert len(OUTPUTS) >= 3, OUTPUTS


def test_output_mechanism(tmp_path: Path) -> None:
    assert doctest.testmod(docs_tools.outputs).failed == 0
    page = tmp_path / "p.md"
    text = (
        "<!-- output: python -c 'import time; print(time.time())'; vary [0-9.]+ -->\n"
        "```console\n$ python -c 'import time; print(time.time())'\n1.5\n```\n\n"
        "<!-- output: python -c 'print(1); raise SystemExit(3)'; exit 3 -->\n"
        "```console\n$ python -c 'print(1); raise SystemExit(3)'\n2\n```\n\n"
        "```text\nhand-typed\n```\n\n```markdown\n<!-- output: python -c 'x' -->\n```\n"
    )
    page.write_text(text)
    first, second = find_blocks(text)
    assert stale(first, render(first, run_command(first))) is None  # the time is masked
    assert "+1" in (stale(second, render(second, run_command(second))) or "")
    assert unmarked_blocks(text) == [13]
    diffs, missing = docs_tools.outputs.check_page(page, write=True)
    assert len(diffs) == 1 and len(missing) == 1
    assert "raise SystemExit(3)'\n1\n```" in page.read_text()
    assert docs_tools.outputs.check_page(page) == ([], missing)
    bad = find_blocks("<!-- output: python -c 'raise SystemExit(1)' -->\n```console\n```\n")
    with pytest.raises(RuntimeError, match="exited 1, expected 0"):
        run_command(bad[0])
    with pytest.raises(ValueError, match="starts with python or pytest"):
        run_command(find_blocks("<!-- output: rm -rf x -->\n```console\n```\n")[0])


def test_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: warnings (broken links, missing pages, bad refs) fail."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is not installed next to this Python (pip install -e '.[test]')"
    env = os.environ | {"PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-6000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "blocks" / "index.html").is_file()


def test_docstring_examples_are_fenced_for_the_site() -> None:
    assert doctest.testmod(docs_tools.griffe_pycon).failed == 0
    text = "Intro :func:`f`.\n\n    >>> f()\n    1\n    >>> g()\n\nAfter."
    assert fence_doctests(text).splitlines() == [
        "Intro `f`.",
        "",
        "    ```pycon",
        "    >>> f()",
        "    1",
        "    >>> g()",
        "    ```",
        "",
        "After.",
    ]
    assert fence_doctests(">>> 1\n1").endswith("1\n```")  # an example that ends the text


def test_every_dataclass_field_of_the_spec_says_what_it_holds() -> None:
    """A field's trailing comment is its documentation on the API pages (FieldComments)."""
    import griffe

    extensions = griffe.load_extensions(docs_tools.griffe_pycon.FieldComments)
    spec = griffe.load("spec", search_paths=[str(ROOT)], extensions=extensions)
    missing = [
        f"{module.name}.{cls.name}.{name}"
        for module in spec.modules.values()
        for cls in module.classes.values()
        if "dataclass" in cls.labels
        for name, attr in cls.attributes.items()
        if not name.startswith("_") and "property" not in attr.labels and attr.docstring is None
    ]
    assert not missing, f"dataclass fields without a trailing comment: {missing}"


def test_api_pages_show_fields_and_private_rules() -> None:
    """Dataclass fields get their trailing comments; a public function shows the private
    rules it calls, and the ones those call, with their source (private members are not
    rendered on their own)."""
    import griffe

    extensions = griffe.load_extensions(
        docs_tools.griffe_pycon.FieldComments, docs_tools.griffe_pycon.PrivateCalls
    )
    spec = griffe.load("spec", search_paths=[str(ROOT)], extensions=extensions)
    config = spec["scheduler.SchedulerConfig"]
    assert "host pool for swapping" in config["num_host_blocks"].docstring.value
    append = spec["block_manager.BlockManager.append_slots"].docstring.value
    assert "Private rules it calls (" in append and "`_needs_copy`" in append, append
    assert "def _needs_copy(" in append and "def _copy_on_write(" in append
    assert "def _release(" in append  # inherited from spec.block_table's BlockTables
    step = spec["scheduler.ContinuousScheduler.step"].docstring.value
    assert "def _admit(" in step and "def _preempt(" in step, step  # _preempt: called by a callee
    assert step.count("def _preempt(") == 1
    schedule = spec["scheduler.ContinuousScheduler._schedule_running"].docstring
    assert schedule is None or "Private rules" not in schedule.value  # a private one: not shown
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    assert 'filters: ["!^_"]' in mkdocs  # public members only
