"""Kernel files of a pinned release, fetched once from its wheel, cached, and verified by hash.

An adapter of another project's Triton kernels runs them as that project
ships them. Where the project is installed (a user's GPU machine) the adapter
imports it; elsewhere (a CPU, CI) it loads the few kernel files it needs from
the wheel of the release its declarations were read from. This module gets
those files:

* the wheel is fetched with ``pip download --no-deps`` for the exact file the
  pin names (its Python, ABI and platform tags are passed, so every machine
  fetches the same bytes), and refused unless its sha256 is the pinned one;
* only the pinned files are kept, under ``$PAGED_SPEC_CACHE`` (default
  ``~/.cache/paged-spec``) in ``kernels/NAME-VERSION/``, and the wheel is
  deleted (vLLM's is about 336 MB; its kernel files about 110 kB);
* every load checks each file's sha256 against the pin again, so a file
  changed in the cache is refused, naming both hashes, never run.

The cache survives between runs: a release is fetched once per machine. A
missing file with no way to fetch it is a :class:`~conformance.errors.SetupError`
that names what to install.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from conformance.errors import SetupError

CACHE_ENV = "PAGED_SPEC_CACHE"
"""Where fetched files are kept (default ``~/.cache/paged-spec``)."""
FETCH_TIMEOUT_S = 1200.0
"""How long one ``pip download`` may take (the vLLM wheel is about 336 MB)."""


@dataclass(frozen=True)
class Release:
    """One release's wheel and the kernel files taken from it, each with its sha256.

    ``wheel`` is the exact file name on the index: its tags say which build to fetch.
    """

    package: str
    version: str
    wheel: str
    wheel_sha256: str
    files: Mapping[str, str]  # path inside the wheel -> sha256 of its bytes

    @property
    def name(self) -> str:
        """``vllm 0.33.0``."""
        return f"{self.package} {self.version}"

    def pip_tags(self) -> list[str]:
        """``pip download`` options that select exactly :attr:`wheel`'s build.

        >>> " ".join(RELEASE_EXAMPLE.pip_tags())
        '--python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_34_x86_64'
        """
        stem = self.wheel.removesuffix(".whl").split("-")
        if len(stem) != 5:
            raise SetupError(f"{self.wheel!r} is not a wheel file name NAME-VERSION-PY-ABI-PLAT")
        python, abi, platform = stem[2:]
        digits = python.removeprefix("cp")
        version = f"{digits[0]}.{digits[1:]}"
        if abi == "abi3":  # any later CPython takes it; pip checks Requires-Python against this
            version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return [
            "--python-version", version, "--implementation", "cp", "--abi", abi,
            "--platform", platform,
        ]  # fmt: skip


RELEASE_EXAMPLE = Release(
    "sglang", "0.5.23", "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl", "0" * 64, {}
)


def cache_root() -> Path:
    """``$PAGED_SPEC_CACHE``, else ``~/.cache/paged-spec``."""
    configured = os.environ.get(CACHE_ENV, "").strip()
    return Path(configured) if configured else Path.home() / ".cache" / "paged-spec"


def release_dir(release: Release) -> Path:
    """Where ``release``'s kernel files are kept: ``<cache>/kernels/NAME-VERSION``."""
    return cache_root() / "kernels" / f"{release.package}-{release.version}"


def sha256_of(path: Path) -> str:
    """The sha256 of a file's bytes, read in chunks (a wheel may be hundreds of MB)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_hash(what: str, got: str, release: Release, want: str) -> None:
    """Refuse ``what`` unless its sha256 ``got`` is the pinned ``want``, naming both."""
    if got != want:
        raise SetupError(
            f"{what}: sha256 {got} does not match the pinned {want} of {release.name}; "
            "refused (delete the file to fetch it again)"
        )


def verified_files(release: Release, *, fetch: bool = True) -> Path:
    """The folder holding ``release``'s pinned files, each checked against its sha256.

    Files not cached yet are fetched from the wheel first (unless ``fetch`` is
    false: then their absence is a :class:`SetupError`).
    """
    root = release_dir(release)
    if not all((root / path).is_file() for path in release.files):
        if not fetch:
            raise SetupError(f"{release.name}'s kernel files are not in {root}")
        with _locked(root.with_name(root.name + ".lock")):
            if not all((root / path).is_file() for path in release.files):
                _fetch(release, root)
    for path, want in release.files.items():
        check_hash(str(root / path), sha256_of(root / path), release, want)
    return root


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """One fetch at a time per release on this machine (parallel test workers share it)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        try:
            import fcntl
        except ImportError:  # not POSIX: workers may both fetch; the rename below stays atomic
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch(release: Release, root: Path) -> None:
    """Download the pinned wheel, check it, and keep only the pinned files in ``root``."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=f".{root.name}.") as tmp:
        wheel = download(release, Path(tmp))
        extract(release, wheel, Path(tmp) / "files")
        if root.exists():  # an incomplete earlier copy
            shutil.rmtree(root)
        (Path(tmp) / "files").rename(root)


def download(release: Release, where: Path) -> Path:
    """``pip download`` the pinned wheel into ``where`` and check its sha256; its path."""
    command = [
        sys.executable, "-m", "pip", "download", f"{release.package}=={release.version}",
        "--no-deps", "--only-binary", ":all:", *release.pip_tags(), "-d", str(where), "-q",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SetupError(_unavailable(release, f"{' '.join(command[2:5])}: {err}")) from err
    wheel = where / release.wheel
    if done.returncode != 0 or not wheel.is_file():
        why = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SetupError(_unavailable(release, " / ".join(why) or "pip fetched no such wheel"))
    check_hash(str(wheel), sha256_of(wheel), release, release.wheel_sha256)
    return wheel


def extract(release: Release, wheel: Path, into: Path) -> None:
    """Copy the pinned files out of ``wheel`` into ``into``, each checked before it is kept."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for path, want in release.files.items():
            if path not in names:
                raise SetupError(f"{wheel.name} has no {path}: the pin of {release.name} is wrong")
            data = z.read(path)
            check_hash(f"{path} in {wheel.name}", hashlib.sha256(data).hexdigest(), release, want)
            target = into / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


def _unavailable(release: Release, why: str) -> str:
    return (
        f"{release.name}'s kernel files are not cached in {release_dir(release)} and could not "
        f"be fetched ({why}): install {release.package}=={release.version}, or run once where "
        f"PyPI is reachable (pip download {release.package}=={release.version} --no-deps)"
    )
