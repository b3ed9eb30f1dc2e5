"""vLLM 0.33's Triton unified attention and KV write, as vLLM's ``TritonAttentionImpl`` calls them.

``write_kv`` is ``triton_reshape_and_cache_flash`` (``reshape_and_cache_kernel_flash``);
``attention`` is ``unified_attention`` (``kernel_unified_attention``, then
``reduce_segments`` on its 3D path), with the arguments
``vllm/v1/attention/backends/triton_attn.py`` passes (``TritonAttentionImpl.forward``
and ``TritonAttentionMetadataBuilder``): ``window_size=(w - 1, 0)``, ``softcap``
0 for none, per-tensor fp8 ``k_descale``/``v_descale``, ALiBi slopes and sinks
as float32 ``[H]`` tensors, and the split-K scratch of an engine with
``seq_threshold_3D = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads`` (128 / KV heads)
and ``NUM_PAR_SOFTMAX_SEGMENTS`` (16) segments, sized for speculative rows of up
to ``MAX_3D_QUERY_LEN`` (8) tokens, so both paths run:

* **2D** (``IS_3D=False``): a prefill, a mixed batch, or more than 128 / KV
  heads sequences: one pass over each sequence's keys;
* **3D** (``IS_3D=True``): few sequences of at most 8 causal query tokens:
  every sequence split into 16 segments (fewer where it is short: its tiles
  are shared out, ``tiles_per_segment = cdiv(seq_len, 16 * TILE_SIZE)``),
  merged by ``reduce_segments``. The split count is fixed, not a rule of the
  context length, so ``decode_split`` is not declared: the report counts the
  parts its launches show.

What it declares, and the kernel's lines that say so:

* ``block_sizes`` multiples of 16: ``TritonAttentionBackend.get_supported_kernel_block_sizes``
  returns ``[MultipleOf(16)]``; ``head_dims`` 32 and up: ``supports_head_size``
  is ``head_size >= 32``.
* ``dtypes`` float32, float16, bfloat16 (``supported_dtypes``); ``kv_dtypes``
  fp8_e4m3 only: both the write (``triton_reshape_and_cache_flash``:
  ``key_cache.view(kv_cache_torch_dtype)``) and ``TritonAttentionImpl.forward``
  (``key_cache.view(self.fp8_dtype)``) view every fp8 cache as
  ``current_platform.fp8_dtype()``, e4m3 on NVIDIA, so an "fp8_e5m2" cache
  holds e4m3 bytes: e5m2 is not what it stores.
* ``products="tf32"``: ``S += score_scale * tl.dot(Q, K)`` and
  ``tl.dot((P * p_scale).to(V.dtype), V)`` at ``tl.dot``'s default precision,
  TF32 for float32 on NVIDIA GPUs.
* every variant: ``SLIDING_WINDOW=(1 + window_size[0])`` keeps keys with
  ``query_abs_pos - seq_offset < SLIDING_WINDOW`` (``compute_kv_seq_mask``);
  ``apply_softcap`` before the mask and ALiBi; ALiBi's
  ``alibi_offset = seq_offset - context_len`` (``apply_alibi_to_score``), a
  per-row constant away from the spec's ``k - p`` that cancels in the softmax
  unless a sink joins it; sinks as the initial row maximum (``init_softmax_M``).
* ``table_width``: the block-table load of each key tile is unmasked
  (``physical_block_idx = tl.load(block_tables_ptr + block_table_offset +
  seq_offset // BLOCK_SIZE)``), so a 32-key prefill tile over 16-token blocks
  reads one entry past a row's used ones. vLLM's persistent table is
  ``cdiv(max_model_len, block_size)`` wide; the adapter asks for such a table,
  for a ``max_model_len`` past the longest sequence the suite draws there
  (4,096 tokens under the interpreter, 69,632 on a GPU).
* KV cache groups: the kernels read whichever table they are given, as vLLM's
  hybrid allocator hands each group's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conformance.adapters._common import AdapterBase
from conformance.adapters._vllm import KVQuantMode, vllm_kernels
from conformance.observe.launches import Launch
from conformance.observe.paths import Reading, register
from spec.attention import VARIANTS, AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchArrays, BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import DTYPES, KVGeometry

MIN_LAUNCH_GRID_SIZE_2D = 128  # vllm/v1/attention/backends/triton_attn.py
NUM_PAR_SOFTMAX_SEGMENTS = 16  # vllm/v1/attention/backends/triton_attn.py
MAX_3D_QUERY_LEN = 8  # triton_unified_attention.py: the longest query the 3D path runs
BLOCK_SIZES = frozenset(range(16, 1025, 16))
HEAD_DIMS = frozenset(range(32, 513))
MAX_MODEL_LEN = {"interpreter": 4096, "gpu": 65536 + 4096}


EXPLAINED = {
    "alibi origin": (
        "ALiBi is measured from the context length, not the query's position: "
        "`alibi_offset = seq_offset - context_len` (triton_attention_helpers.py, "
        "`apply_alibi_to_score`), a per-row constant that the softmax cancels until a sink "
        "joins it (`init_softmax_M`)"
    ),
}
"""One line per cause a run may report, citing the kernel's line that makes it."""


def table_width(device: torch.device) -> int:
    """``cdiv(max_model_len, 16)``: vLLM's persistent table at its smallest block size."""
    where = "gpu" if device.type == "cuda" else "interpreter"
    return -(-MAX_MODEL_LEN[where] // 16)


def unsupported(
    geometry: KVGeometry, num_heads: int, variant: AttentionVariant | None
) -> str | None:
    """The kernel's limits the capability fields cannot say (none beyond them today)."""
    if geometry.latent_dim is not None:
        return "a latent layout (vllm-mla runs MLA)"
    return None


class VllmUnifiedBackend(AdapterBase):
    """vLLM's Triton attention backend's two kernels, on the contract's cache."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="vllm-unified",
            device=str(self.device),
            dtypes=frozenset(DTYPES),
            kv_dtypes=frozenset({"fp8_e4m3"}),
            block_sizes=BLOCK_SIZES,
            head_dims=HEAD_DIMS,
            variants=frozenset(VARIANTS),
            kv_groups=True,
            products="tf32",
            table_width=table_width(self.device),
            tensors=self.tensors,
            excludes=unsupported,
        )

    @property
    def source(self) -> str:
        """Where the kernels came from: the installed vLLM, or the pinned wheel's files."""
        return vllm_kernels().source

    def write_kv(
        self,
        layer: int,
        key: FloatArray | torch.Tensor,
        value: FloatArray | torch.Tensor,
        slot_mapping: Sequence[int] | torch.Tensor,
    ) -> None:
        k, v, slots, k_cache, v_cache = self._kv_inputs(layer, key, value, slot_mapping)
        n = slots.shape[0]
        k_scale, v_scale = (self.scale_tensor(s) for s in self._mem().scales(layer))
        kind = "fp8" if self._mem().geometry.kv_dtype else "auto"
        kernels = vllm_kernels()
        if self.device.type == "cuda":
            kernels.reshape.triton_reshape_and_cache_flash(
                k[:n], v[:n], k_cache, v_cache, slots, kind, k_scale, v_scale
            )
            return
        # The wrapper asks torch.cuda.get_device_capability(key.device), which a CPU tensor
        # cannot answer; under the interpreter the kernel is launched as the wrapper launches
        # it on sm_90 (TILE_SIZE = min(2048, next_power_of_2(n)), num_warps 16, num_stages 10).
        heads, dim = k.shape[1], k.shape[2]
        tile = min(2048, 1 << max(0, (heads * dim - 1).bit_length()))
        kernels.reshape.reshape_and_cache_kernel_flash[(n, -(-heads * dim // tile))](
            key_ptr=k, value_ptr=v, key_cache_ptr=k_cache, value_cache_ptr=v_cache,
            slot_mapping_ptr=slots, k_scale=k_scale, v_scale=v_scale,
            key_stride=k.stride(0), value_stride=v.stride(0),
            block_stride=k_cache.stride(0), head_stride=k_cache.stride(2),
            dim_stride_k=0, dim_stride_v=0, page_stride=k_cache.stride(1),
            num_heads=heads, head_size=dim, block_size=k_cache.shape[1], x=1,
            USE_HEAD_MAJOR_LAYOUT=False, INTERLEAVED_V_PACK_FACTOR=0,
            FP8_KV_CACHE=kind == "fp8", TILE_SIZE=tile, num_warps=16, num_stages=10,
        )  # fmt: skip

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
        qsl, lens, tables = self.metadata(batch, cache.geometry.group_of(layer), arrays)
        q = q[: batch.num_tokens]
        heads, dim, kv_heads = q.shape[1], q.shape[2], cache.geometry.num_kv_heads
        k_scale, v_scale = cache.scales(layer)
        descale = (batch.num_seqs, kv_heads)  # TritonAttentionImpl.forward: descale_shape
        threshold = MIN_LAUNCH_GRID_SIZE_2D // kv_heads
        rows = threshold * MAX_3D_QUERY_LEN  # the scratch of an engine with 7-token drafts
        pad = 1 << max(0, (dim - 1).bit_length())
        segments = NUM_PAR_SOFTMAX_SEGMENTS
        out = torch.empty_like(q)
        vllm_kernels().unified.unified_attention(
            q=q, k=k_cache, v=v_cache, out=out,
            cu_seqlens_q=qsl, max_seqlen_q=batch.max_query_len,
            seqused_k=lens, max_seqlen_k=batch.max_seq_len,
            softmax_scale=scale, causal=True,
            window_size=(var.window - 1, 0) if var.window is not None else (-1, -1),
            block_table=tables, softcap=var.softcap or 0,
            q_descale=None,
            k_descale=self.scale_tensor(k_scale).expand(descale),
            v_descale=self.scale_tensor(v_scale).expand(descale),
            seq_threshold_3D=threshold, num_par_softmax_segments=segments,
            softmax_segm_output=torch.empty(
                (rows, heads, segments, pad), dtype=torch.float32, device=self.device
            ),
            softmax_segm_max=torch.empty(
                (rows, heads, segments), dtype=torch.float32, device=self.device
            ),
            softmax_segm_expsum=torch.empty(
                (rows, heads, segments), dtype=torch.float32, device=self.device
            ),
            alibi_slopes=self.per_head(var.alibi_slopes),
            sinks=self.per_head(var.sinks),
            kv_quant_mode=(
                KVQuantMode.FP8_PER_TENSOR if cache.geometry.kv_dtype else KVQuantMode.NONE
            ),
        )  # fmt: skip
        return self._returned(out)


def _unified(launch: Launch) -> Reading:
    """``kernel_unified_attention``: grid ``(q blocks, KV heads[, segments])``; ``IS_3D`` splits
    each sequence into ``NUM_SEGMENTS_PER_SEQ`` segments, the 2D path runs one pass."""
    if launch.arg("IS_3D", False):
        return Reading(parts=int(launch.arg("NUM_SEGMENTS_PER_SEQ", launch.grid[2])))
    return Reading(parts=1)


def _no_path(launch: Launch) -> Reading:
    """A kernel that selects no path: ``reduce_segments`` (the 3D merge), the KV write."""
    return Reading()


register("kernel_unified_attention", _unified)
register("reduce_segments", _no_path)
register("reshape_and_cache_kernel_flash", _no_path)


def make_backend() -> VllmUnifiedBackend:
    """The entry point ``vllm-unified``: the device contract on CUDA when kernels compile,
    else on the CPU under Triton's interpreter."""
    vllm_kernels()  # a missing release is a setup error now, not at the first call
    return VllmUnifiedBackend()


__all__ = [
    "BLOCK_SIZES",
    "EXPLAINED",
    "VllmUnifiedBackend",
    "make_backend",
    "table_width",
    "vllm_kernels",
]
