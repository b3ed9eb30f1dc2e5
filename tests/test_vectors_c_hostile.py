"""The C reader, built with AddressSanitizer and UBSan, refuses every malformed vector.

The corpus (tests/malformed_vectors.py) runs through one process: each vector
must print ERROR (a setup error, exit 2), never PASS or FAIL, with no
sanitizer report and within the timeout. The real export must still pass
under the sanitizers, and the fuzz target must build and run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from malformed_vectors import malformed
from vectors_fixtures import Exported, exported, manifests

__all__ = ["exported", "malformed"]  # the session fixtures, imported for pytest

SOURCES = Path(__file__).resolve().parent.parent / "conformance" / "vectors" / "reader_c"
FLAGS = ["-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-pedantic", "-Werror"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
ENV = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0:allocator_may_return_null=0"}


def _sanitizing_compiler(tmp: Path) -> str | None:
    """gcc or clang, the first that builds and runs a sanitized program here."""
    (tmp / "t.c").write_text("int main(void) { return 0; }\n")
    for cc in ("gcc", "clang", "cc"):
        if shutil.which(cc) is None:
            continue
        built = subprocess.run(
            [cc, *SANITIZE, "-o", str(tmp / "t"), str(tmp / "t.c")],
            capture_output=True,
            check=False,
        )
        if built.returncode == 0 and subprocess.run([str(tmp / "t")], check=False).returncode == 0:
            return cc
    return None


@pytest.fixture(scope="session")
def sanitized(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The compiler and the reader built with -fsanitize=address,undefined, once per session."""
    tmp = tmp_path_factory.mktemp("reader_c_sanitized")
    cc = _sanitizing_compiler(tmp)
    if cc is None:
        pytest.skip("neither gcc nor clang builds -fsanitize=address,undefined programs here")
    exe = tmp / "vectors_check"
    sources = [str(SOURCES / n) for n in ("vectors_check.c", "json.c", "npy.c")]
    subprocess.run([cc, *FLAGS, *SANITIZE, "-o", str(exe), *sources, "-lm"], check=True)
    return cc, exe


def _run(exe: Path, paths: list[Path]) -> subprocess.CompletedProcess[str]:
    args = [str(exe), *map(str, paths)]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=ENV, check=False)


def test_every_malformed_vector_is_a_setup_error(
    sanitized: tuple[str, Path], malformed: list[tuple[str, Path]]
) -> None:
    done = _run(sanitized[1], [d / "manifest.json" for _, d in malformed])
    assert "Sanitizer" not in done.stderr and "runtime error" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    verdicts = {line.split(": ")[0].split(" ", 1)[1]: line.split()[0] for line in lines}
    wrong = [name for name, d in malformed if verdicts.get(str(d)) != "ERROR"]
    assert not wrong, f"not refused: {wrong}\n{done.stdout}"
    assert done.returncode == 2 and len(lines) == len(malformed)


def test_the_sanitized_reader_passes_the_real_export(
    sanitized: tuple[str, Path], exported: Exported
) -> None:
    done = _run(sanitized[1], manifests(exported.out))
    assert done.returncode == 0 and not done.stderr, done.stderr
    assert done.stdout.count("PASS") == exported.examples


def test_the_fuzz_target_runs_over_its_seed_corpus(
    sanitized: tuple[str, Path], tmp_path: Path
) -> None:
    cc, _ = sanitized
    exe = tmp_path / "fuzz_reader"
    sources = [
        str(SOURCES / "fuzz" / "fuzz_target.c"),
        str(SOURCES / "json.c"),
        str(SOURCES / "npy.c"),
    ]
    subprocess.run([cc, *FLAGS, *SANITIZE, "-o", str(exe), *sources], check=True)
    seeds = SOURCES / "fuzz" / "seeds"
    assert len(list(seeds.iterdir())) >= 3
    run = [str(exe), "-seconds", "2", str(seeds)]
    done = subprocess.run(
        run, capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False
    )
    assert done.returncode == 0 and "no finding" in done.stdout, done.stdout + done.stderr
