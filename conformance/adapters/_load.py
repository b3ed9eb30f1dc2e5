"""Another project's kernel modules: imported where it is installed, else loaded from its pinned
files beside stand-ins for the few engine modules those files import.

A kernel file of vLLM or SGLang imports a handful of its engine's modules
(a logger, the platform, an environment table, an enum). Where the package is
not installed, each is replaced by a stand-in registered under the engine's own
module name, marked with :data:`STANDIN`, holding only what the kernel files
read; the kernel files themselves are executed unchanged under their own
names (so launches and reports name ``vllm.v1.attention.ops...``). Parent
packages are registered with an empty ``__path__``: an import the pins did
not foresee fails naming the module, instead of finding something else.
Stand-ins are placed only where the real package is absent, so a user's
installed engine is never shadowed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from conformance.adapters._fetch import Release, verified_files
from conformance.errors import SetupError

STANDIN = "__paged_spec_standin__"
"""Set on every module this project registered in place of an engine's."""


def installed_version(package: str) -> str | None:
    """The version of ``package`` when the real one is importable here; ``None`` otherwise (not
    installed, or only this project's stand-ins are)."""
    present = sys.modules.get(package)
    if present is not None and getattr(present, STANDIN, False):
        return None
    try:
        if importlib.util.find_spec(package) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def standin(name: str, **attributes: Any) -> ModuleType:
    """The stand-in module ``name`` (created, with its parent packages, on first use)."""
    module = sys.modules.get(name)
    if module is None:
        if "." in name:
            package(name.rpartition(".")[0])
        module = ModuleType(name, f"paged-spec's stand-in for {name} (kernel files only)")
        setattr(module, STANDIN, True)
        sys.modules[name] = module
        if "." in name:
            setattr(sys.modules[name.rpartition(".")[0]], name.rpartition(".")[2], module)
    elif not getattr(module, STANDIN, False):
        raise SetupError(f"{name} is the installed one: no stand-in may replace it")
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def package(name: str) -> ModuleType:
    """A stand-in package ``name`` with an empty ``__path__`` (nothing is found through it)."""
    module = standin(name)
    if not hasattr(module, "__path__"):
        module.__path__ = []
    return module


def load_file(name: str, path: Path) -> ModuleType:
    """Execute the file ``path`` as module ``name`` (once; later calls return it)."""
    if name in sys.modules:
        return sys.modules[name]
    package(name.rpartition(".")[0])
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SetupError(f"cannot load {path} as {name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[name]
        if isinstance(err, ModuleNotFoundError):
            raise SetupError(
                f"{path} imports {err.name}, which is neither installed nor stood in for: "
                f"pip install {(err.name or '').split('.')[0]}"
            ) from err
        raise
    setattr(sys.modules[name.rpartition(".")[0]], name.rpartition(".")[2], module)
    return module


def import_installed(name: str, package_name: str) -> ModuleType:
    """Import ``name`` from the installed package; a failure is a :class:`SetupError`."""
    try:
        return importlib.import_module(name)
    except Exception as err:
        raise SetupError(
            f"importing {name} from the installed {package_name} raised {type(err).__name__}: {err}"
        ) from err


def load_release(release: Release, standins: Callable[[], None]) -> tuple[list[ModuleType], str]:
    """``release``'s kernel modules, in the order of its files, and where they came from: the
    installed package's, else the pinned files' (verified, beside ``standins()``)."""
    names = [p.removesuffix(".py").replace("/", ".") for p in release.files]
    version = installed_version(release.package)
    if version is not None:
        modules = [import_installed(name, release.package) for name in names]
        return modules, (
            f"{release.package} {version}, installed (declarations read from {release.name})"
        )
    root = verified_files(release)
    standins()
    modules = [load_file(n, root / p) for n, p in zip(names, release.files, strict=True)]
    return modules, f"{release.name}, kernel files from its wheel (sha256 verified)"
