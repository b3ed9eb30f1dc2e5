"""The backend contract: what any implementation of paged KV memory and attention provides.

The spec decides (block tables, slot mappings, copy lists, batch metadata); a
backend executes those decisions on its own memory. This module is the one
place that says what "execute" means, so that the Triton backend, the eager
PyTorch backend, the spec itself (:class:`ReferenceBackend`) and any third
party's backend are interchangeable under the conformance suite and the engine.

Arrays cross the boundary as numpy ``float32`` (or ``float64``) so that a
backend in any framework can plug in (the default contract; a torch backend
may declare the device-resident one instead: see :class:`Backend`). Values
handed to a backend are already representable in its activation dtype (the
caller rounds them), so writing then reading back an unquantized cache must
return them bit for bit; an fp8 cache stores what :func:`spec.quant.quantize`
gives, and reading back returns those stored fp8 values (not multiplied by
the scale). A backend keeps its cache in
the layout ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, for
K and for V, or converts to it in :meth:`Backend.read_cache`.

>>> backend = ReferenceBackend()
>>> backend.create_cache(KVGeometry(num_layers=1, num_blocks=2, block_size=2,
...                                 num_kv_heads=1, head_dim=1))
>>> x = np.array([[[5.0]]], dtype=np.float32)
>>> backend.write_kv(0, x, x, slot_mapping=[3])
>>> backend.copy_blocks([(1, 0)])
>>> float(backend.read_cache(0)[0][0, 1, 0, 0])     # slot 3 is block 1, offset 1
5.0

**The latent layout** (multi-head latent attention, DeepSeek-V2/V3;
:attr:`KVGeometry.latent_dim`, declared in :attr:`Capabilities.latent`). A
layer holds one cache of rows ``[c_kv (latent_dim), k_rope (rope_dim)]``,
``head_dim = latent_dim + rope_dim`` wide, with one KV head and no separate V.
The same methods, with these shapes: :meth:`Backend.write_kv` takes ``key`` =
c_kv ``[T, 1, latent_dim]`` and ``value`` = k_rope ``[T, 1, rope_dim]``
(vLLM's ``kv_c`` and ``k_pe``) and stores their concatenation, c_kv first;
:meth:`Backend.read_cache` and ``read_blocks`` return that pair back, ``[N, B,
1, latent_dim]`` and ``[N, B, 1, rope_dim]``; :meth:`Backend.attention` takes
``query`` ``[T, H, head_dim]`` (each head ``[q_latent, q_rope]``) and returns
``[T, H, latent_dim]`` (:func:`spec.attention.attend_latent`), with the
model's scale as given. An fp8 latent cache has one scale a layer for the
whole row (``k_scale == v_scale``).

>>> mla = ReferenceBackend()
>>> mla.create_cache(KVGeometry(1, 2, 2, num_kv_heads=1, head_dim=3, latent_dim=2))
>>> c_kv, k_rope = np.array([[[1.0, 2.0]]]), np.array([[[9.0]]])
>>> mla.write_kv(0, c_kv, k_rope, slot_mapping=[1])
>>> [x[0, 1, 0].tolist() for x in mla.read_cache(0)]
[[1.0, 2.0], [9.0]]

**KV cache groups and fixed-size state.** A model whose layers sit in several
KV cache groups (:attr:`KVGeometry.layer_groups`, :mod:`spec.kv_groups`)
gives each layer its own group's view of the step: layer ``l`` of group
``g = geometry.group_of(l)`` is written through ``batch.slots(g)`` and reads
``batch.tables(g)``; a backend that supports this declares
:attr:`Capabilities.kv_groups`, and its kernels need no change. Every group's
block ids come from one pool, a block id being one group's at a time, so
:meth:`Backend.copy_blocks` copies on every layer and stays right. A
fixed-size state (linear attention, DeltaNet, Mamba) needs no paged kernel:
it lives with the engine, outside this contract; ``batch.state`` names each
row's state slot and the fork copies to make first, and a swap's ``state``
field its moves.

What a backend can run is declared, not discovered: its
:class:`~spec.capabilities.Capabilities` (:mod:`spec.capabilities`). The
cache's shape is a :class:`~spec.kv_geometry.KVGeometry`
(:mod:`spec.kv_geometry`). This module names both, so a backend imports
everything it needs from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from spec.attention import VARIANTS, AttentionVariant
from spec.attention_batched import paged_attention_batched
from spec.batch import BatchMetadata
from spec.capabilities import TENSOR_KINDS, Capabilities, Excludes
from spec.errors import ArgumentTypeError, InvalidRequestError
from spec.kv_geometry import DTYPE_BYTES, DTYPES, KV_DTYPES, KVGeometry, check_kv_values
from spec.kv_memory import KVMemory, check_slot_mapping
from spec.validate import check_int, check_scale

__all__ = [
    "DTYPES",
    "DTYPE_BYTES",
    "KV_DTYPES",
    "TENSOR_KINDS",
    "Backend",
    "Capabilities",
    "Excludes",
    "FloatArray",
    "KVGeometry",
    "ReferenceBackend",
]
"""The contract's names; the geometry and the capabilities are defined in
:mod:`spec.kv_geometry` and :mod:`spec.capabilities` and named here too."""

FloatArray = NDArray[np.floating]


@runtime_checkable
class Backend(Protocol):
    """Paged KV memory and attention, driven by the spec's decisions.

    The order within one step is: :meth:`copy_blocks` (the step's copy-on-write
    copies), then :meth:`write_kv` for the new tokens, then :meth:`attention`,
    layer by layer.

    Optional methods the suite uses when present: ``read_blocks(layer, blocks)``
    (K and V of just those blocks, ``[len(blocks), B, H_kv, D]`` each: lets the
    suite compare a large pool without copying all of it), and
    ``attention_path()`` (a short description of the internal path the last
    :meth:`attention` call took, such as "split-KV x4", printed in reports).

    **The device-resident contract** (``Capabilities.tensors == "torch"``;
    the numpy contract is the default, and unchanged). Arrays cross as torch
    tensors on ``Capabilities.device``, so a device-resident (or CUDA-graph)
    path is tested as it runs. Activation dtype means ``geometry.dtype``;
    ``T`` is the call's tokens, ``S`` its sequences.

    * ``write_kv(layer, key, value, slot_mapping)``: ``key``, ``value``
      ``[>= T, H_kv, D]`` of the activation dtype; ``slot_mapping`` ``[T]``
      int64 (``-1`` writes nothing).
    * ``copy_blocks(copies)``: as in the numpy contract (host pairs).
    * ``attention(layer, query, batch, scale, *, arrays, key, value)`` (and
      ``variant=`` as usual): ``query`` ``[T, H, D]`` of the activation
      dtype; ``batch`` the host :class:`~spec.batch.BatchMetadata` (host
      scalars for grid sizes; validation); ``arrays`` the same batch as
      ``batch.arrays()`` on the device (:class:`~spec.batch.BatchArrays`:
      int32 ``query_start_loc`` ``[S + 1]``, ``seq_lens`` ``[S]``,
      ``block_tables`` and ``group_tables[g]`` ``[S, W]``; int64
      ``slot_mapping``, ``group_slots[g]`` and ``positions`` ``[T]``,
      ``copies`` ``[n, 2]``), built once per step and shared by every layer;
      ``key``, ``value`` the call's new K and V, ``[T, H_kv, D]`` of the
      activation dtype, row ``t`` the token of query row ``t``. They are
      already written: an unquantized cache holds exactly these at their
      slots (a quantized one ``spec.quant.quantize`` of them), so an extend
      kernel may use them instead of reading those slots back. Returns
      ``[T, H, D]`` of the activation dtype on the device.
    * ``read_blocks(layer, blocks)`` is required: ``blocks`` a list of ids;
      K and V each ``[len(blocks), B, H_kv, D]`` of the cache dtype
      (``torch.float8_e4m3fn`` / ``float8_e5m2`` for fp8) on the device, in
      memory of their own (not views of the cache). It is the suite's only
      read, and it reads only the blocks it compares (those each step wrote
      or copied into, with their neighbours; the whole pool every few steps
      and at the end): no whole-cache copy per step. ``read_cache`` follows
      the same rules for every block.
    * Inputs are read-only: the step's metadata tensors are handed to every
      layer, so a backend must never change an input in place.
    * Latent layout: the shapes of the numpy contract's latent paragraph
      (module text) on the device: ``key``/``value`` of ``write_kv`` and of
      ``attention`` are c_kv ``[T, 1, latent_dim]`` and k_rope ``[T, 1,
      rope_dim]``, ``read_blocks`` returns that pair, and ``attention``
      returns ``[T, H, latent_dim]``.

    A return of the wrong kind, device, dtype or shape is a conformance
    failure naming what came back and what was expected
    (:mod:`conformance.judges.device_contract`).
    """

    @property
    def capabilities(self) -> Capabilities:
        """What this backend supports."""
        ...

    def create_cache(self, geometry: KVGeometry) -> None:
        """Allocate (and so discard any previous) KV cache of this geometry."""
        ...

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        """Write row ``i`` of ``key``/``value`` (``[>= T, H_kv, D]``) into slot ``slot_mapping[i]``.

        ``T = len(slot_mapping)``: rows past it are padding. Slot ``-1`` writes
        nothing. A quantized cache stores ``spec.quant.quantize(row, scale)``.
        Latent layout: ``key`` is c_kv ``[>= T, 1, latent_dim]``, ``value``
        k_rope ``[>= T, 1, rope_dim]``, stored as one row ``[c_kv, k_rope]``.
        """
        ...

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` onto ``dst``, K and V, every layer. No block is both."""
        ...

    def attention(
        self, layer: int, query: FloatArray, batch: BatchMetadata, scale: float
    ) -> FloatArray:
        """Paged causal attention for every token of ``batch``: ``[T, H, D]`` in and out
        (latent layout: ``[T, H, latent_dim + rope_dim]`` in, ``[T, H, latent_dim]`` out).

        A backend that declares :attr:`Capabilities.variants` also accepts a
        keyword ``variant`` (an :class:`~spec.attention.AttentionVariant`): it
        is passed only for a layer that uses one, so a plain call is unchanged.
        A layer of KV cache group ``g`` reads ``batch.tables(g)``.
        """
        ...

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        """This layer's K and V as ``[num_blocks, block_size, H_kv, D]`` float arrays (copies);
        latent layout: c_kv ``[.., 1, latent_dim]`` and k_rope ``[.., 1, rope_dim]``."""
        ...


class ReferenceBackend:
    """The spec itself as a backend: float64 :class:`KVMemory` and reference attention."""

    def __init__(self) -> None:
        self._memory: KVMemory | None = None
        self._geometry: KVGeometry | None = None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="reference",
            device="cpu",
            kv_dtypes=frozenset(KV_DTYPES),
            kv_groups=True,
            variants=frozenset(VARIANTS),
            latent=None,  # any (latent_dim, rope_dim)
        )

    def create_cache(self, geometry: KVGeometry) -> None:
        if not isinstance(geometry, KVGeometry):
            raise ArgumentTypeError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        g = geometry
        self._memory = KVMemory(
            g.num_layers,
            g.num_blocks,
            g.block_size,
            g.num_kv_heads,
            g.head_dim,
            kv_dtype=g.kv_dtype,
            kv_scales=g.kv_scales,
            latent_dim=g.latent_dim,
        )
        self._geometry = g

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        mem, k, v = self._mem(), _f64("key", key), _f64("value", value)
        slots = check_slot_mapping(slot_mapping, mem.num_slots)
        for name, x in (("key", k), ("value", v)):
            if x.ndim == 3 and x.shape[0] >= slots.shape[0]:  # KVMemory.write checks the shape
                check_kv_values(name, x, slots, self._geo())
        mem.write(layer, k, v, slot_mapping)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        self._mem().copy_blocks(copies)

    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        memory, group = self._mem(), self._geo().group_of(layer)
        q = _f64("query", query)
        scale = check_scale("scale", scale)  # the contract's scale is a number: None is no default
        return paged_attention_batched(q, batch, memory, layer, scale, variant=variant, group=group)

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        mem = self._mem()
        layer = check_int("layer", layer, low=0, high=mem.num_layers - 1)
        if mem.lazy:  # a pool past 2^31 elements: copying all of it is not an option
            raise InvalidRequestError(
                f"this cache holds {self._geo().num_elements} elements per layer: "
                "read it with read_blocks(layer, blocks)"
            )
        return mem.k[layer].copy(), mem.v[layer].copy()

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> tuple[FloatArray, FloatArray]:
        return self._mem().read_blocks(layer, blocks)

    def _mem(self) -> KVMemory:
        if self._memory is None:
            raise InvalidRequestError("create_cache() must be called first")
        return self._memory

    def _geo(self) -> KVGeometry:
        self._mem()
        assert self._geometry is not None
        return self._geometry


def _f64(name: str, x: object) -> NDArray[np.float64]:
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
        raise ArgumentTypeError(f"{name} must be a numpy float array, got {type(x).__name__}")
    return x.astype(np.float64)
