"""SGLang 0.5.23's Triton decode kernel, as SGLang's Triton attention backend calls it.

``attention`` is ``decode_attention_fwd`` with the arguments of
``TritonAttnBackend.forward_decode`` (``sglang/srt/layers/attention/triton_backend.py``):
token-level ``kv_indptr``/``kv_indices`` (a window layer's: its last ``w - 1``
tokens, :mod:`conformance.adapters._sglang`), ``attn_logits`` and ``attn_lse``
for ``max_kv_splits`` (8, ``--triton-attention-num-kv-splits``' default),
per-sequence ``num_kv_splits`` from the engine's own ``get_num_kv_splits_triton``
(launched here in the attention call; SGLang launches it once a step),
``logit_cap`` for soft-capping, ``sinks``, and the layer's fp8 scales
(``k_scale`` folded into ``sm_scale``, ``v_scale`` applied by stage 2). The KV
write is SGLang's ``set_kv_buffer`` (:func:`~conformance.adapters._sglang.write_kv_like_sglang`).

The split count is per sequence and lives in a device tensor, which a launch
record cannot see (stage 1's grid is always ``max_kv_splits`` wide; programs
past a sequence's own count return at once: ``if split_kv_end > split_kv_start``).
So the stage-1 reader says nothing of parts, and :meth:`attention_path` names
the path from the counts the engine's kernel computed, read back after the call:
a sequence runs ``cdiv(len, kv_len_per_split)`` parts, ``kv_len_per_split =
cdiv(cdiv(len, num_kv_splits), 32) * 32`` (``_fwd_kernel_stage1``).

What it declares, and the kernel's lines that say so:

* ``max_query_len=1``: decode only.
* ``dtypes`` all three; ``kv_dtypes`` both fp8 formats (SGLang's ``--kv-cache-dtype``
  takes ``fp8_e4m3`` and ``fp8_e5m2``); block sizes any (``page_size`` 1: token
  slots); head dims any, but under 16 only without GQA (the grouped kernel's
  ``tl.dot`` needs 16 on a GPU).
* ``products="tf32"``: the grouped kernel (more query heads than KV heads)
  computes ``qk = tl.dot(q_k, k)`` and ``tl.dot(p.to(v.dtype), v)`` at the
  default precision, TF32 for float32. Not declared, for the suite to report:
  the MHA kernel (one query head per KV head, ``_fwd_kernel_stage1``) rounds
  each product to the activation dtype (``qk = tl.sum((q[None, :] * k).to(tl.float32), 1)``),
  and with an fp8 cache the grouped kernel casts Q and P to fp8
  (``q_k = q.to(K_Buffer.dtype.element_ty)``, ``p.to(v.dtype)``).
* variants: sinks (stage 2: ``e_sum += tl.exp(cur_sink - e_max)``), soft-capping
  (``logit_cap * tanh(qk / logit_cap)``), windows (through the indices, above);
  no ALiBi (the kernel has none).
* ``decode_split`` is not declared: each sequence's count comes from
  ``get_num_kv_splits_triton``, which weighs the batch's longest and shortest
  sequences, its head programs against the SMs (``max_kv_splits_2 =
  min(cdiv(ext_device_core_count, token_grid), max_kv_splits)``: no split at all
  once a sequence's head programs reach the SMs' budget) and the keys read, which
  for a window layer are ``w - 1``, not the ``w`` the spec counts. No rule of
  the visible keys alone states it; :meth:`attention_path` reports what ran
  (a lone decode of a few heads splits from 33 keys, 32-key granules,
  ``MIN_BLOCK_KV``, up to ``max_kv_splits`` parts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conformance.adapters._common import AdapterBase, no_path, refuse, register_reader
from conformance.adapters._sglang import (
    DECODE_MODULE,
    sglang_kernels,
    token_indices,
    unsupported,
    window_keys,
    write_kv_like_sglang,
)
from conformance.adapters._vllm import target
from conformance.observe.launches import Launch
from conformance.observe.paths import Reading
from spec.attention import AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchArrays, BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import DTYPES, KV_DTYPES

MAX_KV_SPLITS = 8  # --triton-attention-num-kv-splits (exec_.py: triton_attention_num_kv_splits)
MIN_BLOCK_KV = 32  # decode_attention.py: _MIN_BLOCK_KV
VARIANTS = frozenset({"sinks", "softcap", "window"})


EXPLAINED = {
    "window": (
        "a window layer's decode reads its last `w - 1` tokens: `window_kv_lens = "
        "torch.minimum(seq_lens, torch.tensor(sliding_window_size))` "
        "(triton_backend.py, `update_sliding_window_buffer`), `sliding_window_size = "
        "config.sliding_window - 1` (the models' `get_attention_sliding_window_size`)"
    ),
    "activation dtype": (
        "with one query head per KV head the MHA kernel rounds each product to the activation "
        "dtype: `qk = tl.sum((q[None, :] * k).to(tl.float32), 1)` (`_fwd_kernel_stage1`)"
    ),
    "q and p cast": (
        "with an fp8 cache the grouped kernel casts Q and P to fp8: "
        "`q_k = q.to(K_Buffer.dtype.element_ty)`, `tl.dot(p.to(v.dtype), v)` "
        "(`_fwd_grouped_kernel_stage1`)"
    ),
    "fp8_e4m3": (
        "the same casts of Q and P to fp8 (`_fwd_grouped_kernel_stage1`), on paths where the "
        "named mistake, which rounds P against one softmax max, rounds otherwise than the kernel: "
        "it rounds `p = tl.exp(qk - n_e_max[:, None])` against each split's running max, and "
        "adds a sink only when it merges the splits (`_fwd_kernel_stage2`)"
    ),
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
}
"""One line per cause a run may report, citing the kernel's line that makes it."""


def parts_of(length: int, splits: int) -> int:
    """How many parts stage 1 runs for a sequence of ``length`` keys and ``splits`` splits.

    >>> parts_of(32, 8), parts_of(33, 8), parts_of(1000, 8)
    (1, 2, 8)
    """
    if length <= 0:
        return 0
    per = _cdiv(_cdiv(length, splits), MIN_BLOCK_KV) * MIN_BLOCK_KV
    return _cdiv(length, per)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SglangDecodeBackend(AdapterBase):
    """SGLang's Triton decode on the contract's cache, read token by token."""

    def __init__(self, device: str | torch.device | None = None, *, tensors: str = "torch") -> None:
        super().__init__(device, tensors=tensors)
        self._path: str | None = None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="sglang-decode",
            device=str(self.device),
            dtypes=frozenset(DTYPES),
            kv_dtypes=frozenset(KV_DTYPES),
            variants=VARIANTS,
            max_query_len=1,
            chunked_prefill=False,
            kv_groups=True,
            products="tf32",
            tensors=self.tensors,
            excludes=unsupported,
        )

    @property
    def source(self) -> str:
        return sglang_kernels().source

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

    def attention_path(self) -> str | None:
        """The last call's path, from the split counts the engine's kernel computed."""
        return self._path

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
        refuse(
            f"a query of {batch.max_query_len} tokens (decode only)"
            if batch.max_query_len > 1
            else None,
            "sglang-decode",
        )
        refuse("ALiBi (the kernel has none)" if var.alibi_slopes else None, "sglang-decode")
        cache = self._mem()
        refuse(unsupported(cache.geometry, q.shape[1], var), "sglang-decode")
        q = q[: batch.num_tokens]
        kept = window_keys(var)
        lens = [n if kept is None else min(n, kept) for n in batch.seq_lens]
        spans = [(n - w, n) for n, w in zip(batch.seq_lens, lens, strict=True)]
        indptr, indices = token_indices(batch, cache.geometry.group_of(layer), spans, self.device)
        heads, kv_heads, dim = q.shape[1], cache.geometry.num_kv_heads, q.shape[2]
        splits = torch.empty(batch.num_seqs, dtype=torch.int32, device=self.device)
        window_lens = torch.tensor(lens, dtype=torch.int32, device=self.device)
        kernels = sglang_kernels()
        seqs = batch.num_seqs
        kernels.metadata.get_num_kv_splits_triton[(1,)](
            splits,
            window_lens,
            seqs,
            1,
            heads,
            kv_heads,
            MAX_KV_SPLITS,
            target(self.device)[1],
            MAX_NUM_SEQ=256 if seqs < 256 else 1 << (seqs - 1).bit_length(),
        )  # fmt: skip  (TritonAttnBackend.get_num_kv_splits)
        k_scale, v_scale = cache.scales(layer)
        out = torch.empty(seqs, heads, dim, dtype=q.dtype, device=self.device)
        logits = torch.empty(
            (seqs, heads, MAX_KV_SPLITS, dim), dtype=torch.float32, device=self.device
        )
        lse = torch.empty((seqs, heads, MAX_KV_SPLITS), dtype=torch.float32, device=self.device)
        kernels.decode.decode_attention_fwd(
            q, k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim), out,
            indptr, indices, logits, lse, splits, MAX_KV_SPLITS, scale, k_scale, v_scale,
            logit_cap=var.softcap or 0.0, sinks=self.per_head(var.sinks),
        )  # fmt: skip
        counts = splits.tolist()
        split = any(parts_of(n, s) > 1 for n, s in zip(lens, counts, strict=True))
        self._path = "split-KV decode" if split else "single-pass decode"
        return self._returned(out)


def _stage1(launch: Launch) -> Reading:
    """SGLang's stage 1: grid ``(sequences, heads or head tiles, max_kv_splits)``; the parts
    each sequence ran are in a device tensor, not the launch (see the module text)."""
    return Reading(head_tiles=launch.grid[1])


register_reader("_fwd_kernel_stage1", DECODE_MODULE, _stage1)
register_reader("_fwd_grouped_kernel_stage1", DECODE_MODULE, _stage1)
register_reader("_fwd_kernel_stage2", DECODE_MODULE, no_path)
register_reader("get_num_kv_splits_triton", "sglang.kernels.ops.attention.metadata", no_path)


def make_backend() -> SglangDecodeBackend:
    """The entry point ``sglang-decode``."""
    sglang_kernels()
    return SglangDecodeBackend()


__all__ = [
    "EXPLAINED",
    "VARIANTS",
    "SglangDecodeBackend",
    "make_backend",
    "parts_of",
    "sglang_kernels",
]
