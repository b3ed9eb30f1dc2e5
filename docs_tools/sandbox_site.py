"""The sandbox page's runtime, written into the built site: Python for the browser, and the spec.

A mkdocs hook (``hooks:`` in mkdocs.yml): after every build it writes into the
site's ``assets/sandbox/``

* ``pyodide/``: the Pyodide runtime (CPython compiled to WebAssembly, with its
  standard library) from the npm package pinned in
  ``docs_tools/pyodide/package-lock.json``, installed there by ``npm ci`` when
  it is missing or another version;
* ``spec.zip``: the ``spec`` package and the tools the page's cells use, as
  Python source (numpy is not in the page: what the cells use imports without it).

Both are build outputs, never committed; the page needs no network once the
site is served. ``python -m docs_tools.sandbox_site`` installs the runtime and
prints what it adds to a site. This file is loaded by mkdocs by its path, so it
uses the standard library only.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import zipfile
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NPM_DIR = ROOT / "docs_tools" / "pyodide"  # package.json, package-lock.json, node_modules/
RUNTIME = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip")
LOCKFILE = "pyodide-lock.json"  # Pyodide's index of its own packages (none is loaded)
TOOLS = ("__init__.py", "_cli.py", "cells.py", "sandbox.py", "svg.py")  # of paged_spec
OUT = Path("assets") / "sandbox"  # in the site, beside the page's own sandbox.js


def pinned_version() -> str:
    """The Pyodide version package-lock.json pins."""
    lock = json.loads((NPM_DIR / "package-lock.json").read_text())
    version: str = lock["packages"]["node_modules/pyodide"]["version"]
    return version


def _installed_version() -> str | None:
    package = NPM_DIR / "node_modules" / "pyodide" / "package.json"
    if not package.is_file():
        return None
    version: str = json.loads(package.read_text())["version"]
    return version


def install_runtime() -> Path:
    """The pinned Pyodide package's folder, installed first with ``npm ci`` if needed.

    Concurrent builds (two test workers) take turns: the lock is held on
    package-lock.json while one checks and installs.
    """
    with open(NPM_DIR / "package-lock.json", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed_version() != pinned_version():
            npm = shutil.which("npm")
            if npm is None:
                raise RuntimeError(
                    "the sandbox page needs Pyodide from the npm registry, and npm is not "
                    "installed (Debian: apt-get install npm)"
                )
            subprocess.run(
                [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                cwd=NPM_DIR,
                check=True,
            )
        found = _installed_version()
        if found != pinned_version():
            raise RuntimeError(f"npm ci left Pyodide {found}, not {pinned_version()}")
    return NPM_DIR / "node_modules" / "pyodide"


def bundle() -> bytes:
    """``spec`` and the cells' tools as a zip of Python source, the same bytes for the same files.

    ``spec`` goes whole (a reader may import any of it; the numpy modules then
    say that numpy is missing); of ``paged_spec`` only what the cells use.
    """
    files = sorted((ROOT / "spec").glob("*.py")) + [ROOT / "paged_spec" / n for n in TOOLS]
    out = BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path in files:
            info = zipfile.ZipInfo(path.relative_to(ROOT).as_posix(), (1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, path.read_bytes())
    return out.getvalue()


def write_runtime(site: Path) -> None:
    """Write Pyodide and the spec's bundle into ``site``."""
    package = install_runtime()
    target = site / OUT / "pyodide"
    target.mkdir(parents=True, exist_ok=True)
    for name in (*RUNTIME, LOCKFILE):
        shutil.copyfile(package / name, target / name)
    (site / OUT / "spec.zip").write_bytes(bundle())


def on_post_build(config: Any) -> None:
    """The mkdocs hook: after the pages are written, the runtime goes beside them."""
    write_runtime(Path(config["site_dir"]))


def main() -> int:
    package = install_runtime()
    sizes = {name: (package / name).stat().st_size for name in (*RUNTIME, LOCKFILE)}
    spec = len(bundle())
    print(f"Pyodide {pinned_version()} in {package}")
    for name, size in sizes.items():
        print(f"  {name:20} {size / 2**20:6.2f} MiB")
    print(f"  {'spec.zip':20} {spec / 2**20:6.2f} MiB")
    print(f"added to the site: {(sum(sizes.values()) + spec) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
