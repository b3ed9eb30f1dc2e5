"""What a vector check prints for a planted bug: the first difference, as docs/vectors.md shows it.

Run ``python -m docs_tools.vectors_demo`` (``--bug NAME``: a class of
:mod:`conformance.planted.backends`, ``SlotOffByOne`` by default). It exports the quick
profile with one example per pass into a temporary directory (seed 1), checks
the planted backend against it, and prints the report's verdict and first
difference; the replay script is left out, since it names the temporary path.
The C reader (conformance/vectors/reader_c/) is then run over the same vectors when a
C compiler is on ``PATH``, and its verdict counts are printed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from conformance.planted import backends as planted
from conformance.reports.report import text_report
from conformance.vectors.check import check_vectors
from conformance.vectors.export import export_vectors

READER = Path(__file__).resolve().parent.parent / "conformance" / "vectors" / "reader_c"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs_tools.vectors_demo", description=__doc__)
    names = sorted(cls.__name__ for cls in planted.PLANTED.values())
    parser.add_argument("--bug", choices=names, default="SlotOffByOne", metavar="NAME")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vectors"
        summary = export_vectors(out, seed=1, examples=1)
        print(f"exported {summary.examples} vectors (quick profile, one example per pass, seed 1)")
        result = check_vectors(
            getattr(planted, args.bug)(), f"conformance.planted.backends:{args.bug}", out
        )
        print(_first_lines(text_report(result)))
        print(_c_reader(out, Path(tmp)))
    return 0


def _first_lines(report: str) -> str:
    """The verdict line and the FIRST DIFFERENCE section of a text report."""
    lines = report.splitlines()
    verdict = lines[0]
    start = lines.index("FIRST DIFFERENCE")
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return "\n".join([verdict, "", *lines[start:end]])


def _c_reader(vectors: Path, tmp: Path) -> str:
    """The C reader's verdicts over ``vectors``, counted, or why it did not run."""
    compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None:
        return "C reader: not run (no C compiler on PATH)"
    exe = tmp / "vectors_check"
    sources = [str(READER / name) for name in ("vectors_check.c", "json.c", "npy.c")]
    subprocess.run([compiler, "-std=c99", "-O2", "-o", str(exe), *sources, "-lm"], check=True)
    manifests = [str(p) for p in sorted(vectors.glob("*/manifest.json"))]
    done = subprocess.run([str(exe), *manifests], capture_output=True, text=True, check=False)
    counts = Counter(line.split()[0] for line in done.stdout.splitlines() if line)
    verdicts = ", ".join(f"{counts[k]} {k}" for k in ("PASS", "SKIP", "FAIL", "ERROR") if counts[k])
    return f"C reader (vectors_check.c) on the same vectors: {verdicts}; exit {done.returncode}"


if __name__ == "__main__":
    raise SystemExit(main())
