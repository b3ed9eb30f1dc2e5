"""KV cache storage shared by the torch-based backends, and the numpy <-> torch boundary.

The spec's :class:`~spec.backend.Backend` contract passes numpy float arrays;
these backends keep one K and one V tensor per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` in the geometry's cache
dtype on one device, filled with NaN at creation exactly like
:class:`spec.kv_memory.KVMemory`, so a read of a slot nobody wrote is visible,
and ``read_cache`` of both agree. A quantized cache (``kv_dtype``) is a
``torch.float8_e4m3fn`` / ``float8_e5m2`` tensor holding the stored fp8 values,
which ``read_cache`` returns as they are (not times the scale).

Both contracts of :mod:`spec.backend` are served here: ``tensors="numpy"``
(the default: numpy in, float32 numpy copies out) and ``tensors="torch"``
(the device-resident contract: tensors of the activation dtype and int64
slots on this backend's device in, tensors out, each checked for kind,
device, dtype and shape before use, and never written to).

A latent geometry (:attr:`spec.kv_geometry.KVGeometry.latent_dim`) keeps one
tensor of rows ``[num_blocks, block_size, latent_dim + rope_dim]`` a layer
(``rows``), as vLLM's MLA cache does; ``k`` and ``v`` are then views of its
c_kv and k_rope columns, ``[num_blocks, block_size, 1, latent_dim]`` and
``[.., 1, rope_dim]``, so writes, copies and reads through them are the
contract's, and the kernels read the rows.

A pool of more than :data:`spec.kv_memory.LAZY_ELEMENTS` elements per layer is
allocated with ``torch.empty`` instead: filling it would touch every page (4 GiB
for a pool past 2^31 fp16 elements), while an untouched CPU allocation costs no
resident memory. Its unwritten slots hold whatever the allocator gives; the
conformance suite writes every block it compares first, and reads such a pool
with ``read_blocks``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from backend_gpu.dtypes import FP8_TORCH, TORCH_DTYPES
from spec.attention import PLAIN, AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchMetadata, check_copies
from spec.capabilities import TENSOR_KINDS
from spec.errors import ArgumentTypeError, ArgumentValueError, InvalidRequestError
from spec.kv_geometry import KVGeometry, check_kv_values
from spec.kv_memory import LAZY_ELEMENTS, check_slot_mapping
from spec.validate import check_choice, check_instance, check_int, check_ints, check_scale

Returned = Any
"""What a method returns: float32 numpy copies (numpy contract) or device tensors (device
contract). ``Any`` because :class:`spec.backend.Backend`'s annotations spell the numpy contract
(spec imports no torch), and these classes must satisfy it under both."""


def default_device() -> torch.device:
    """CUDA when there is one and kernels compile; CPU under Triton's interpreter (which runs
    only on CPU tensors, on a machine with a GPU too) or without CUDA."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _ON
    return torch.device("cuda" if torch.cuda.is_available() and not interpreted else "cpu")


_ON = ("1", "true", "yes", "on")


def check_fits(geometry: KVGeometry, needed: int, device: torch.device) -> None:
    """Refuse, before allocating, a pool of ``needed`` bytes that ``device`` cannot hold: more
    than its memory (a GPU's), or than the machine's memory and swap (the CPU's, where an
    untouched lazy pool still needs its addresses). :class:`~spec.errors.InvalidRequestError`
    names the bytes and the geometry; torch's own error would name neither."""
    have = device_memory(device)
    if have is not None and needed > have:
        raise InvalidRequestError(
            f"the geometry's pool needs {needed:,} bytes on {device}, which has {have:,}: "
            f"refused before allocating ({geometry})"
        )


def device_memory(device: torch.device) -> int | None:
    """The bytes ``device`` can hold at most (``None``: unknown, nothing is refused)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))
    except (OSError, KeyError, ValueError):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size if pages > 0 and size > 0 else None


def _itemsize(dtype: torch.dtype) -> int:
    return int(torch.empty((), dtype=dtype).element_size())


class TorchKVCache:
    """Per-layer K and V tensors of one geometry, plus conversions at the numpy boundary."""

    def __init__(self, geometry: KVGeometry, device: torch.device) -> None:
        g = geometry
        shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        self.geometry = g
        self.device = device
        self.dtype = TORCH_DTYPES[g.dtype]  # the activation dtype: queries, new K and V, outputs
        self.cache_dtype = FP8_TORCH[g.kv_dtype] if g.kv_dtype else self.dtype
        self.rows: list[torch.Tensor] = []  # latent: each layer's one cache of rows
        tensors = g.num_layers if g.latent_dim is not None else 2 * g.num_layers
        per_tensor = g.num_blocks * g.block_size * g.num_kv_heads * g.head_dim
        check_fits(g, tensors * per_tensor * _itemsize(self.cache_dtype), device)
        if g.latent_dim is not None:
            self.rows = [self._nans(shape[:2] + shape[3:]) for _ in range(g.num_layers)]
            self.k = [row.unsqueeze(2)[..., : g.latent_dim] for row in self.rows]  # c_kv views
            self.v = [row.unsqueeze(2)[..., g.latent_dim :] for row in self.rows]  # k_rope views
        else:
            self.k = [self._nans(shape) for _ in range(g.num_layers)]
            self.v = [self._nans(shape) for _ in range(g.num_layers)]

    @property
    def storage(self) -> list[torch.Tensor]:
        """The tensors that hold the cache: each layer's rows (latent), or its K and V."""
        return self.rows if self.geometry.is_latent else [*self.k, *self.v]

    def _nans(self, shape: tuple[int, ...]) -> torch.Tensor:
        """NaN-filled storage, or uninitialised (lazy) storage for a pool too large to fill."""
        if self.geometry.num_elements > LAZY_ELEMENTS:
            return torch.empty(shape, dtype=self.cache_dtype, device=self.device)
        return torch.full(shape, float("nan"), dtype=self.cache_dtype, device=self.device)

    def scales(self, layer: int) -> tuple[float, float]:
        """This layer's ``(k_scale, v_scale)``; ``(1.0, 1.0)`` for an unquantized cache."""
        g = self.geometry
        return g.kv_scales[layer] if g.kv_dtype else (1.0, 1.0)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V tensors (the live storage, not copies); ``True`` is not layer 1."""
        layer = check_int("layer", layer)
        if not 0 <= layer < self.geometry.num_layers:
            raise InvalidRequestError(f"layer {layer} is outside 0..{self.geometry.num_layers - 1}")
        return self.k[layer], self.v[layer]

    def tensor(
        self, name: str, x: object, min_rows: int, heads: int, width: int | None = None
    ) -> torch.Tensor:
        """``x`` (numpy ``[>= min_rows, heads, width]``, ``width`` the head dim unless given) in
        the activation dtype, on the device."""
        d = self.geometry.head_dim if width is None else width
        if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
            raise InvalidRequestError(f"{name} must be a numpy float array, got {type(x).__name__}")
        if x.ndim != 3 or x.shape[0] < min_rows or x.shape[1:] != (heads, d):
            raise InvalidRequestError(
                f"{name} has shape {x.shape}, expected [>= {min_rows}, {heads}, {d}]"
            )
        with np.errstate(over="ignore"):  # a value that overflows a written row is refused later
            host = torch.from_numpy(np.array(x, dtype=np.float32))  # our copy: inputs are read-only
        return host.to(device=self.device, dtype=self.dtype)

    def device_tensor(
        self,
        name: str,
        x: object,
        min_rows: int,
        heads: int,
        exact_rows: bool = False,
        width: int | None = None,
    ) -> torch.Tensor:
        """``x`` as the device contract hands it: ``[>= min_rows, heads, width]`` (exactly
        ``min_rows`` if ``exact_rows``; ``width`` the head dim unless given), the activation
        dtype, on this device. Not copied."""
        d = self.geometry.head_dim if width is None else width
        t = self._on_device(name, x, self.dtype)
        rows_ok = t.shape[0] == min_rows if exact_rows else t.shape[0] >= min_rows
        if t.ndim != 3 or not rows_ok or tuple(t.shape[1:]) != (heads, d):
            want = f"[{'' if exact_rows else '>= '}{min_rows}, {heads}, {d}]"
            raise InvalidRequestError(f"{name} has shape {tuple(t.shape)}, expected {want}")
        return t

    def slots(self, slot_mapping: object) -> tuple[torch.Tensor, NDArray[np.int64] | None]:
        """The slot mapping as int64 on the device (and on the host, when it came from there).

        The spec's rule (:func:`spec.kv_memory.check_slot_mapping`): ints only,
        each a slot of the pool or ``-1``, no slot twice. A tensor (the device
        contract) must already be int64 on this device; it is checked there.
        """
        num_slots = self.geometry.num_blocks * self.geometry.block_size
        if isinstance(slot_mapping, torch.Tensor):
            t = self._on_device("slot_mapping", slot_mapping, torch.int64).reshape(-1)
            bad_t = (t != -1) & ((t < 0) | (t >= num_slots))
            if bool(bad_t.any()):
                i = int(torch.nonzero(bad_t)[0, 0])
                raise ArgumentValueError(
                    f"slot_mapping[{i}] is {int(t[i])}: slot {int(t[i])} is outside "
                    f"0..{num_slots - 1} (and is not -1, the padding slot)"
                )
            used = t[t != -1]
            if int(torch.unique(used).numel()) != int(used.numel()):
                check_slot_mapping(t.cpu().tolist(), num_slots)  # names the repeated slot
            return t, None
        slots = check_slot_mapping(slot_mapping, num_slots)
        return torch.from_numpy(slots).to(self.device), slots

    def _on_device(self, name: str, x: object, dtype: torch.dtype) -> torch.Tensor:
        """``x``, checked to be a tensor of ``dtype`` on this device (the device contract)."""
        if not isinstance(x, torch.Tensor):
            raise InvalidRequestError(
                f"{name} must be a torch.Tensor under the device contract, got {type(x).__name__}"
            )
        if x.device.type != self.device.type or (
            self.device.index is not None and x.device.index != self.device.index
        ):
            raise InvalidRequestError(f"{name} is on {x.device}, expected {self.device}")
        if x.dtype != dtype:
            raise InvalidRequestError(f"{name} is {x.dtype}, expected {dtype}")
        return x

    def check_batch(self, batch: BatchMetadata) -> None:
        """The batch was laid out for this cache's block size (not, say, the manager's)."""
        if batch.block_size != self.geometry.block_size:
            raise InvalidRequestError(
                f"batch block size {batch.block_size} differs from the cache's "
                f"{self.geometry.block_size}"
            )

    def read(self, layer: int) -> tuple[FloatArray, FloatArray]:
        """This layer's K and V as float32 numpy copies (exact for every cache dtype)."""
        k, v = self.layer(layer)
        return to_numpy(k), to_numpy(v)

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> tuple[FloatArray, FloatArray]:
        """K and V of just ``blocks`` (``[len(blocks), B, H_kv, D]``), without copying the pool."""
        k, v = self.blocks(layer, blocks)
        return to_numpy(k), to_numpy(v)

    def blocks(self, layer: int, blocks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of just ``blocks`` as new tensors on the device, in the cache dtype."""
        k, v = self.layer(layer)
        ids = check_ints("blocks", blocks, low=0, high=self.geometry.num_blocks - 1)
        index = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return k[index], v[index]  # advanced indexing: copies, never views


class TorchCacheBackend:
    """What the torch-based backends share: the cache they hold and the numpy boundary.

    Subclasses compute; this class only converts and checks their inputs.
    ``tensors`` is the contract they serve (:data:`spec.capabilities.TENSOR_KINDS`),
    which their capabilities declare.
    """

    def __init__(self, device: str | torch.device | None = None, *, tensors: str = "numpy") -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self.tensors = check_choice("tensors", tensors, TENSOR_KINDS)
        self._cache: TorchKVCache | None = None

    def create_cache(self, geometry: KVGeometry) -> None:
        """A new cache of ``geometry``; refused (the old cache kept) if it is not a geometry or
        its pool cannot fit this backend's device (:func:`check_fits`)."""
        g = check_instance("geometry", geometry, KVGeometry)
        self._cache = TorchKVCache(g, self.device)

    @property
    def device_resident(self) -> bool:
        """Whether this backend serves the device contract (``tensors="torch"``)."""
        return self.tensors == "torch"

    def read_cache(self, layer: int) -> Returned:
        if self.device_resident:
            k, v = self._mem().layer(layer)
            return k.clone(), v.clone()
        return self._mem().read(layer)

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> Returned:
        if self.device_resident:
            return self._mem().blocks(layer, blocks)
        return self._mem().read_blocks(layer, blocks)

    def _mem(self) -> TorchKVCache:
        if self._cache is None:
            raise InvalidRequestError("create_cache() must be called first")
        return self._cache

    def _kv_inputs(
        self, layer: int, key: object, value: object, slot_mapping: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k, v, slots, k_cache, v_cache)`` for a KV write, every argument checked first.

        The slots by the spec's rule, the shapes, and (numpy contract) the values
        by :func:`spec.backend.check_kv_values`: a value the cache's dtype cannot
        hold is refused, not stored as infinity. Nothing is written before all pass.
        """
        cache = self._mem()
        k_cache, v_cache = cache.layer(layer)
        slots, host_slots = cache.slots(slot_mapping)
        n, h = slots.shape[0], cache.geometry.num_kv_heads
        (k_name, k_width), (v_name, v_width) = kv_names(cache.geometry)
        if self.device_resident:
            k = cache.device_tensor(k_name, key, n, h, width=k_width)
            v = cache.device_tensor(v_name, value, n, h, width=v_width)
        else:
            k, v = (
                cache.tensor(k_name, key, n, h, k_width),
                cache.tensor(v_name, value, n, h, v_width),
            )
        if host_slots is not None:  # the numpy contract: the values, checked on the host
            for name, x in ((k_name, key), (v_name, value)):
                assert isinstance(x, np.ndarray)  # cache.tensor checked it
                check_kv_values(name, x, host_slots, cache.geometry)
        return k, v, slots, k_cache, v_cache

    def _copies(self, copies: object) -> tuple[tuple[int, int], ...]:
        """A copy list by the spec's rule (:func:`spec.batch.check_copies`): int block ids of
        the pool (not ``1.7``, ``'3'`` or ``True``), independent of their order."""
        if isinstance(copies, str | bytes) or not isinstance(copies, Sequence):
            raise ArgumentTypeError(
                f"copies must be a sequence of (src, dst) pairs, got {copies!r}"
            )
        return check_copies(copies, self._mem().geometry.num_blocks)

    def _query_inputs(
        self, layer: int, query: object, batch: object, scale: object, variant: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, AttentionVariant]:
        """``(q, k_cache, v_cache, scale, variant)`` for attention, every argument checked.

        The batch by the check every backend relies on
        (:meth:`spec.batch.BatchMetadata.validate`, remembered per batch: free
        on later layers), the scale finite and positive, the variant an
        :class:`~spec.attention.AttentionVariant` (``None``: plain), before any work.
        """
        cache = self._mem()
        k_cache, v_cache = cache.layer(layer)
        batch = check_instance("batch", batch, BatchMetadata)
        cache.check_batch(batch)
        batch.validate(cache.geometry.num_blocks)
        scale = check_scale("scale", scale)
        variant = PLAIN if variant is None else check_instance("variant", variant, AttentionVariant)
        q = self._query(query, batch)
        variant.check_heads(q.shape[1])
        return q, k_cache, v_cache, scale, variant

    def _query(self, query: object, batch: BatchMetadata) -> torch.Tensor:
        """The query as a tensor on the device: ``[>= num_tokens, H, head_dim]``."""
        cache = self._mem()
        latent = cache.geometry.latent_dim
        name = "query" if latent is None else "query ([q_latent, q_rope] a head)"
        if self.device_resident:
            heads = query.shape[1] if isinstance(query, torch.Tensor) and query.ndim == 3 else -1
            return cache.device_tensor(name, query, batch.num_tokens, heads)
        heads = query.shape[1] if isinstance(query, np.ndarray) and query.ndim == 3 else -1
        return cache.tensor(name, query, batch.num_tokens, heads)

    def _new_kv(self, batch: BatchMetadata, key: object, value: object) -> None:
        """The device contract's ``key=``/``value=`` of attention: ``[T, H_kv, D]`` when given
        (latent: c_kv ``[T, 1, latent_dim]`` and k_rope ``[T, 1, rope_dim]``)."""
        if not self.device_resident or (key is None and value is None):
            return
        cache = self._mem()
        for (name, width), x in zip(kv_names(cache.geometry), (key, value), strict=True):
            h = cache.geometry.num_kv_heads
            cache.device_tensor(name, x, batch.num_tokens, h, True, width=width)

    def _returned(self, out: torch.Tensor) -> Returned:
        """An output in the contract served: a float32 numpy copy, or the tensor itself."""
        return out if self.device_resident else to_numpy(out)


def kv_names(geometry: KVGeometry) -> tuple[tuple[str, int], tuple[str, int]]:
    """How a KV write's ``key`` and ``value`` are named in errors, and their widths.

    >>> kv_names(KVGeometry(1, 2, 2, num_kv_heads=1, head_dim=6, latent_dim=4))
    (('key (c_kv)', 4), ('value (k_rope)', 2))
    """
    k_width, v_width = geometry.kv_widths
    if geometry.latent_dim is None:
        return ("key", k_width), ("value", v_width)
    return ("key (c_kv)", k_width), ("value (k_rope)", v_width)


def to_numpy(x: torch.Tensor) -> FloatArray:
    """A float32 numpy copy of ``x`` (float16, bfloat16 and fp8 widen exactly)."""
    out: FloatArray = x.detach().to(device="cpu", dtype=torch.float32).numpy().copy()
    return out
