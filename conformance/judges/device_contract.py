"""The suite's side of the device-resident contract (``Capabilities.tensors == "torch"``).

:mod:`spec.backend` states the contract; this module is the one place that
converts what the suite hands such a backend and checks what comes back. It
imports torch only when a backend declares the contract, so the numpy contract
(the default) never needs it.

What it guarantees the lockstep, per step:

* **Metadata once.** :meth:`DeviceContract.metadata` turns a batch into
  ``batch.arrays()`` on the backend's device (int32 ``query_start_loc``,
  ``seq_lens`` and block tables; int64 slots, positions and copies) the first
  time it is asked within a step, and returns the same tensors for every
  later layer; :meth:`DeviceContract.slots` does the same for a KV write's
  slot mapping.
* **Activations on the device.** Queries and new K and V go as tensors of
  the activation dtype (the values are already representable in it, so the
  conversion is exact).
* **What comes back is checked** before any value is compared: a torch
  tensor, on the declared device, of the declared dtype and shape; anything
  else is a :class:`ContractMismatch` naming what was wrong and what was
  expected. Only the blocks the suite compares are read back, and only those
  cross to the host (as float64).
* **Inputs unchanged.** Every tensor handed out is remembered with its
  version counter; :meth:`DeviceContract.changed` names one that an in-place
  torch operation changed during the call. A write through a raw pointer (a
  kernel) does not move the counter: that is the one kind of change this
  check cannot see (the numpy contract's snapshots can; on CPU, run the
  backend under the numpy contract too).

>>> from spec.backend import Capabilities, KVGeometry
>>> dc = DeviceContract(Capabilities("x", tensors="torch"), KVGeometry(1, 4, 2, 1, 8))
>>> t = dc.slots(1, [0, 1, -1])
>>> t.dtype, t is dc.slots(1, [0, 1, -1])       # built once per step
(torch.int64, True)
>>> dc.output("attention", np.zeros((2, 1, 8)), (2, 1, 8))
Traceback (most recent call last):
...
conformance.judges.device_contract.ContractMismatch: attention returned a numpy ndarray; ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from conformance.judges.dtypes import F64
from spec.backend import Backend
from spec.batch import BatchArrays, BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry

if TYPE_CHECKING:
    import torch

_TORCH_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
"""The torch dtype (by attribute name) of each dtype of the contract."""


class ContractMismatch(Exception):
    """A device-contract backend returned something of the wrong kind, device, dtype or shape."""


def uses_device_contract(caps: Capabilities) -> bool:
    """Whether ``caps`` declares the device-resident contract."""
    return caps.tensors == "torch"


def setup_problem(backend: Backend, caps: Capabilities) -> str | None:
    """Why ``backend`` cannot run under the contract it declares (``None`` when it can).

    Only the device contract has preconditions: torch importable, the declared
    device usable, and ``read_blocks`` (the suite reads back only the blocks it
    compares).
    """
    if not uses_device_contract(caps):
        return None
    try:
        import torch
    except ImportError:
        return "it declares tensors='torch', but torch cannot be imported"
    if not callable(getattr(backend, "read_blocks", None)):
        return (
            "it declares tensors='torch', which needs read_blocks(layer, blocks): under the "
            "device contract the suite reads back only the blocks it compares"
        )
    try:
        torch.empty(1, device=caps.device)
    except (RuntimeError, ValueError, AssertionError) as err:
        return (
            f"it declares tensors='torch' on device {caps.device!r}, which torch cannot use: {err}"
        )
    return None


class DeviceContract:
    """Conversions to, and checks of, a device-contract backend for one lockstep run."""

    def __init__(self, caps: Capabilities, geometry: KVGeometry) -> None:
        import torch

        self.device = torch.device(caps.device)
        self.dtype: torch.dtype = getattr(torch, _TORCH_DTYPES[geometry.dtype])
        self.cache_dtype: torch.dtype = getattr(torch, _TORCH_DTYPES[geometry.cache_dtype])
        self._step = -1
        self._slots: dict[tuple[int, ...], torch.Tensor] = {}
        self._metadata: dict[BatchMetadata, BatchArrays[torch.Tensor]] = {}
        self._born: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor, version at birth)

    # -- what the suite hands over --------------------------------------------------

    def activations(self, x: F64) -> torch.Tensor:
        """``x`` (values the activation dtype represents) as that dtype, on the device."""
        import torch

        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
        return self._keep(t.to(device=self.device, dtype=self.dtype))

    def slots(self, step: int, slots: Sequence[int]) -> torch.Tensor:
        """A KV write's slot mapping as int64 on the device, built once per step."""
        self._at(step)
        key = tuple(slots)
        if key not in self._slots:
            import torch

            t = torch.tensor(key, dtype=torch.int64, device=self.device)
            self._slots[key] = self._keep(t)
        return self._slots[key]

    def metadata(self, step: int, batch: BatchMetadata) -> BatchArrays[torch.Tensor]:
        """``batch.arrays()`` on the device (the contract's dtypes), built once per step."""
        self._at(step)
        if batch not in self._metadata:
            import torch

            device = self.device
            self._metadata[batch] = batch.arrays().map(
                lambda a: self._keep(torch.tensor(a, device=device))  # a copy: ours stay ours
            )
        return self._metadata[batch]

    # -- what comes back ------------------------------------------------------------

    def output(self, what: str, got: object, shape: tuple[int, ...]) -> F64:
        """An attention output, checked (a tensor on the device, activation dtype, ``shape``)."""
        return self._host(self._checked(what, got, self.dtype, shape, "the activation dtype"))

    def blocks(
        self,
        what: str,
        got: object,
        shape: tuple[int, ...],
        *,
        value_shape: tuple[int, ...] | None = None,
        names: tuple[str, str] = ("K", "V"),
    ) -> tuple[F64, F64]:
        """A ``read_blocks`` result, checked (two tensors of the cache dtype), as float64 K, V.

        ``value_shape``: V's, when it differs from K's (a latent row's c_kv and k_rope,
        which ``names`` then names).
        """
        if not isinstance(got, tuple | list) or len(got) != 2:
            raise ContractMismatch(
                f"{what} returned {_kind(got)}; the device contract returns a ({', '.join(names)}) "
                "pair of torch tensors"
            )
        shapes = (shape, shape if value_shape is None else value_shape)
        k, v = (
            self._host(self._checked(f"{what} {n}", x, self.cache_dtype, s, "the cache dtype"))
            for n, s, x in zip(names, shapes, got, strict=True)
        )
        return k, v

    def changed(self, what: str, inputs: Mapping[str, object]) -> str | None:
        """The first of ``inputs`` (by parameter name) that ``what`` changed in place, named."""
        for name, value in inputs.items():
            for part, t in _tensors(name, value):
                born = self._born.get(id(t))
                if born is not None and born[0] is t and t._version != born[1]:
                    return (
                        f"backend.{what} changed its input `{part}` in place during the call "
                        "(a device-contract backend must not change its inputs)"
                    )
        return None

    # -- internals ------------------------------------------------------------------

    def _at(self, step: int) -> None:
        """A new step: the previous step's tensors are no longer handed out."""
        if step != self._step:
            self._step = step
            self._slots.clear()
            self._metadata.clear()
            self._born.clear()

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        self._born[id(t)] = (t, t._version)
        return t

    def _checked(
        self, what: str, got: object, dtype: torch.dtype, shape: tuple[int, ...], which: str
    ) -> torch.Tensor:
        import torch

        if not isinstance(got, torch.Tensor):
            raise ContractMismatch(
                f"{what} returned {_kind(got)}; the device contract returns a torch.Tensor"
            )
        if not _on(got.device, self.device):
            raise ContractMismatch(
                f"{what} returned a tensor on {got.device}, expected the backend's device "
                f"{self.device} (capabilities.device)"
            )
        if got.dtype != dtype:
            raise ContractMismatch(f"{what} returned {got.dtype}, expected {dtype} ({which})")
        if tuple(got.shape) != shape:
            raise ContractMismatch(f"{what} returned shape {tuple(got.shape)}, expected {shape}")
        return got

    def _host(self, t: torch.Tensor) -> F64:
        """Exact: every contract dtype widens to float32 without rounding."""
        import torch

        host = t.detach().to(device="cpu", dtype=torch.float32).numpy()
        with np.errstate(invalid="ignore"):  # an uninitialised cache may hold signalling NaNs
            out: F64 = host.astype(np.float64)
        return out


def _on(actual: torch.device, declared: torch.device) -> bool:
    """``actual`` is ``declared`` (``cuda`` without an index accepts any CUDA device)."""
    if actual.type != declared.type:
        return False
    return declared.index is None or actual.index == declared.index


def _kind(x: object) -> str:
    if isinstance(x, np.ndarray):
        return "a numpy ndarray"
    return f"a {type(x).__name__}"


def _tensors(name: str, value: object) -> list[tuple[str, Any]]:
    """The tensors in one argument, by name: itself, or the arrays of a :class:`BatchArrays`."""
    if isinstance(value, BatchArrays):
        found: list[tuple[str, Any]] = []
        for field_name, item in vars(value).items():
            items = enumerate(item) if isinstance(item, tuple) else [(None, item)]
            for i, x in items:
                found.append((f"{name}.{field_name}" + ("" if i is None else f"[{i}]"), x))
        return found
    return [(name, value)]
