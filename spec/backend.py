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

What a backend can run is declared, not discovered: its :class:`Capabilities`.
The conformance suite draws only what is declared and lists the rest as
skipped. Everything new in a contract revision is off by default, so a backend
written against an earlier revision keeps working unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from spec.attention import VARIANTS, AttentionVariant, paged_attention
from spec.batch import BatchMetadata
from spec.errors import ArgumentTypeError, ArgumentValueError, InvalidRequestError
from spec.kv_memory import KVMemory, check_slot_mapping
from spec.quant import FP8_FORMATS, check_fp8_scale
from spec.validate import check_bool, check_choice, check_int, check_positive, check_scale

FloatArray = NDArray[np.floating]

DTYPES = ("float32", "float16", "bfloat16")
"""Activation dtypes the contract knows, by name (numpy has no bfloat16): the query and output,
and the cache itself unless it is quantized."""

KV_DTYPES = tuple(FP8_FORMATS)
"""Quantized KV cache dtypes: ``fp8_e4m3`` and ``fp8_e5m2`` (see :mod:`spec.quant`)."""

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}

DTYPE_MAX = {
    "float32": float(np.finfo(np.float32).max),
    "float16": float(np.finfo(np.float16).max),
    "bfloat16": float.fromhex("0x1.fep127"),
}
"""The largest finite value of each activation dtype (numpy has no bfloat16: its bits, by hand)."""

TENSOR_KINDS = ("numpy", "torch")
"""How arrays cross the boundary: numpy on the host (the default), or torch tensors on the
backend's device (the device-resident contract: see :class:`Backend`)."""


def check_kv_values(
    name: str, x: NDArray[np.floating], slots: NDArray[np.int64], geometry: KVGeometry
) -> None:
    """The rows of new K (or V) that a write stores fit the cache: one rule for every backend.

    An unquantized cache holds the activation dtype, so a finite value beyond
    that dtype's largest (:data:`DTYPE_MAX`: 1e6 into a float16 cache) is
    refused with :class:`~spec.errors.ArgumentValueError`: stored, it would
    become infinity without a word. Rows of padding slots, and rows past the
    slot mapping, are not stored and not checked; infinities and NaN are
    values of the dtype and pass. A quantized (fp8) cache does not refuse: it
    saturates, as :func:`spec.quant.quantize` defines.

    >>> g = KVGeometry(1, 2, 2, 1, 1, dtype="float16")
    >>> check_kv_values("key", np.array([[[7e4]], [[1.0]]]), np.array([-1, 0]), g)  # pad: unread
    >>> check_kv_values("key", np.array([[[1.0]], [[7e4]]]), np.array([-1, 0]), g)
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    spec.errors.ArgumentValueError: key[1] holds 70000.0, beyond float16's largest finite value ...
    """
    if geometry.kv_dtype is not None:
        return
    top = DTYPE_MAX[geometry.dtype]
    rows = np.asarray(x[: slots.shape[0]])
    stored = (slots != -1).reshape((-1,) + (1,) * (rows.ndim - 1))
    with np.errstate(invalid="ignore"):
        too_big = stored & np.isfinite(rows) & (np.abs(rows) > top)
    if too_big.any():
        where = tuple(int(i) for i in np.argwhere(too_big)[0])
        raise ArgumentValueError(
            f"{name}[{where[0]}] holds {float(rows[where])}, beyond {geometry.dtype}'s largest "
            f"finite value {top}: the cache would store it as infinity"
        )


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a KV cache: ``num_layers`` x (K, V) x ``[num_blocks, block_size, H_kv, D]``.

    ``dtype`` is the activation dtype. ``kv_dtype`` (``None``, or one of
    :data:`KV_DTYPES`) quantizes the cache, with ``kv_scales[layer] =
    (k_scale, v_scale)``. ``layer_groups[layer]`` is the KV cache group whose
    block tables and slots the layer uses (:meth:`BatchMetadata.tables`);
    empty means every layer is in group 0.
    """

    num_layers: int  # layers that keep K and V
    num_blocks: int  # blocks in each layer's K (and V) cache
    block_size: int  # tokens per block (B)
    num_kv_heads: int  # KV heads (H_kv); query heads are a multiple
    head_dim: int  # elements per head (D)
    dtype: str = "float32"  # the activations' dtype (queries, new K and V, outputs)
    kv_dtype: str | None = None  # None: the cache stores ``dtype``; else an fp8 format
    kv_scales: tuple[tuple[float, float], ...] = ()  # per layer (k_scale, v_scale), fp8 only
    layer_groups: tuple[int, ...] = ()  # each layer's KV cache group; empty: all in group 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            check_positive(name, getattr(self, name))
        check_choice("dtype", self.dtype, DTYPES)
        if self.kv_dtype is not None:
            check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
            if len(self.kv_scales) != self.num_layers:
                raise ArgumentValueError(
                    f"kv_scales must hold one (k_scale, v_scale) per layer ({self.num_layers}), "
                    f"got {len(self.kv_scales)}"
                )
            for i, pair in enumerate(self.kv_scales):
                if not isinstance(pair, tuple) or len(pair) != 2:
                    raise ArgumentTypeError(f"kv_scales[{i}] must be a (k_scale, v_scale) tuple")
                for j, s in enumerate(pair):
                    check_fp8_scale(f"kv_scales[{i}][{j}]", s)
        elif self.kv_scales:
            raise ArgumentValueError("kv_scales are only for a quantized kv_dtype")
        if self.layer_groups:
            if len(self.layer_groups) != self.num_layers:
                raise ArgumentValueError(
                    f"layer_groups must name a group for each of {self.num_layers} layers, "
                    f"got {len(self.layer_groups)}"
                )
            used = {
                check_int(f"layer_groups[{i}]", g, low=0) for i, g in enumerate(self.layer_groups)
            }
            if used != set(range(len(used))):
                raise ArgumentValueError(f"layer_groups must number groups 0..G-1: {sorted(used)}")

    @property
    def cache_dtype(self) -> str:
        """What the cache stores: ``kv_dtype`` if quantized, else ``dtype``."""
        return self.kv_dtype or self.dtype

    @property
    def num_groups(self) -> int:
        return 1 + max(self.layer_groups, default=0)

    def group_of(self, layer: int) -> int:
        """The KV cache group of ``layer``."""
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        return self.layer_groups[layer] if self.layer_groups else 0

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across every layer."""
        per = DTYPE_BYTES[self.cache_dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * per

    @property
    def num_elements(self) -> int:
        """Elements of one layer's K (or V) cache: offsets into it must not be computed in int32."""
        return self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim


Excludes = Callable[[KVGeometry, int, AttentionVariant | None], str | None]
"""A backend's own rule for combinations it cannot run: geometry, query heads and a layer's
variant in, the reason out (``None`` when it can run them)."""


def _names(label: str, values: Iterable[str], known: Sequence[str]) -> frozenset[str]:
    out = frozenset(values)
    unknown = sorted(out - set(known))
    if unknown:
        raise ArgumentValueError(f"capabilities.{label}: unknown {unknown}; known: {list(known)}")
    return out


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports. The conformance suite skips, and reports, the rest.

    ``None`` for a set or a limit means "any value". Sets are stored as frozensets.

    * Numbers: ``dtypes`` (activation dtypes), ``kv_dtypes`` (quantized caches).
    * Shapes: ``block_sizes``, ``head_dims``, ``num_kv_heads``, ``gqa_ratios``
      (query heads per KV head), ``max_gqa_ratio``.
    * Batches: ``max_num_seqs`` per call; ``max_query_len`` (1 for a
      decode-only kernel); ``max_context_len`` (``seq_len``); ``decode``
      (one new token after cached context); ``chunked_prefill`` (several new
      tokens after cached context); ``mixed_batches`` (single- and multi-token
      queries in one call).
    * Memory: ``copy_on_write`` (fork rules), ``prefix_caching`` (prefix hits),
      ``kv_groups`` (layers in several KV cache groups, one table each).
    * ``speculative``: multi-token decode rows (:mod:`spec.speculative`): the
      last verified token and ``k`` drafts after cached context, causal among
      themselves, whose rejected K/V stays in the cache past ``seq_len`` after
      a rollback and must never be read. The suite drafts ``k <=
      max_query_len - 1`` tokens, and only when ``chunked_prefill`` is true
      too (a row of ``1 + k`` tokens after context is that kind of query).
    * Attention: ``variants``, a subset of :data:`spec.attention.VARIANTS`.
    * ``tensors``: ``"numpy"`` (the default contract) or ``"torch"``.
    * ``excludes``: the backend's own veto for combinations the fields above
      cannot say (a head dim only in some dtypes, say).
    """

    name: str  # how reports name the backend
    device: str = "cpu"  # where its arrays live ("cpu", "cuda", ...)
    dtypes: AbstractSet[str] = frozenset(DTYPES)  # activation dtypes it runs
    kv_dtypes: AbstractSet[str] = frozenset()  # quantized KV dtypes it stores (empty: none)
    block_sizes: AbstractSet[int] | None = None  # None: any
    head_dims: AbstractSet[int] | None = None  # None: any
    num_kv_heads: AbstractSet[int] | None = None  # None: any
    gqa_ratios: AbstractSet[int] | None = None  # query heads per KV head; None: any
    max_gqa_ratio: int | None = None  # None: no limit
    max_num_seqs: int | None = None  # sequences in one call; None: no limit
    max_query_len: int | None = None  # new tokens of one sequence; 1: decode-only
    max_context_len: int | None = None  # ``seq_len`` of one sequence; None: no limit
    decode: bool = True  # one new token after cached context
    chunked_prefill: bool = True  # several new tokens after cached context
    mixed_batches: bool = True  # single- and multi-token queries in one call
    copy_on_write: bool = True  # the fork rules: shared blocks, the step's copies
    prefix_caching: bool = True  # sequences that start on prefix-cache hits
    kv_groups: bool = False  # layers in several KV cache groups, one table each
    speculative: bool = True  # multi-token decode rows (1 + k tokens), rolled back after
    variants: AbstractSet[str] = frozenset()  # of spec.attention.VARIANTS
    tensors: str = "numpy"  # "numpy" (the default contract) or "torch"
    excludes: Excludes | None = field(default=None, compare=False, repr=False)  # its own veto

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ArgumentTypeError(f"capabilities.name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.device, str):
            raise ArgumentTypeError(f"capabilities.device must be a str, got {self.device!r}")
        put = object.__setattr__  # frozen: normalise in place, once
        put(self, "dtypes", _names("dtypes", self.dtypes, DTYPES))
        put(self, "kv_dtypes", _names("kv_dtypes", self.kv_dtypes, KV_DTYPES))
        put(self, "variants", _names("variants", self.variants, VARIANTS))
        for name in ("block_sizes", "head_dims", "num_kv_heads", "gqa_ratios"):
            values = getattr(self, name)
            if values is not None:
                put(
                    self, name, frozenset(check_positive(f"capabilities.{name}", v) for v in values)
                )
        for name in ("max_gqa_ratio", "max_num_seqs", "max_query_len", "max_context_len"):
            if getattr(self, name) is not None:
                check_positive(f"capabilities.{name}", getattr(self, name))
        for f in fields(self):
            if f.type == "bool":
                check_bool(f"capabilities.{f.name}", getattr(self, f.name))
        check_choice("capabilities.tensors", self.tensors, TENSOR_KINDS)
        if self.excludes is not None and not callable(self.excludes):
            raise ArgumentTypeError("capabilities.excludes must be callable or None")

    def unsupported(
        self, geometry: KVGeometry, num_heads: int, variant: AttentionVariant | None = None
    ) -> list[str]:
        """Why this backend cannot run ``geometry`` with ``num_heads`` query heads; [] if it can."""
        g = geometry
        ratio = num_heads // g.num_kv_heads
        checks = [
            (g.dtype in self.dtypes, f"dtype {g.dtype}"),
            (g.kv_dtype is None or g.kv_dtype in self.kv_dtypes, f"KV dtype {g.kv_dtype}"),
            (_allows(self.block_sizes, g.block_size), f"block size {g.block_size}"),
            (_allows(self.head_dims, g.head_dim), f"head dim {g.head_dim}"),
            (_allows(self.num_kv_heads, g.num_kv_heads), f"{g.num_kv_heads} KV heads"),
            (_allows(self.gqa_ratios, ratio), f"GQA ratio {ratio}"),
            (self.max_gqa_ratio is None or ratio <= self.max_gqa_ratio, f"GQA ratio {ratio}"),
            (g.num_groups == 1 or self.kv_groups, f"{g.num_groups} KV cache groups"),
        ]
        if variant is not None:
            for name in sorted(variant.features - self.variants):
                checks.append((False, f"attention variant {name}"))
        reasons = list(dict.fromkeys(why for ok, why in checks if not ok))
        if not reasons and self.excludes is not None:
            veto = self.excludes(geometry, num_heads, variant)
            if veto:
                reasons.append(str(veto))
        return reasons

    def query_unsupported(self, query_len: int, context_len: int) -> str | None:
        """Why one sequence's query (``query_len`` new tokens after ``context_len``) cannot run."""
        if self.max_query_len is not None and query_len > self.max_query_len:
            return f"a query of {query_len} tokens (max_query_len {self.max_query_len})"
        seq_len = query_len + context_len
        if self.max_context_len is not None and seq_len > self.max_context_len:
            return f"a context of {seq_len} tokens (max_context_len {self.max_context_len})"
        if context_len and query_len == 1 and not self.decode:
            return "a decode (decode is False)"
        if context_len and query_len > 1 and not self.chunked_prefill:
            return "a prefill chunk after cached context (chunked_prefill is False)"
        return None

    def batch_unsupported(self, batch: BatchMetadata) -> str | None:
        """Why this backend cannot run ``batch`` in one call; ``None`` when it can."""
        if self.max_num_seqs is not None and batch.num_seqs > self.max_num_seqs:
            return f"{batch.num_seqs} sequences in one call (max_num_seqs {self.max_num_seqs})"
        lens = [batch.query_len(i) for i in range(batch.num_seqs)]
        if not self.mixed_batches and lens and min(lens) == 1 < max(lens):
            return "single- and multi-token queries in one call (mixed_batches is False)"
        for i, n in enumerate(lens):
            why = self.query_unsupported(n, batch.seq_lens[i] - n)
            if why:
                return why
        return None


def _allows(declared: AbstractSet[int] | None, value: int) -> bool:
    return declared is None or value in declared


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
        """
        ...

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` onto ``dst``, K and V, every layer. No block is both."""
        ...

    def attention(
        self, layer: int, query: FloatArray, batch: BatchMetadata, scale: float
    ) -> FloatArray:
        """Paged causal attention for every token of ``batch``: ``[T, H, D]`` in and out.

        A backend that declares :attr:`Capabilities.variants` also accepts a
        keyword ``variant`` (an :class:`~spec.attention.AttentionVariant`): it
        is passed only for a layer that uses one, so a plain call is unchanged.
        A layer of KV cache group ``g`` reads ``batch.tables(g)``.
        """
        ...

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        """This layer's K and V as ``[num_blocks, block_size, H_kv, D]`` float arrays (copies)."""
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
        return paged_attention(q, batch, memory, layer, scale, variant=variant, group=group)

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
