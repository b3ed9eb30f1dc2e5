"""What every adapter shares: the torch cache of :mod:`backend_gpu._cache` and the step's metadata.

Each adapter keeps the contract's cache layout, ``[num_blocks, block_size,
H_kv, D]`` per layer for K and V (vLLM's ``key_cache``/``value_cache`` layout,
and SGLang's token-major pool viewed by block), so ``read_cache`` and
``read_blocks`` need no conversion; checks of every input come from
:class:`~backend_gpu._cache.TorchCacheBackend`. Adapters serve the
device-resident contract by default (``tensors="torch"``): the engines take
tensors on their device, and the suite then hands ``attention`` the step's
device metadata and the call's new K and V, as an engine's forward has them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from backend_gpu._cache import TorchCacheBackend
from conformance.observe.launches import Launch
from conformance.observe.paths import Reader, Reading, register
from spec.batch import BatchArrays, BatchMetadata
from spec.capabilities import Capabilities
from spec.errors import InvalidRequestError
from spec.kv_geometry import KVGeometry


class AdapterBase(TorchCacheBackend, ABC):
    """A :class:`TorchCacheBackend` with the step's metadata as int32 device tensors."""

    def __init__(self, device: str | torch.device | None = None, *, tensors: str = "torch") -> None:
        super().__init__(device, tensors=tensors)
        self._built: tuple[BatchMetadata, int, tuple[torch.Tensor, ...]] | None = None

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What the adapted kernel runs: each adapter declares its own."""

    def create_cache(self, geometry: KVGeometry) -> None:
        """Refuse a geometry the kernel cannot run (its ``excludes``), naming why; else allocate."""
        caps = self.capabilities
        heads = 2 if geometry.is_latent else geometry.num_kv_heads  # a latent layer: any heads
        refuse(", ".join(caps.unsupported(geometry, heads)), caps.name)
        super().create_cache(geometry)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Index copies, checked like every write: neither engine runs a copy-on-write kernel
        (vLLM V1's forks share by prefix caching)."""
        pairs = self._copies(copies)
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.device)
            dst = torch.tensor([d for _, d in pairs], device=self.device)
            for x in self._mem().storage:
                x[dst] = x[src]

    def metadata(
        self, batch: BatchMetadata, group: int, arrays: BatchArrays[torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query_start_loc, seq_lens, block_tables)``: int32, on the device, the tables
        ``[S, W]`` as wide as the batch's rows (the suite pads them to ``table_width``)."""
        if arrays is not None and self.device_resident:
            return arrays.query_start_loc, arrays.seq_lens, arrays.group_tables[group]
        if self._built is not None and self._built[0] is batch and self._built[1] == group:
            qsl, lens, tables = self._built[2]
            return qsl, lens, tables
        rows = batch.tables(group)
        width = max(1, max((len(r) for r in rows), default=0))
        padded = [list(r) + [-1] * (width - len(r)) for r in rows]
        built = (
            torch.tensor(batch.query_start_loc, dtype=torch.int32, device=self.device),
            torch.tensor(batch.seq_lens, dtype=torch.int32, device=self.device),
            torch.tensor(padded, dtype=torch.int32, device=self.device).reshape(-1, width),
        )
        self._built = (batch, group, built)
        return built

    def per_head(self, values: tuple[float, ...] | None) -> torch.Tensor | None:
        """Per-head sinks or ALiBi slopes as a float32 ``[H]`` device tensor."""
        if values is None:
            return None
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def scale_tensor(self, value: float) -> torch.Tensor:
        """A float32 ``[1]`` device tensor: how the engines hand a layer's KV scale to kernels."""
        return torch.tensor([value], dtype=torch.float32, device=self.device)


def refuse(reason: str | None, what: str) -> None:
    """Raise :class:`InvalidRequestError` for ``what`` when ``reason`` says it cannot run: the
    adapter refuses a call its kernel cannot run, rather than letting the kernel crash."""
    if reason:
        raise InvalidRequestError(f"{what}: {reason}")


_BY_MODULE: dict[str, dict[str, Reader]] = {}


def register_reader(kernel: str, module: str, reader: Reader) -> None:
    """Read launches of ``kernel`` defined in ``module`` with ``reader``.

    vLLM's decode kernels keep the names of the SGLang kernels they were adapted
    from (``_fwd_kernel_stage1``, ``_fwd_grouped_kernel_stage1``,
    ``_fwd_kernel_stage2``) but not their arguments, and the suite keys readers
    by kernel name: one dispatcher per name picks the reader of the launch's
    module (a module none registered reads as saying nothing).
    """
    _BY_MODULE.setdefault(kernel, {})[module] = reader

    def by_module(launch: Launch) -> Reading:
        chosen = _BY_MODULE[kernel].get(launch.module)
        return chosen(launch) if chosen is not None else Reading()

    register(kernel, by_module)


def no_path(launch: Launch) -> Reading:
    """A kernel that selects no path (a merge of partial results, a split-count kernel)."""
    return Reading()
