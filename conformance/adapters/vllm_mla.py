"""vLLM 0.33's Triton MLA decode kernel, as vLLM's TritonMLA backend calls it.

``attention`` is ``decode_attention_fwd(..., is_mla=True)`` with the arguments of
``TritonMLAImpl.forward_mqa`` (``vllm/v1/attention/backends/mla/triton_mla.py``):
the query ``[S, H, latent + rope]`` (the absorbed form), the layer's cache of
rows ``[num_blocks, B, latent + rope]`` unsqueezed to one KV head, its first
``latent`` columns as V, ``lse`` and ``o`` of the query's dtype, ``attn_logits``
``[S, H, num_kv_splits, latent + 1]`` float32, the block table and sequence
lengths, ``PAGE_SIZE`` the block size, and one scale (``k_scale`` for both K and
V). ``num_kv_splits`` is ``_compute_num_kv_splits(max_seq_len, sm_count)``:
``next_power_of_2(max(1, max_seq_len // 512))``, at most twice the SMs, one
count for the whole batch (:data:`DECODE_SPLIT`).

The KV write of vLLM's MLA layers is ``concat_and_cache_mla``, a CUDA op, not
a Triton kernel: here it is the contract's write in torch (c_kv and k_rope
side by side in one row; an fp8 row divided by the scale in float32, clamped
and rounded to nearest even, as that op's saturating conversion does).

What it declares, and the kernel's lines that say so:

* ``max_query_len=1``: decode only (``forward_mqa`` serves the decode rows;
  vLLM's MLA prefill runs the up-projected form through other kernels).
* ``latent`` any ``(latent_dim, rope_dim)`` from 16 + 16: with 576 the kernel
  splits 512 + 64 (``_decode_grouped_att_m_fwd``: ``BLOCK_DMODEL = 512``,
  ``BLOCK_DPE = 64``), otherwise ``next_power_of_2`` of each part; a part under
  16 would be a ``tl.dot`` dimension under 16, which does not compile for a GPU.
* ``block_sizes`` multiples of 16 (``TritonMLABackend.supports_block_size``);
  ``kv_dtypes`` fp8_e4m3 (``supported_kv_cache_dtypes``: ``fp8``, ``fp8_e4m3``),
  dequantized to the query's dtype as it is read
  (``k = (k.to(tl.float32) * ks).to(q.dtype)``).
* ``dtypes`` float16 and bfloat16 (``TritonMLABackend.supported_dtypes``) and
  float32, which the kernel runs too; ``products="tf32"``: with two query heads
  or more the grouped kernel multiplies by ``tl.dot(q, k.to(q.dtype))`` and
  ``tl.dot(p.to(v.dtype), v)`` at the default precision, TF32 for float32 on
  NVIDIA GPUs. With one query head ``decode_attention_fwd`` takes the MHA
  kernel (``kv_group_num == 1``: ``_fwd_kernel_stage1``), whose
  ``qk = tl.sum(q[None, :] * k, 1)`` rounds each product to the activation
  dtype: not declared, so the suite reports it where it draws one head.
* no variants: ``TritonMLAImpl.__init__`` refuses ALiBi, sliding windows and
  soft-capping, and the kernel has no sinks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conformance.adapters._common import AdapterBase, no_path, refuse, register_reader
from conformance.adapters._vllm import target, vllm_kernels
from conformance.adapters.vllm_unified import BLOCK_SIZES
from conformance.observe.launches import Launch
from conformance.observe.paths import Reading
from spec.attention import AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchArrays, BatchMetadata
from spec.capabilities import Capabilities, DecodeSplit
from spec.kv_geometry import DTYPES, KVGeometry
from spec.quant import FP8_FORMATS

MIN_WORK_PER_SPLIT = 512  # triton_mla.py: _MIN_WORK_PER_SPLIT
SPLIT_OCCUPANCY_MULTIPLIER = 2  # triton_mla.py: _SPLIT_OCCUPANCY_MULTIPLIER
MIN_DOT = 16  # tl.dot's smallest dimension on a GPU
MODULE = "vllm.v1.attention.ops.triton_decode_attention"


EXPLAINED = {
    "activation dtype": (
        "with one query head `decode_attention_fwd` takes the MHA kernel (`kv_group_num == 1`), "
        "whose `qk = tl.sum(q[None, :] * k, 1)` (`_fwd_kernel_stage1`) rounds each product "
        "to the activation dtype"
    ),
}
"""One line per cause a run may report, citing the kernel's line that makes it."""


def num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    """``_compute_num_kv_splits``: the batch's split count.

    >>> [num_kv_splits(n, 132) for n in (1023, 1024, 1536, 4097, 10**6)]
    [1, 2, 4, 8, 264]
    """
    ideal = 1 << max(0, (max(1, max_seq_len // MIN_WORK_PER_SPLIT) - 1).bit_length())
    return min(ideal, sm_count * SPLIT_OCCUPANCY_MULTIPLIER)


def decode_split(device: torch.device) -> DecodeSplit:
    """The split rule as :class:`DecodeSplit` states it: from 1,024 keys (``max_seq_len //
    512`` reaches 2), about 512 keys a part, at most twice the SMs."""
    sms = target(device)[1]
    return DecodeSplit(
        2 * MIN_WORK_PER_SPLIT,
        MIN_WORK_PER_SPLIT,
        sms * SPLIT_OCCUPANCY_MULTIPLIER,
        note=f"next_power_of_2(max_seq_len // 512) for the whole batch, {sms} SMs",
    )


def unsupported(
    geometry: KVGeometry, num_heads: int, variant: AttentionVariant | None
) -> str | None:
    """Per-head K and V (the kernel reads latent rows only), and latent parts under 16 (a
    ``tl.dot`` dimension a GPU does not compile)."""
    if geometry.latent_dim is None:
        return "per-head K and V (vllm-mla runs the latent layout only)"
    rope = geometry.head_dim - geometry.latent_dim
    if min(geometry.latent_dim, rope) < MIN_DOT:
        return f"latent layout {geometry.latent_dim}+{rope}: a part under {MIN_DOT} columns"
    return None


class VllmMlaBackend(AdapterBase):
    """vLLM's Triton MLA decode on the contract's latent cache."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="vllm-mla",
            device=str(self.device),
            dtypes=frozenset(DTYPES),
            kv_dtypes=frozenset({"fp8_e4m3"}),
            block_sizes=BLOCK_SIZES,
            latent=None,
            max_query_len=1,
            chunked_prefill=False,
            products="tf32",
            decode_split=decode_split(self.device),
            tensors=self.tensors,
            excludes=unsupported,
        )

    @property
    def source(self) -> str:
        return vllm_kernels().source

    def write_kv(
        self,
        layer: int,
        key: FloatArray | torch.Tensor,
        value: FloatArray | torch.Tensor,
        slot_mapping: Sequence[int] | torch.Tensor,
    ) -> None:
        k, v, slots, k_cache, v_cache = self._kv_inputs(layer, key, value, slot_mapping)
        cache, n = self._mem(), slots.shape[0]
        keep = slots != -1
        kind = cache.geometry.kv_dtype
        scale = cache.scales(layer)[0]
        for rows, target_view in ((k, k_cache), (v, v_cache)):
            stored = rows[:n][keep]
            if kind is not None:  # concat_and_cache_mla: x / scale, saturated, nearest even
                top = FP8_FORMATS[kind].max_finite
                stored = (stored.float() / torch.tensor(scale, dtype=torch.float32)).clamp(
                    -top, top
                )
            target_view.view(-1, *target_view.shape[2:])[slots[keep]] = stored.to(target_view.dtype)

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
        q, _, _, scale, var = self._query_inputs(layer, query, batch, scale, variant)
        self._new_kv(batch, key, value)
        cache = self._mem()
        refuse("plain attention only" if not var.is_plain else None, "vllm-mla")
        refuse(
            f"a query of {batch.max_query_len} tokens (decode only)"
            if batch.max_query_len > 1
            else None,
            "vllm-mla",
        )
        _, lens, tables = self.metadata(batch, cache.geometry.group_of(layer), arrays)
        q = q[: batch.num_tokens]
        rows = cache.rows[layer].unsqueeze(2)  # forward_mqa: kv_c_and_k_pe_cache.unsqueeze(2)
        latent = cache.geometry.latent_dim
        assert latent is not None
        splits = num_kv_splits(batch.max_seq_len, target(self.device)[1])
        heads = q.shape[1]
        out = torch.zeros(q.shape[0], heads, latent, dtype=q.dtype, device=self.device)
        lse = torch.zeros(q.shape[0], heads, dtype=q.dtype, device=self.device)
        logits = torch.empty(
            (q.shape[0], heads, splits, latent + 1), dtype=torch.float32, device=self.device
        )
        kv_scale = self.scale_tensor(cache.scales(layer)[0])
        vllm_kernels().decode.decode_attention_fwd(
            q, rows, rows[..., :latent], out, lse, tables, lens, logits, splits, scale,
            rows.size(1), k_scale=kv_scale, v_scale=kv_scale, is_mla=True,
        )  # fmt: skip
        return self._returned(out)


def _stage1(launch: Launch) -> Reading:
    """vLLM's ``_fwd_kernel_stage1`` / ``_fwd_grouped_kernel_stage1``: grid ``(sequences,
    heads or head tiles, NUM_KV_SPLITS)``; each sequence's keys in ``NUM_KV_SPLITS`` parts."""
    parts = int(launch.arg("NUM_KV_SPLITS", launch.grid[2]))
    return Reading(parts=parts, head_tiles=launch.grid[1])


register_reader("_fwd_kernel_stage1", MODULE, _stage1)
register_reader("_fwd_grouped_kernel_stage1", MODULE, _stage1)
register_reader("_fwd_kernel_stage2", MODULE, no_path)


def make_backend() -> VllmMlaBackend:
    """The entry point ``vllm-mla``."""
    vllm_kernels()
    return VllmMlaBackend()


__all__ = [
    "EXPLAINED",
    "VllmMlaBackend",
    "decode_split",
    "make_backend",
    "num_kv_splits",
    "vllm_kernels",
]
