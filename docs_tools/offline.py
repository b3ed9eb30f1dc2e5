"""Whether a built site fetches anything from another machine: every reference it holds, read.

``python -m docs_tools.offline SITE`` lists what :func:`outside_references` finds in a
built site (``site/`` by default) and exits 1 if it finds anything.

The README promises that the pages, the sandbox's Python included, need no network
beyond the server that serves them. A page fetches what its HTML names (``src``,
``href`` of anything but a link, ``srcset``, ``poster``, ``data``, inline styles and
scripts), what its CSS names (``url(...)``, ``@import``) and what its JavaScript asks
for. Every such reference must stay on the site or be inline (``data:``, ``blob:``).

Two kinds of outside address are allowed, each for a reason a reader can check:

* ``<a href="https://...">`` (and ``<area>``): a link the reader may follow, a new page
  on a click; loading the page fetches nothing from it. Its ``ping`` is a request,
  and is not allowed outside.
* in JavaScript, the addresses in :data:`NEVER_FETCHED`, each with why this site never
  fetches it (and ``tests/test_sandbox_page.py`` checks the why where the site decides
  it), and XML namespace names (:data:`NAMESPACES`), which are names, never fetched.
  Any other absolute address in a script's code (comments aside) is reported: it may be
  fetched, and nobody has said why it is not.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

# scheme://host or //host: another machine (data:, blob:, mailto: and paths are not)
_OUTSIDE = re.compile(r"(?i)\s*(?:[a-z][a-z0-9+.-]*:)?//")
_CSS_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_CSS_URL = re.compile(r"""(?i)url\(\s*(?:"([^"]*)"|'([^']*)'|([^)"'\s]*))\s*\)""")
_CSS_IMPORT = re.compile(r"""(?i)@import\s+(?:"([^"]*)"|'([^']*)')""")
# an address in code: scheme://host.tld or //host.tld, not inside a regular expression (\/\/)
_JS_URL = re.compile(
    r"""(?<![\w\\/])(?:[a-z][a-z0-9+.-]*:)?//[a-z0-9-]+(?:\.[a-z0-9-]+)+[^\s"'`)]*""", re.I
)
_JS_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_JS_LINE_COMMENT = re.compile(r"(?m)^[ \t]*//.*$")

NAMESPACES = (
    "http://www.w3.org/2000/svg",
    "http://www.w3.org/1999/xlink",
    "http://www.w3.org/1999/xhtml",
    "http://www.w3.org/1998/Math/MathML",
    "http://www.w3.org/XML/1998/namespace",
    "http://www.w3.org/2000/xmlns/",
)


@dataclass(frozen=True)
class Known:
    """An outside address in a script that this site never fetches, and why."""

    files: str  # the scripts it is in, a glob on the path inside the site
    url: str  # the address, or its start up to the first ${...}
    why: str


NEVER_FETCHED = (
    Known(
        "assets/javascripts/bundle.*.min.js",
        "https://unpkg.com/resize-observer-polyfill",
        "the theme loads it only in a browser without ResizeObserver (every browser has had "
        "it since 2020)",
    ),
    Known(
        "assets/javascripts/bundle.*.min.js",
        "https://unpkg.com/mermaid@",
        "the theme loads it only on a page with a Mermaid diagram; no page has one",
    ),
    Known(
        "assets/javascripts/bundle.*.min.js",
        "https://api.github.com/",
        "the theme asks it for a repository's stars only when mkdocs.yml sets repo_url; it "
        "sets none",
    ),
    Known(
        "assets/javascripts/workers/search.*.min.js",
        "https://bit.ly/",
        "a link in a warning message that the search prints for a query it cannot parse",
    ),
    Known(
        "assets/sandbox/pyodide/pyodide.mjs",
        "https://cdn.jsdelivr.net/pyodide/v",
        "Pyodide's package address when packageBaseUrl is not given; the sandbox's worker "
        "gives its own folder on this site",
    ),
)


@dataclass(frozen=True)
class Reference:
    """One outside address a file of the site names, and how."""

    path: str  # inside the site
    how: str  # what names it: '<link href>', 'url()', 'script', ...
    url: str

    def __str__(self) -> str:
        return f"{self.path}: {self.how} {self.url}"


def is_outside(url: str) -> bool:
    """Whether fetching ``url`` from a page of the site would go to another machine."""
    return _OUTSIDE.match(url) is not None


def outside_references(site: Path) -> list[Reference]:
    """Every outside address that a page, stylesheet or script of ``site`` may fetch."""
    found: list[Reference] = []
    for path in sorted(site.rglob("*")):
        rel = path.relative_to(site).as_posix()
        if path.suffix in (".html", ".svg"):
            found += _in_markup(rel, path.read_text(errors="replace"))
        elif path.suffix == ".css":
            found += _in_css(rel, path.read_text(errors="replace"), "")
        elif path.suffix in (".js", ".mjs"):
            found += [
                r for r in _in_script(rel, path.read_text(errors="replace"), "") if not _known(r)
            ]
    return found


def unused_known(site: Path) -> list[Known]:
    """The entries of :data:`NEVER_FETCHED` that no script of ``site`` holds any more."""
    seen = [
        ref
        for path in sorted(site.rglob("*"))
        if path.suffix in (".js", ".mjs")
        for ref in _in_script(
            path.relative_to(site).as_posix(), path.read_text(errors="replace"), ""
        )
    ]
    return [k for k in NEVER_FETCHED if not any(_matches(k, r) for r in seen)]


def _known(ref: Reference) -> bool:
    return ref.url.startswith(NAMESPACES) or any(_matches(k, ref) for k in NEVER_FETCHED)


def _matches(known: Known, ref: Reference) -> bool:
    return fnmatch.fnmatch(ref.path, known.files) and ref.url.startswith(known.url)


def _in_css(path: str, css: str, where: str) -> Iterator[Reference]:
    """``url(...)`` and ``@import`` targets of a stylesheet (``where``: an inline one's place)."""
    css = _CSS_COMMENT.sub("", css)
    for how, pattern in (("url()", _CSS_URL), ("@import", _CSS_IMPORT)):
        for m in pattern.finditer(css):
            url = next(g for g in m.groups() if g is not None)
            if is_outside(url):
                yield Reference(path, f"{where}{how}", url)


def _in_script(path: str, code: str, where: str) -> Iterator[Reference]:
    """Absolute addresses in a script's code; comments, which run nothing, aside."""
    code = _JS_LINE_COMMENT.sub("", _JS_BLOCK_COMMENT.sub("", code))
    for m in _JS_URL.finditer(code):
        yield Reference(path, f"{where}script", m.group(0))


# Attributes whose value the browser fetches when the page loads (href: but for links).
_FETCHED = ("src", "href", "srcset", "poster", "data", "background", "manifest", "ping",
            "xlink:href", "action", "formaction")  # fmt: skip
_LINKS = ("a", "area")  # their href is followed on a click, never fetched on load


class _Markup(HTMLParser):
    """Collects the outside references of one HTML or SVG file."""

    def __init__(self, path: str) -> None:
        super().__init__(convert_charrefs=True)
        self.path = path
        self.found: list[Reference] = []
        self._inside: str | None = None  # 'style' or 'script' while in an inline one

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "style":
                self.found += _in_css(self.path, value, f"<{tag} style> ")
            elif name in _FETCHED and not (name == "href" and tag in _LINKS):
                for url in _urls_of(name, value):
                    if is_outside(url):
                        self.found.append(Reference(self.path, f"<{tag} {name}>", url))
            elif name == "content" and ("http-equiv", "refresh") in attrs:
                url = value.partition("url=")[2]
                if is_outside(url):
                    self.found.append(Reference(self.path, "<meta refresh>", url))
        src = dict(attrs).get("src")
        self._inside = tag if tag in ("style", "script") and not src else None

    def handle_endtag(self, tag: str) -> None:
        self._inside = None

    def handle_data(self, data: str) -> None:
        if self._inside == "style":
            self.found += _in_css(self.path, data, "<style> ")
        elif self._inside == "script":
            self.found += [r for r in _in_script(self.path, data, "<script> ") if not _known(r)]


def _urls_of(attribute: str, value: str) -> list[str]:
    """The addresses in an attribute's value: a srcset lists several, each with its size."""
    if attribute == "srcset":
        return [part.split()[0] for part in value.split(",") if part.strip()]
    return [value]


def _in_markup(path: str, text: str) -> list[Reference]:
    parser = _Markup(path)
    parser.feed(text)
    parser.close()
    return parser.found


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m docs_tools.offline", description=__doc__.split("\n")[0]
    )
    p.add_argument("site", type=Path, nargs="?", default=Path("site"), help="a built site")
    args = p.parse_args(argv)
    found = outside_references(args.site)
    for ref in found:
        print(ref)
    for known in unused_known(args.site):
        print(f"NEVER_FETCHED names what no script holds any more: {known.url}")
    print(f"{len(found)} outside references in {args.site}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
