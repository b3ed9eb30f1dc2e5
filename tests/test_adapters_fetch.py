"""Kernel files fetched once, cached, and verified by hash; stand-ins that never shadow.

Everything here runs on a wheel made in the test (no network): its files are
extracted into ``$PAGED_SPEC_CACHE`` and verified; a cached file changed since
is refused naming both hashes, and so is a wheel whose own hash is not the
pinned one; a ``pip download`` that fails is a setup error that says what to
install; and the loader neither replaces an installed module by a stand-in nor
lets a kernel file import something no one provided.
"""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from conformance.adapters import ADAPTERS, _fetch, _load
from conformance.adapters._fetch import Release, sha256_of, verified_files
from conformance.errors import SetupError

WHEEL = "demo_pkg-1.0-cp311-cp311-manylinux_2_34_x86_64.whl"
FILES = {"demo_pkg/ops/kernel.py": b"ANSWER = 42\n", "demo_pkg/ops/helper.py": b"X = 1\n"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(_fetch.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _release(where: Path, extra: dict[str, bytes] | None = None) -> Release:
    wheel = where / WHEEL
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in {**FILES, "demo_pkg/big.bin": b"0" * 1000, **(extra or {})}.items():
            z.writestr(path, data)
    pins = {p: hashlib.sha256(d).hexdigest() for p, d in FILES.items()}
    return Release("demo_pkg", "1.0", WHEEL, sha256_of(wheel), pins)


def _pip_serving(wheel: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """``pip download`` as a stand-in that copies ``wheel`` where it was asked to."""
    calls: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        target = Path(command[command.index("-d") + 1])
        (target / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    return calls


def test_a_release_is_fetched_once_and_only_its_pinned_files_are_kept(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _release(tmp_path)
    calls = _pip_serving(tmp_path / WHEEL, monkeypatch)
    root = verified_files(release)
    assert root == cache / "kernels" / "demo_pkg-1.0"
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*.py")) == sorted(FILES)
    assert not list(cache.rglob("*.whl")) and not (root / "demo_pkg" / "big.bin").exists()
    assert verified_files(release) == root and len(calls) == 1  # cached: no second fetch
    command = calls[0]
    assert command[2:6] == ["pip", "download", "demo_pkg==1.0", "--no-deps"]
    assert "--platform" in command and "manylinux_2_34_x86_64" in command


def test_a_changed_cached_file_is_refused_naming_both_hashes(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _release(tmp_path)
    _pip_serving(tmp_path / WHEEL, monkeypatch)
    root = verified_files(release)
    changed = root / "demo_pkg/ops/kernel.py"
    changed.write_bytes(b"ANSWER = 43\n")
    want = release.files["demo_pkg/ops/kernel.py"]
    got = hashlib.sha256(b"ANSWER = 43\n").hexdigest()
    with pytest.raises(SetupError) as err:
        verified_files(release)
    assert f"sha256 {got} does not match the pinned {want} of demo_pkg 1.0" in str(err.value)


def test_a_wheel_whose_hash_is_not_the_pin_is_refused(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _release(tmp_path)
    _release(tmp_path, {"demo_pkg/extra.py": b"changed\n"})  # same name, other bytes
    _pip_serving(tmp_path / WHEEL, monkeypatch)
    with pytest.raises(SetupError, match=f"sha256 {sha256_of(tmp_path / WHEEL)} does not match"):
        verified_files(release)
    assert not (cache / "kernels" / "demo_pkg-1.0").exists()


def test_a_file_missing_from_the_wheel_says_the_pin_is_wrong(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _release(tmp_path)
    pins = {**release.files, "demo_pkg/ops/gone.py": "0" * 64}
    wrong = Release(release.package, release.version, release.wheel, release.wheel_sha256, pins)
    _pip_serving(tmp_path / WHEEL, monkeypatch)
    with pytest.raises(SetupError, match=r"has no demo_pkg/ops/gone\.py: the pin of demo_pkg 1\.0"):
        verified_files(wrong)


def test_no_network_and_no_package_is_a_setup_error_naming_what_to_install(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _release(tmp_path)

    def offline(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version")

    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(SetupError) as err:
        verified_files(release)
    assert "install demo_pkg==1.0, or run once where PyPI is reachable" in str(err.value)
    assert "Could not find a version" in str(err.value)
    with pytest.raises(SetupError, match="not in"):
        verified_files(release, fetch=False)


def test_an_installed_module_is_never_replaced_by_a_stand_in() -> None:
    with pytest.raises(SetupError, match="json is the installed one"):
        _load.standin("json")
    assert _load.installed_version("json") is not None
    assert _load.installed_version("paged_spec_no_such_package") is None


def test_a_kernel_file_importing_what_no_one_provides_names_it(tmp_path: Path) -> None:
    kernel = tmp_path / "k.py"
    kernel.write_text("import paged_spec_demo_engine.platforms\n")
    with pytest.raises(SetupError, match="imports paged_spec_demo_engine"):
        _load.load_file("paged_spec_demo_pkg.ops.k", kernel)


def test_the_pins_name_exact_files_and_every_adapter_is_registered() -> None:
    from importlib.metadata import entry_points

    installed = {ep.name: ep.value for ep in entry_points(group="paged_spec.backends")}
    assert {name: installed.get(name) for name in ADAPTERS} == ADAPTERS
    pytest.importorskip("triton", reason="the pins live beside the Triton adapters: [gpu]")
    from conformance.adapters._sglang import SGLANG
    from conformance.adapters._vllm import VLLM

    for release in (VLLM, SGLANG):
        assert release.wheel.startswith(f"{release.package}-{release.version}-")
        assert all(len(h) == 64 for h in (release.wheel_sha256, *release.files.values()))
