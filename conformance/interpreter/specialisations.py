"""The kernel specialisations a compiled run would compile, counted from interpreted launches.

Compiled Triton compiles a kernel once per distinct specialisation: the
values of its constexprs, each argument's type, and for integers and
pointers whether they are 1 or divisible by 16 (a pointer, aligned to 16
bytes), plus the launch options. Each costs a GPU run seconds the first time
(up to 9.4 s measured on an H200 inside a conformance run). The interpreter
compiles nothing, but every launch goes through the shim, which records the
key compiled Triton would look up (:func:`key`), built the way its JIT builds
it (``native_specialize_impl``, ``do_not_specialize``, annotated types). A run
reports how many distinct ones it launched.

>>> reset()
>>> for spec in (("i32", "D"), ("i32", "D"), ("i32", "")):   # divisible by 16, twice; and not
...     record("k", spec, {"num_warps": 4})
>>> counts()
{'k': 2}
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

_SEEN: set[str] = set()
"""``kernel|key`` of every specialisation launched in this process."""


def reset() -> None:
    _SEEN.clear()


def record(kernel: str, specialization: tuple[Any, ...], options: dict[str, Any]) -> None:
    """One launch of ``kernel`` with this specialisation and these launch options."""
    _SEEN.add(f"{kernel}|{specialization!r}|{sorted(options.items())!r}")


def seen() -> frozenset[str]:
    """Every specialisation launched in this process so far."""
    return frozenset(_SEEN)


def counts(keys: frozenset[str] | set[str] | None = None) -> dict[str, int]:
    """Distinct specialisations per kernel, most first."""
    per = Counter(k.split("|", 1)[0] for k in (_SEEN if keys is None else keys))
    return dict(per.most_common())


def key(fn: Any, dns: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The specialisation compiled Triton's JIT computes for a launch of ``fn`` (a Python kernel
    function; ``dns``: its ``do_not_specialize``) with these arguments."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import _normalize_ty

    skip = set(dns or ())
    signature = inspect.signature(fn)
    bound = signature.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    annotations = inspect.get_annotations(fn)
    out: list[Any] = []
    for i, name in enumerate(signature.parameters):
        value = bound.arguments.get(name)
        ty = _normalize_ty(annotations[name]) if name in annotations else None
        if ty == "constexpr":
            out.append(("constexpr", repr(value)))
            continue
        specialize = i not in skip and name not in skip
        if isinstance(ty, str) and (ty == "u1" or ty[:2] in ("fp", "bf")):
            specialize = False
        spec = native_specialize_impl(BaseBackend, value, False, specialize, True)
        out.append((ty, *spec[1:]) if ty else tuple(spec))
    return tuple(out)
