"""Finding a backend by name: installed entry points, ``module:factory``, or ``file.py:factory``.

Installed backends register in the entry-point group ``paged_spec.backends``
(this project registers ``reference``, ``torch`` and ``triton``). Anything
else is named by the callable that builds it: ``my_pkg.backend:make`` or
``path/to/my_backend.py:MyBackend``. Nothing is imported until it is asked
for, so a missing GPU library only matters to the backend that needs it.

>>> load_backend("reference").capabilities.name
'reference'
>>> load_backend("no_such_backend")
Traceback (most recent call last):
...
conformance.errors.SetupError: no installed backend named 'no_such_backend' ...
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from conformance.errors import SetupError
from conformance.interpreter.api import install_when_interpreting
from conformance.judges.device_contract import setup_problem
from spec.backend import Backend
from spec.capabilities import Capabilities

ENTRY_POINT_GROUP = "paged_spec.backends"
ENV_VAR = "PAGED_SPEC_BACKEND"
"""Names the backend, as ``--backend`` does, for :mod:`conformance.pytest_suite`."""

_METHODS = ("create_cache", "write_kv", "copy_blocks", "attention", "read_cache")
EXTRAS = {"torch": "torch", "triton": "gpu"}
"""The optional packages this project's backends import, and the extra that brings each
(pyproject.toml): the base install runs the reference and any numpy backend without them."""


def missing_extra(err: BaseException) -> str | None:
    """What to install when ``err`` is the import of an optional package that is not there.

    >>> missing_extra(ModuleNotFoundError("No module named 'triton'", name="triton"))
    "triton, which is not installed: pip install 'paged-spec[gpu]'"
    """
    name = getattr(err, "name", None) if isinstance(err, ModuleNotFoundError) else None
    top = (name or "").split(".")[0]
    if top not in EXTRAS:
        return None
    return f"{top}, which is not installed: pip install 'paged-spec[{EXTRAS[top]}]'"


def installed_backends() -> dict[str, str]:
    """Installed backend names and the ``module:attribute`` each one loads."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_backend(ref: str) -> Backend:
    """Build the backend ``ref`` names; :class:`SetupError` says what to fix if it cannot.

    Under ``TRITON_INTERPRET`` the honest interpreter is installed first and
    again after (a backend may turn the interpreter on as it loads), so a
    replay script, which starts here, runs kernels as the run did.
    """
    install_when_interpreting()
    attr, factory = load_callable(_resolve(ref), ref)
    try:
        backend = factory()
    except (Exception, SystemExit) as err:  # sys.exit in a factory is a setup error too
        hint = missing_extra(err)
        if hint:
            raise SetupError(f"{ref!r}: calling {attr}() needs {hint}") from err
        raise SetupError(f"{ref!r}: calling {attr}() raised {type(err).__name__}: {err}") from err
    missing = [m for m in _METHODS if not callable(getattr(backend, m, None))]
    if missing:
        raise SetupError(
            f"{ref!r} built a {type(backend).__name__}, which lacks {', '.join(missing)}: "
            "see docs/plugging-in.md for the Backend contract"
        )
    try:
        caps = backend.capabilities
    except (Exception, SystemExit) as err:
        raise SetupError(
            f"{ref!r}: reading .capabilities raised {type(err).__name__}: {err}"
        ) from err
    if not isinstance(caps, Capabilities):
        raise SetupError(f"{ref!r}: .capabilities must be a spec.backend.Capabilities")
    problem = setup_problem(backend, caps)  # the device-resident contract's preconditions
    if problem:
        raise SetupError(f"{ref!r}: {problem}")
    assert isinstance(backend, Backend)
    install_when_interpreting()
    return backend


def load_callable(factory_ref: str, ref: str | None = None) -> tuple[str, Callable[..., Any]]:
    """The callable ``module:factory`` or ``path/to/file.py:factory`` names, and its name.

    ``ref`` is what the user wrote (for messages; default ``factory_ref``).
    Raises :class:`SetupError` saying what to fix when it cannot be imported.
    """
    ref = factory_ref if ref is None else ref
    module_name, _, attr = factory_ref.rpartition(":")
    if not module_name or not attr:
        raise SetupError(f"{ref!r} is not NAME, module:factory or file.py:factory")
    factory = getattr(_import(module_name, ref), attr, None)
    if not callable(factory):
        raise SetupError(f"{ref!r}: {module_name} has no callable {attr!r}")
    return attr, factory


def _resolve(ref: str) -> str:
    if ":" in ref:
        return ref
    installed = installed_backends()
    if ref not in installed:
        names = ", ".join(sorted(installed)) or "none"
        raise SetupError(
            f"no installed backend named {ref!r} (installed: {names}); "
            "name your own as module:factory or path/to/file.py:factory"
        )
    return installed[ref]


def _import(module_name: str, ref: str) -> ModuleType:
    try:
        if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
            return _import_file(Path(module_name), ref)
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        return importlib.import_module(module_name)
    except SetupError:
        raise
    except (Exception, SystemExit) as err:
        hint = missing_extra(err)
        if hint:
            raise SetupError(f"{ref!r}: importing {module_name} needs {hint}") from err
        raise SetupError(
            f"{ref!r}: importing {module_name} raised {type(err).__name__}: {err}"
        ) from err


def _import_file(path: Path, ref: str) -> ModuleType:
    if not path.is_file():
        raise SetupError(f"{ref!r}: no file {path}")
    name = f"_conformance_backend_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SetupError(f"{ref!r}: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
