"""The spec's :class:`~spec.backend.Backend` on the Triton kernels of :mod:`backend_gpu.kernels`.

On CUDA the kernels compile; on CPU they run under Triton's interpreter, which
importing :mod:`backend_gpu` turns on when there is no CUDA. Metadata comes
from :class:`~spec.batch.BatchMetadata` (host tuples) and goes to the device as
the int32/int64 tensors the kernels take; the grid sizes come from the host
values, so no device read-back is needed beyond the wrappers' index checks.
Every attention variant and both fp8 KV dtypes are declared and run in the
kernels themselves (the KV write quantizes, attention dequantizes).

A latent geometry (multi-head latent attention) runs on its own kernels: the
row write of :mod:`backend_gpu.kernels.latent_write` and the absorbed
attention of :mod:`backend_gpu.kernels.latent_attention` (every variant, fp8,
split-KV), for latent parts up to 512 wide and rope parts up to 128.

Under the device-resident contract (``TritonBackend(tensors="torch")``, or
:func:`make_device_backend`) the kernels take the suite's tensors as they come:
the step's device metadata (``arrays=``) replaces the per-step conversion, and
outputs stay on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import backend_gpu  # noqa: F401  (sets TRITON_INTERPRET on CPU-only machines first)
from backend_gpu._cache import Returned, TorchCacheBackend
from backend_gpu.kernels import copy_blocks, paged_attention, reshape_and_cache
from backend_gpu.kernels.attention import MAX_HEAD_DIM
from backend_gpu.kernels.latent_attention import latent_limits, paged_latent_attention
from backend_gpu.kernels.latent_write import write_latent
from backend_gpu.kernels.plan import split_rule
from backend_gpu.kernels.target import launch_target
from spec.attention import VARIANTS, AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchArrays, BatchMetadata
from spec.capabilities import Capabilities, DecodeSplit
from spec.errors import ArgumentTypeError, InvalidRequestError
from spec.kv_geometry import DTYPES, KV_DTYPES, KVGeometry


def _latent_too_wide(geometry: KVGeometry, num_heads: int, variant: object) -> str | None:
    """The latent kernels' limit, as a capabilities veto: widths they are built for."""
    if geometry.latent_dim is None or geometry.rope_dim is None:
        return None
    limits = latent_limits(geometry.latent_dim, geometry.rope_dim)
    if limits is None:
        return None
    return f"latent layout {geometry.latent_dim}+{geometry.rope_dim} ({limits} only)"


def _decode_split(device: torch.device) -> DecodeSplit:
    """The kernels' split rule on ``device`` (:func:`~backend_gpu.kernels.plan.split_rule`),
    as the suite reads it: the launch plan of the GPU, or of the one the interpreter plays."""
    target = launch_target(device)
    rule = split_rule(target)
    where = target.name
    if target.num_sms is not None:
        where += f", while a call has under {2 * target.num_sms} programs"
    return DecodeSplit(rule.min_keys, rule.part_keys, rule.max_parts, note=where)


class TritonBackend(TorchCacheBackend):
    """Paged KV memory and unified paged attention on Triton kernels.

    ``num_splits`` forces the attention kernel's split-KV path (``> 1``) or the
    single pass (``1``); ``None`` lets its heuristic choose.
    """

    # The kernels' entry points, as attributes: a backend on another build of one of them (a
    # planted bug's copy, conformance.planted.kernel_bugs) replaces just that one.
    _paged_attention = staticmethod(paged_attention)
    _latent_attention = staticmethod(paged_latent_attention)
    _write_latent = staticmethod(write_latent)

    def __init__(
        self,
        device: str | torch.device | None = None,
        num_splits: int | None = None,
        *,
        tensors: str = "numpy",
    ) -> None:
        super().__init__(device, tensors=tensors)
        self.num_splits = num_splits
        self._metadata: tuple[BatchMetadata, dict[int, tuple[torch.Tensor, ...]]] | None = None
        self._per_head: dict[tuple[float, ...], torch.Tensor] = {}

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="triton",
            device=str(self.device),
            dtypes=frozenset(DTYPES),
            block_sizes=None,
            head_dims=frozenset(range(1, MAX_HEAD_DIM + 1)),
            max_gqa_ratio=None,
            kv_dtypes=frozenset(KV_DTYPES),
            variants=frozenset(VARIANTS),
            kv_groups=True,
            latent=None,  # any (latent_dim, rope_dim) the kernels are built for:
            excludes=_latent_too_wide,
            tensors=self.tensors,
            decode_split=None if self.num_splits is not None else _decode_split(self.device),
        )

    def create_cache(self, geometry: KVGeometry) -> None:
        if not isinstance(geometry, KVGeometry):
            raise ArgumentTypeError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        too_wide = _latent_too_wide(geometry, 1, None)
        if too_wide:
            raise InvalidRequestError(f"{too_wide}: not supported")
        if geometry.latent_dim is None and geometry.head_dim > MAX_HEAD_DIM:
            raise InvalidRequestError(f"head_dim {geometry.head_dim} > {MAX_HEAD_DIM}")
        super().create_cache(geometry)
        self._per_head.clear()

    def write_kv(
        self,
        layer: int,
        key: FloatArray | torch.Tensor,
        value: FloatArray | torch.Tensor,
        slot_mapping: Sequence[int] | torch.Tensor,
    ) -> None:
        k, v, slots, k_cache, v_cache = self._kv_inputs(layer, key, value, slot_mapping)
        cache = self._mem()
        k_scale, v_scale = cache.scales(layer)
        if cache.geometry.is_latent:  # one row [c_kv, k_rope] a token, one scale
            self._write_latent(
                c_kv=k, k_rope=v, cache=cache.rows[layer], slot_mapping=slots, check_slots=False,
                scale=k_scale,
            )  # fmt: skip
            return
        reshape_and_cache(
            k, v, k_cache, v_cache, slots, check_slots=False, k_scale=k_scale, v_scale=v_scale
        )

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        cache = self._mem()
        pairs = list(self._copies(copies))
        if cache.geometry.is_latent:  # the rows, as the one cache of each layer
            rows = [row.unsqueeze(2) for row in cache.rows]
            copy_blocks(rows, rows, pairs)  # copy_blocks takes K and V lists: each row twice
            return
        copy_blocks(cache.k, cache.v, pairs)

    def attention(
        self,
        layer: int,
        query: FloatArray | torch.Tensor,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
        arrays: BatchArrays[torch.Tensor] | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> Returned:
        q, k_cache, v_cache, scale, v = self._query_inputs(layer, query, batch, scale, variant)
        self._new_kv(batch, key, value)
        group = self._mem().geometry.group_of(layer)
        if arrays is not None and self.device_resident:  # the suite's tensors, as they come
            qsl, lens, tables = arrays.query_start_loc, arrays.seq_lens, arrays.group_tables[group]
        else:
            qsl, lens, tables = self._device_metadata(batch, group)
        k_scale, v_scale = self._mem().scales(layer)
        geometry = self._mem().geometry
        if geometry.latent_dim is not None:  # one cache of rows [c_kv, k_rope] a layer
            return self._returned(
                self._latent_attention(
                    q[: batch.num_tokens],
                    self._mem().rows[layer],
                    qsl,
                    lens,
                    tables,
                    scale,
                    latent_dim=geometry.latent_dim,
                    num_splits=self.num_splits,
                    max_query_len=batch.max_query_len,
                    max_seq_len=batch.max_seq_len,
                    window=v.window,
                    softcap=v.softcap,
                    sinks=self._head_tensor(v.sinks),
                    alibi_slopes=self._head_tensor(v.alibi_slopes),
                    kv_scale=k_scale,
                )
            )
        out = self._paged_attention(
            q[: batch.num_tokens],
            k_cache,
            v_cache,
            qsl,
            lens,
            tables,
            scale,
            num_splits=self.num_splits,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            window=v.window,
            softcap=v.softcap,
            sinks=self._head_tensor(v.sinks),
            alibi_slopes=self._head_tensor(v.alibi_slopes),
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return self._returned(out)

    def _head_tensor(self, values: tuple[float, ...] | None) -> torch.Tensor | None:
        """Per-head sinks or slopes as a float32 device tensor, made once per distinct tuple."""
        if values is None:
            return None
        if values not in self._per_head:
            self._per_head[values] = torch.tensor(values, dtype=torch.float32, device=self.device)
        return self._per_head[values]

    def _device_metadata(self, batch: BatchMetadata, group: int) -> tuple[torch.Tensor, ...]:
        """The batch's metadata as device tensors, built once per step (and KV cache group,
        whose tables a layer of that group reads), not once per layer."""
        if self._metadata is None or self._metadata[0] is not batch:
            self._metadata = (batch, {})
        built = self._metadata[1]
        if group not in built:
            dev = self.device
            built[group] = (
                torch.tensor(batch.query_start_loc, dtype=torch.int32, device=dev),
                torch.tensor(batch.seq_lens, dtype=torch.int32, device=dev),
                _tables(batch, dev, group),
            )
        return built[group]


def _tables(batch: BatchMetadata, device: torch.device, group: int = 0) -> torch.Tensor:
    """``[S, W]`` int32 block tables (``W >= 1`` so that an all-empty batch still has a row)."""
    width = max(1, max((len(t) for t in batch.tables(group)), default=0))
    rows = [list(t) + [-1] * (width - len(t)) for t in batch.tables(group)]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(batch.num_seqs, width)


def make_device_backend(device: str | torch.device | None = None) -> TritonBackend:
    """The Triton backend under the device-resident contract (``tensors="torch"``)."""
    return TritonBackend(device, tensors="torch")
