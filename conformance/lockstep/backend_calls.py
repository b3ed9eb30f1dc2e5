"""The backend's calls, as the contract makes them, watched: what one example hands it and reads.

Every call goes through the :class:`~conformance.judges.guard.CallGuard` (a
raise, a changed input or a returned alias becomes the backend's failure), the
bounds checker when the run has one (a call that may launch kernels,
:data:`BOUNDS_CHECKED`, whose kernels accessed memory they may not fails as
``"bounds"``, before a fault of the same call: a refused access may be what
made it raise), and a clock (the seconds spent, by call). Arrays go in as the
contract says: float32 numpy, or, for a backend under the device-resident
contract (``tensors="torch"``), tensors on its device
(:mod:`conformance.judges.device_contract`); what comes back is checked for its
shape and read as float64. Block ids are the backend's (a large pool:
:mod:`conformance.lockstep.large_pool`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

from conformance.bounds.checker import BoundsChecker, Watched
from conformance.judges.compare import latent_output_note, latent_part_note
from conformance.judges.device_contract import (
    ContractMismatch,
    DeviceContract,
    setup_problem,
    uses_device_contract,
)
from conformance.judges.dtypes import F64
from conformance.judges.guard import BackendFault, CallGuard
from conformance.lockstep.example import Example
from conformance.lockstep.large_pool import LargePool
from conformance.lockstep.tables import widen
from conformance.lockstep.workload import kv_parts
from spec.backend import Backend
from spec.batch import BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry

_T = TypeVar("_T")

BOUNDS_CHECKED = (
    "create_cache",
    "write_kv",
    "copy_blocks",
    "attention",
    "read_cache",
    "read_blocks",
)
"""The backend calls that may launch kernels: those a bounds checker watches (all but the
capabilities and ``attention_path``, which only describe the backend)."""


class BackendCalls:
    """One example's calls of ``backend``: its capabilities (read once), the cache's creation,
    writes, copies, attention and reads, each watched and timed into ``call_seconds``."""

    def __init__(
        self,
        backend: Backend,
        example: Example,
        pool: LargePool,
        guard: CallGuard,
        bounds: BoundsChecker | None,
        call_seconds: dict[str, float],
    ) -> None:
        self.backend = backend
        self.example = example
        self.pool = pool
        self.guard = guard
        self.bounds = bounds
        self.call_seconds = call_seconds
        self.caps: Capabilities = self.call("capabilities", lambda: backend.capabilities)
        self.read_blocks_fn = getattr(backend, "read_blocks", None)
        if pool.base and self.read_blocks_fn is None:
            raise ValueError("a large pool needs the backend's read_blocks(layer, blocks)")
        self.device = self._device_contract()

    @property
    def geometry(self) -> KVGeometry:
        """The geometry the backend allocates."""
        return self.pool.geometry(self.example.config.geometry)

    def call(self, what: str, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        """One backend call, through the guard and the bounds check; timed."""
        fault: BackendFault | None = None
        start = time.perf_counter()
        with self._watch(what, args) as seen:
            try:
                result = self.guard.call(what, fn, *args, **kwargs)
            except BackendFault as err:
                fault = err
        spent = time.perf_counter() - start
        self.call_seconds[what] = self.call_seconds.get(what, 0.0) + spent
        if seen is not None and seen.violations:
            self.example.fail("bounds", bounds_detail(seen), layer=seen.layer)
        if fault is not None:
            self.example.fail(fault.kind, fault.detail, layer=fault.layer)
        return result

    def _watch(self, what: str, args: tuple[object, ...]) -> AbstractContextManager[Watched | None]:
        """The bounds checker's watch over a call that launches kernels; else nothing."""
        if self.bounds is None or what not in BOUNDS_CHECKED:
            return nullcontext()
        layer = args[0] if what != "copy_blocks" and isinstance(args[0], int) else None
        batch = args[2] if what == "attention" and isinstance(args[2], BatchMetadata) else None
        return self.bounds.watch(what, layer, batch)

    def view(self, batch: BatchMetadata) -> BatchMetadata:
        """``batch`` as the backend sees it: block ids shifted into a large pool, tables as wide
        as it asks (:mod:`conformance.lockstep.tables`)."""
        return widen(self.pool.batch(batch), self.caps.table_width)

    # -- the contract's calls: numpy, or device-resident (conformance/judges/device_contract.py) --

    def _device_contract(self) -> DeviceContract | None:
        """The device contract's converter when the backend declares it; its checks first.

        Under it the suite reads back only what it compares: the blocks each step
        wrote or copied into (and their neighbours), the whole pool every few steps
        and at the end, as for a large pool.
        """
        if not uses_device_contract(self.caps):
            return None
        problem = setup_problem(self.backend, self.caps)
        if problem:
            raise ValueError(f"{self.caps.name}: {problem}")
        return DeviceContract(self.caps, self.geometry)

    def write_kv(self, layer: int, key: F64, value: F64, slots: list[int]) -> None:
        """One ``write_kv`` in the backend's contract: float32 arrays, or device tensors."""
        dc = self.device
        if dc is None:
            self.call("write_kv", self.backend.write_kv, layer, _f32(key), _f32(value), slots)
            return
        handed: dict[str, object] = {
            "key": dc.activations(key),
            "value": dc.activations(value),
            "slot_mapping": dc.slots(self.example.step_index, slots),
        }
        self.call("write_kv", self.backend.write_kv, layer, *handed.values())
        self._unchanged("write_kv", handed, layer)

    def attention(
        self,
        layer: int,
        query: F64,
        batch: BatchMetadata,
        new_kv: tuple[F64, F64],
        extra: Mapping[str, object],
    ) -> F64:
        """One ``attention`` call in the backend's contract; its output checked, as float64.

        Under the device contract it also gets the batch's device arrays and the
        call's new K and V (``arrays=``, ``key=``, ``value=``).
        """
        dc, scale = self.device, self.example.config.scale
        g = self.example.config.geometry
        shape = (*query.shape[:2], g.value_dim)  # latent: [T, H, latent_dim], not the query's
        if dc is None:
            got = self.call(
                "attention", self.backend.attention, layer, _f32(query), batch, scale, **extra
            )
            out = f64(got)
            if out.shape != shape:
                self.example.fail(
                    "shape",
                    f"attention returned shape {out.shape}, expected {shape}"
                    + latent_output_note(g),
                    layer,
                )
            return out
        q = dc.activations(query)
        handed: dict[str, object] = {
            "arrays": dc.metadata(self.example.step_index, batch),
            "key": dc.activations(new_kv[0]),
            "value": dc.activations(new_kv[1]),
        }
        got = self.call(
            "attention", self.backend.attention, layer, q, batch, scale, **handed, **extra
        )
        self._unchanged("attention", {"query": q, **handed}, layer)
        try:
            return dc.output("attention", got, shape)
        except ContractMismatch as err:
            self.example.fail("shape", f"{err}{latent_output_note(g)}", layer=layer)

    def attention_path(self, layer: int) -> str | None:
        """The backend's own name of the path its last attention call ran, if it says."""
        path = getattr(self.backend, "attention_path", None)
        if path is None:
            return None
        name = self.call("attention_path", path)
        if not isinstance(name, str):
            self.example.fail(
                "shape",
                f"attention_path() returned {name!r} ({type(name).__name__}), not a str naming "
                "the path the last attention call ran",
                layer=layer,
            )
        return name

    def read(self, layer: int, blocks: list[int], backend_ids: bool = False) -> tuple[F64, F64]:
        """K and V of spec ``blocks`` (backend ids if ``backend_ids``), as the backend has them.

        The whole of a pool that is not large is read with ``read_cache`` (the
        contract's method); some blocks, or any of a large pool, with
        ``read_blocks`` when the backend has it.
        """
        g = self.geometry
        base = self.pool.base
        ids = blocks if backend_ids else [b + base for b in blocks]
        if self.device is not None:
            return self._read_device(layer, ids)
        whole = not base and len(ids) == g.num_blocks and not backend_ids
        if self.read_blocks_fn is not None and not whole:
            got = self.call("read_blocks", self.read_blocks_fn, layer, ids)
            return self._shaped(f"read_blocks({layer}, ...)", got, len(ids), layer)
        got = self.call("read_cache", self.backend.read_cache, layer)
        k, v = self._shaped(f"read_cache({layer})", got, g.num_blocks, layer)
        return (k, v) if whole else (k[ids], v[ids])

    def _shaped(self, what: str, got: object, blocks: int, layer: int) -> tuple[F64, F64]:
        """A read's K and V as float64, or a failure naming the shape it had."""
        g = self.geometry
        pair = got if isinstance(got, tuple | list) and len(got) == 2 else (got, got)
        out = []
        for name, width, x in zip(kv_parts(g), g.kv_widths, pair, strict=True):
            x = f64(x)
            shape = (blocks, g.block_size, g.num_kv_heads, width)
            if x.shape != shape:
                self.example.fail(
                    "shape",
                    f"{what} {name} has shape {x.shape}, expected {shape}"
                    + latent_part_note(g, name),
                    layer=layer,
                )
            out.append(x)
        return out[0], out[1]

    def _read_device(self, layer: int, ids: list[int]) -> tuple[F64, F64]:
        """Backend blocks ``ids`` through ``read_blocks``, checked, as float64 on the host."""
        assert self.device is not None and self.read_blocks_fn is not None
        g = self.geometry
        got = self.call("read_blocks", self.read_blocks_fn, layer, ids)
        k, v = ((len(ids), g.block_size, g.num_kv_heads, w) for w in g.kv_widths)
        try:
            return self.device.blocks(
                f"read_blocks({layer}, ...)", got, k, value_shape=v, names=kv_parts(g)
            )
        except ContractMismatch as err:
            self.example.fail("shape", str(err), layer=layer)

    def _unchanged(self, what: str, handed: dict[str, object], layer: int) -> None:
        assert self.device is not None
        problem = self.device.changed(what, handed)
        if problem:
            self.example.fail("input", problem, layer=layer)


def bounds_detail(seen: Watched) -> str:
    """A bounds failure's detail: the call's first violation, and how many more it had.

    >>> from conformance.bounds.checker import Violation
    >>> v = Violation("attention", 0, "k", 1, "load", "outside", "t", "int32 [2]", False,
    ...               2, 1, 1, 1, (0,))
    >>> detail = bounds_detail(Watched("attention", 0, violations=[v, v]))
    >>> detail.split(": ")[0]
    'a kernel accessed memory it may not (bounds check)'
    >>> detail.split("; ")[-1]
    'first by program (0,): element 2, 1 past the end (worst 1) (and 1 more violation in this call)'
    """
    first, more = seen.violations[0], len(seen.violations) - 1
    tail = f" (and {more} more violation{'s' if more > 1 else ''} in this call)" if more else ""
    return f"a kernel accessed memory it may not (bounds check): {first.describe()}{tail}"


def f64(x: object) -> F64:
    out: F64 = np.asarray(x, dtype=np.float64)
    return out


def _f32(x: F64) -> NDArray[np.float32]:
    return x.astype(np.float32)
