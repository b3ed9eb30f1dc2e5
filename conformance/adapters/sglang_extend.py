"""SGLang 0.5.23's Triton extend kernel, as SGLang's Triton attention backend calls it.

``attention`` is ``extend_attention_fwd`` with the arguments of
``TritonAttnBackend.forward_extend`` (``sglang/srt/layers/attention/triton_backend.py``):
the new tokens' queries, keys and values (``q_extend``, ``k_extend``,
``v_extend``, in the activation dtype: the engine clones K and V before the
cache write quantizes them), the cache for the prefix, token-level
``kv_indptr``/``kv_indices`` of each sequence's cached prefix (a window
layer's: its last ``w - 1`` prefix tokens, with ``sliding_window_size = w - 1``),
``qo_indptr``, ``is_causal=True``, no custom mask, ``logit_cap``, ``sinks`` and
the layer's fp8 scales. SGLang's mixed chunked prefill runs decodes through
this kernel too, as one-token extends, so it takes every batch the suite draws.
Under the device-resident contract the new K and V come with the call
(``key=``/``value=``); under the numpy contract they are the rows of the
layer's last ``write_kv``, which wrote this batch's slots.

What it declares, and the kernel's lines that say so:

* ``dtypes`` all three, ``kv_dtypes`` both fp8 formats, any block size
  (token slots), head dims any but under 16 only without GQA (``tl.dot``).
* ``products="tf32"``: ``qk = tl.dot(q.to(k.dtype), k)`` over the prefix and
  ``qk = tl.dot(q, k, out_dtype=tl.float32)`` over the chunk, then
  ``tl.dot(p.to(v.dtype), v)``, at the default precision. With an fp8 cache
  the prefix product casts Q and P to fp8 (``q.to(k.dtype)``,
  ``p.to(v.dtype)``) while the chunk's own keys are read unquantized from
  ``k_extend``: not declarable beside TF32, so the suite reports them.
* variants: window (``q_id <= kv_id + SLIDING_WINDOW_SIZE`` over the prefix and
  the chunk), soft-capping (``logit_cap``), sinks (``deno += tl.exp(cur_sink -
  e_max)``); no ALiBi.
* no split: one program per 64 or 128 queries and head walks all keys
  (``_fwd_kernel``'s grid ``(batch, heads, cdiv(max_len_extend, BLOCK_M))``).
  Under the interpreter SGLang's ``is_cuda()`` is false (it asks torch), so
  the tiles are its fallback's (``BLOCK_M, BLOCK_N = 64, 64``), not Hopper's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conformance.adapters._common import AdapterBase, refuse, register_reader
from conformance.adapters._sglang import (
    EXTEND_MODULE,
    sglang_kernels,
    token_indices,
    unsupported,
    window_keys,
    write_kv_like_sglang,
)
from conformance.adapters.sglang_decode import VARIANTS
from conformance.observe.launches import Launch
from conformance.observe.paths import Reading
from spec.attention import AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchArrays, BatchMetadata
from spec.capabilities import Capabilities
from spec.errors import InvalidRequestError
from spec.kv_geometry import DTYPES, KV_DTYPES, KVGeometry

EXPLAINED = {
    "fp8_e5m2|k differs": (
        "the write divides by the scale in the activation dtype, `cache_k.div_(k_scale)` "
        "(float16 overflows for a small scale), then casts with torch, `cache_k.to(self.dtype)`, "
        "whose e5m2 cast turns an overflow into infinity (memory_pool.py, `set_kv_buffer`)"
    ),
    "fp8_e5m2|v differs": (
        "the write divides by the scale in the activation dtype, `cache_k.div_(k_scale)` "
        "(float16 overflows for a small scale), then casts with torch, `cache_k.to(self.dtype)`, "
        "whose e5m2 cast turns an overflow into infinity (memory_pool.py, `set_kv_buffer`)"
    ),
    "fp8|output differs": (
        "with an fp8 cache the prefix product casts Q and P to fp8: "
        "`qk = tl.dot(q.to(k.dtype), k)`, `tl.dot(p.to(v.dtype), v)` (`_fwd_kernel`), while "
        "the chunk's own keys are read unquantized from `k_extend`"
    ),
}
"""One line per cause a run may report, citing the kernel's line that makes it."""


class SglangExtendBackend(AdapterBase):
    """SGLang's Triton extend attention on the contract's cache."""

    def __init__(self, device: str | torch.device | None = None, *, tensors: str = "torch") -> None:
        super().__init__(device, tensors=tensors)
        self._written: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="sglang-extend",
            device=str(self.device),
            dtypes=frozenset(DTYPES),
            kv_dtypes=frozenset(KV_DTYPES),
            variants=VARIANTS,
            kv_groups=True,
            products="tf32",
            tensors=self.tensors,
            excludes=unsupported,
        )

    @property
    def source(self) -> str:
        return sglang_kernels().source

    def create_cache(self, geometry: KVGeometry) -> None:
        super().create_cache(geometry)
        self._written.clear()

    def write_kv(
        self,
        layer: int,
        key: FloatArray | torch.Tensor,
        value: FloatArray | torch.Tensor,
        slot_mapping: Sequence[int] | torch.Tensor,
    ) -> None:
        k, v, slots, k_cache, v_cache = self._kv_inputs(layer, key, value, slot_mapping)
        cache = self._mem()
        quantized = cache.geometry.kv_dtype is not None
        write_kv_like_sglang(k, v, slots, k_cache, v_cache, cache.scales(layer), quantized)
        if not self.device_resident:  # the numpy contract: attention takes the chunk from here
            n = slots.shape[0]
            self._written[layer] = (k[:n].clone(), v[:n].clone(), slots.clone())

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
    ) -> Any:
        q, k_cache, v_cache, scale, var = self._query_inputs(layer, query, batch, scale, variant)
        self._new_kv(batch, key, value)
        cache = self._mem()
        refuse("ALiBi (the kernel has none)" if var.alibi_slopes else None, "sglang-extend")
        refuse(unsupported(cache.geometry, q.shape[1], var), "sglang-extend")
        group = cache.geometry.group_of(layer)
        k_new, v_new = self._chunk(layer, batch, group, key, value)
        q = q[: batch.num_tokens]
        kept = window_keys(var)
        prefix = [batch.seq_lens[i] - batch.query_len(i) for i in range(batch.num_seqs)]
        spans = [(0 if kept is None else p - min(p, kept), p) for p in prefix]
        indptr, indices = token_indices(batch, group, spans, self.device)
        qo_indptr, _, _ = self.metadata(batch, group, arrays)
        kv_heads, dim = cache.geometry.num_kv_heads, q.shape[2]
        k_scale, v_scale = cache.scales(layer)
        out = torch.empty_like(q)
        sglang_kernels().extend.extend_attention_fwd(
            q, k_new, v_new, out,
            k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim),
            qo_indptr, indptr, indices, None, True, None, batch.max_query_len,
            k_scale, v_scale, scale, logit_cap=var.softcap or 0.0,
            sliding_window_size=-1 if kept is None else kept,
            sinks=self.per_head(var.sinks),
        )  # fmt: skip
        return self._returned(out)

    def _chunk(
        self,
        layer: int,
        batch: BatchMetadata,
        group: int,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's new K and V, ``[T, H_kv, D]`` contiguous, in the activation dtype."""
        if key is not None and value is not None:
            return key.contiguous(), value.contiguous()
        written = self._written.get(layer)
        rows = None if written is None else {s: i for i, s in enumerate(written[2].tolist())}
        slots = batch.slots(group)
        if written is None or rows is None or any(s not in rows for s in slots):
            raise InvalidRequestError(
                "sglang-extend passes the chunk's own K and V to the kernel, as the engine "
                "does: under the numpy contract, write_kv this batch's slots for this layer "
                "before its attention"
            )
        index = torch.tensor([rows[s] for s in slots], dtype=torch.int64, device=self.device)
        return written[0][index].contiguous(), written[1][index].contiguous()


def _extend(launch: Launch) -> Reading:
    """``_fwd_kernel``: every query tile walks all of its sequence's keys in one pass."""
    return Reading(parts=1)


register_reader("_fwd_kernel", EXTEND_MODULE, _extend)


def make_backend() -> SglangExtendBackend:
    """The entry point ``sglang-extend``."""
    sglang_kernels()
    return SglangExtendBackend()


__all__ = ["EXPLAINED", "SglangExtendBackend", "make_backend", "sglang_kernels"]
