"""SGLang 0.5.23's Triton attention files, their stand-ins, and what both of its adapters share.

Four files of the wheel are pinned (:data:`SGLANG`): the decode and extend
kernels, ``score_mod`` (imported by both; an unused hook here) and
``metadata`` (``get_num_kv_splits_triton``, the engine's split rule, itself a
Triton kernel). Their engine imports are ``sglang.srt.environ.envs`` (flags,
each ``False`` or its default here, which keeps every ROCm-only path off) and
``sglang.srt.utils`` (``is_cuda``, ``is_hip`` and the AMD probes, as SGLang
defines them: ``torch.cuda.is_available()``, ``torch.version.hip``).

Both adapters keep SGLang's memory semantics:

* **the KV write** is ``MHATokenToKVPool.set_kv_buffer``
  (``sglang/srt/mem_cache/memory_pool.py``): an fp8 cache's K and V are
  divided by the layer's scale *in the activation dtype* (``cache_k.div_(k_scale)``)
  and cast with torch (``cache_k.to(self.dtype)``), which saturates to e4m3's
  largest value but overflows e5m2 to infinity;
* **token-level indices**: the kernels read ``kv_indptr``/``kv_indices``, one
  slot per token (``page_size`` 1, the engine's default), built from the
  batch's block tables as SGLang builds them from ``req_to_token``;
* **the window** is ``sliding_window_size = w - 1`` (the models'
  ``get_attention_sliding_window_size``: ``config.sliding_window - 1``), and a
  window layer reads only its last ``min(len, w - 1)`` tokens' slots
  (``update_sliding_window_buffer``: ``window_kv_lens = torch.minimum(seq_lens,
  sliding_window_size)``). A window of 1 is ``sliding_window_size = 0``, which
  SGLang takes as no window at all: refused through the capabilities.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

# isort: split
# First: on a CPU-only machine this sets TRITON_INTERPRET, before triton is imported.
import backend_gpu  # noqa: F401

# isort: split
import torch
import triton  # noqa: F401  (missing: a setup error naming paged-spec[gpu], before any fetch)

from conformance.adapters._fetch import Release
from conformance.adapters._load import (
    load_release,
    package,
    standin,
)
from conformance.adapters._vllm import target
from spec.attention import AttentionVariant
from spec.batch import BatchMetadata
from spec.kv_geometry import KVGeometry

SGLANG = Release(
    package="sglang",
    version="0.5.23",
    wheel="sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
    wheel_sha256="00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
    files={
        "sglang/kernels/ops/attention/score_mod.py": (
            "127e2e6466bbfac3c2189cc4f2a9d7751fd819b30d25de65378d66ae63bbafa6"
        ),
        "sglang/kernels/ops/attention/metadata.py": (
            "8aa5db57763f5ecfb01a05beba74791d0bf3921952c789d8a8432abf25c231ca"
        ),
        "sglang/kernels/ops/attention/decode_attention.py": (
            "7a3b66ce3daabbb027efd860411cd9abe4b399b1f2cfc3ed5c6c01731eb9fa0a"
        ),
        "sglang/kernels/ops/attention/extend_attention.py": (
            "be3baffc80ef9fe484d0b896842522b02bf671785088e05a66ca4dcdb2e8a9b3"
        ),
    },
)
"""The release the adapters' declarations were read from."""
DECODE_MODULE = "sglang.kernels.ops.attention.decode_attention"
EXTEND_MODULE = "sglang.kernels.ops.attention.extend_attention"
MIN_DOT = 16  # tl.dot's smallest dimension on a GPU
ENV_DEFAULTS: dict[str, Any] = {
    "SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS": False,
    "SGLANG_MLA_DECODE_TUNE": False,
    "SGLANG_FORCE_LEAN_GRID_CU_MULT": 1.0,
    "SGLANG_TRITON_FP8_PREFILL_ATTN": False,
    "SGLANG_TRITON_COMPACT_EXTEND_ATTENTION": False,
}
"""The ``sglang.srt.environ.envs`` flags the four files read, at SGLang's defaults."""


@dataclass(frozen=True)
class SglangKernels:
    """The loaded modules and where they came from."""

    metadata: Any
    decode: Any
    extend: Any
    source: str


@functools.cache
def sglang_kernels() -> SglangKernels:
    """SGLang's kernel modules: the installed package's, else the pinned files' (verified)."""
    modules, source = load_release(SGLANG, _standins)
    return SglangKernels(modules[1], modules[2], modules[3], source)


class _Flag:
    def __init__(self, value: Any) -> None:
        self._value = value

    def get(self) -> Any:
        return self._value


class _Envs:
    """``sglang.srt.environ.envs``: each flag the files read, at its default."""

    def __getattr__(self, name: str) -> _Flag:
        if name not in ENV_DEFAULTS:
            raise AttributeError(f"sglang.srt.environ.envs.{name}: no stand-in (not pinned)")
        return _Flag(ENV_DEFAULTS[name])


def _standins() -> None:
    package("sglang")
    standin("sglang.srt.environ", envs=_Envs())
    standin(
        "sglang.srt.utils",
        is_cuda=lambda: torch.cuda.is_available() and torch.version.cuda is not None,
        is_hip=lambda: torch.version.hip is not None,
        is_gfx95_supported=lambda: False,  # SGLang: False on every non-HIP build
        is_gfx1250_supported=lambda: False,
        get_device_core_count=lambda device_id=0: target()[1],
    )


def window_keys(variant: AttentionVariant) -> int | None:
    """How many of its last tokens a window layer's decode reads: ``sliding_window_size``
    (``w - 1``); ``None`` without a window."""
    return None if variant.window is None else variant.window - 1


def unsupported(
    geometry: KVGeometry, num_heads: int, variant: AttentionVariant | None
) -> str | None:
    """What SGLang's kernels cannot run that the capability fields cannot say."""
    if geometry.latent_dim is not None:
        return "a latent layout (not adapted)"
    if variant is not None and variant.window == 1:
        return "a window of 1 token (sliding_window_size = w - 1 = 0 turns SGLang's window off)"
    if num_heads > geometry.num_kv_heads and geometry.head_dim < MIN_DOT:
        return f"head dim {geometry.head_dim} with GQA (a tl.dot dimension under {MIN_DOT})"
    return None


def token_indices(
    batch: BatchMetadata, group: int, spans: list[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_indptr int32 [S + 1], kv_indices int64)``: for sequence ``i``, the slots of its
    positions ``spans[i][0] .. spans[i][1] - 1`` read through its block table, as SGLang
    gathers them from ``req_to_token``."""
    b = batch.block_size
    indptr: list[int] = [0]
    indices: list[int] = []
    for i, (first, end) in enumerate(spans):
        table = batch.tables(group)[i]
        indices.extend(table[p // b] * b + p % b for p in range(first, end))
        indptr.append(len(indices))
    return (
        torch.tensor(indptr, dtype=torch.int32, device=device),
        torch.tensor(indices, dtype=torch.int64, device=device),
    )


def write_kv_like_sglang(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: tuple[float, float],
    quantized: bool,
) -> None:
    """``MHATokenToKVPool.set_kv_buffer`` on the contract's cache (viewed token-major)."""
    n = slots.shape[0]
    keep = slots != -1
    for rows, cache, scale in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
        x = rows[:n][keep]
        if quantized:  # cache_k.div_(k_scale): a float32 0-d scale keeps the activation dtype
            x = (x / torch.tensor(scale, dtype=torch.float32, device=x.device)).to(cache.dtype)
        cache.view(-1, *cache.shape[2:])[slots[keep]] = x
