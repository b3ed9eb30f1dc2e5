"""The docs site: every ``>>>`` example on every page runs, and the site builds strictly.

Numbers on the pages are doctest output, so a change in the code that changes
a number fails here until the page says the new number. The strict build
fails on a broken link, a missing nav page, or a bad API reference.
"""

from __future__ import annotations

import doctest
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tools._griffe_pycon
from tools._griffe_pycon import fence_doctests

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
    assert doctest.testmod(tools._griffe_pycon).failed == 0
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
