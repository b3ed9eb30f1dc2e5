"""vLLM 0.33's Triton attention files: the pin, the stand-ins their imports need, the loader.

Four files of the wheel are pinned (:data:`VLLM`): the unified attention kernel
and its helpers, the KV write (``triton_reshape_and_cache_flash``), and the
decode kernel vLLM's TritonMLA backend calls (``triton_decode_attention``).
Their engine imports are few, and each stand-in holds exactly what the files
read (module by module, below); where vLLM is installed, none is made and the
installed files are imported instead.

``vllm.platforms.current_platform`` is the one stand-in that decides launch
plans: the files ask it for the fp8 dtype, the device's capability and its
SM count. It answers for the CUDA device when kernels compile, and for the
GPU the interpreter plays otherwise: an H200 (sm_90, 132 SMs), the same
target :mod:`backend_gpu.kernels.target` plans for, so a CPU run takes the
paths an H200 takes.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

# isort: split
# First: on a CPU-only machine this sets TRITON_INTERPRET, before triton is imported.
import backend_gpu  # noqa: F401

# isort: split
import torch
import triton

from conformance.adapters._fetch import Release
from conformance.adapters._load import (
    installed_version,
    load_release,
    package,
    standin,
)

VLLM = Release(
    package="vllm",
    version="0.33.0",
    wheel="vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    wheel_sha256="4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
    files={
        "vllm/v1/attention/ops/triton_attention_helpers.py": (
            "ef697fa4fa19c2543d9001c1db6cf6e8c5da22dd36ec5c1bc29f6a9ac8a59da9"
        ),
        "vllm/v1/attention/ops/triton_unified_attention.py": (
            "c1cf2300c99f5dc1fb297d7e556620842ab53c64c5ecda4c6ba89fb8e16215da"
        ),
        "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py": (
            "c04f325a7de8176462d7028dd28dad4fd7a2c3917556439fd245ea3a22621812"
        ),
        "vllm/v1/attention/ops/triton_decode_attention.py": (
            "6095f9bfe69e7c4f472e27f0757a4ae9c7358b50275908b0715fad9727297dde"
        ),
    },
)
"""The release the adapters' declarations were read from (every line they cite is in it)."""

H200 = (9, 0), 132
"""The capability and SM count of the GPU the interpreter plays."""


def interpreted() -> bool:
    """Whether Triton interprets kernels here (``TRITON_INTERPRET``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def target(device: torch.device | None = None) -> tuple[tuple[int, int], int]:
    """``(capability, SM count)`` plans are made for: the CUDA device's, else an H200's."""
    if torch.cuda.is_available() and not interpreted():
        index = 0 if device is None or device.index is None else device.index
        props = torch.cuda.get_device_properties(index)
        return (props.major, props.minor), int(props.multi_processor_count)
    return H200


@dataclass(frozen=True)
class VllmKernels:
    """The loaded modules and where they came from (reports quote ``source``)."""

    unified: Any
    reshape: Any
    decode: Any
    source: str


@functools.cache
def vllm_kernels() -> VllmKernels:
    """vLLM's kernel modules: the installed package's, else the pinned files' (verified)."""
    modules, source = load_release(VLLM, _standins)
    _, unified, reshape, decode = modules
    return VllmKernels(unified, reshape, decode, source)


class KVQuantMode(enum.IntEnum):
    """``vllm.v1.kv_cache_interface.KVQuantMode``: the values the kernels compare against."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """``vllm.v1.kv_cache_interface.is_quantized_kv_cache`` for the dtypes adapters pass."""
    return kv_cache_dtype.startswith("fp8") or kv_cache_dtype.endswith("_per_token_head")


class _Platform:
    """``vllm.platforms.current_platform``, as the kernel files ask it."""

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn  # CUDA's (vllm/platforms/interface.py: fp8_dtype)

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return True  # the platform played: an NVIDIA GPU, compiled or interpreted

    def is_fp8_fnuz(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> tuple[int, int]:
        return target()[0]

    def has_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        major, minor = target()[0]
        want = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return major * 10 + minor >= want

    def is_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        major, minor = target()[0]
        want = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return major * 10 + minor == want

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        major, minor = target()[0]
        return (major * 10 + minor) // 10 == capability // 10

    def num_compute_units(self, device_id: int = 0) -> int:
        return target()[1]


class _Logger:
    """``vllm.logger.init_logger``'s logger: a standard one, with the ``*_once`` methods."""

    def __init__(self, name: str) -> None:
        self._logger = logging.getLogger(name)
        self._said: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_once"):
            level = name.removesuffix("_once")

            def once(message: str, *args: Any, **kwargs: Any) -> None:
                if message not in self._said:
                    self._said.add(message)
                    getattr(self._logger, level)(message, *args)

            return once
        return getattr(self._logger, name)


def _standins() -> None:
    """The engine modules the four files import, each with what they read of it."""
    import triton.language as tl

    package("vllm")
    standin("vllm.envs", VLLM_BATCH_INVARIANT=False)  # unified: is_batch_invariant
    standin("vllm.logger", init_logger=_Logger)
    standin("vllm.platforms", current_platform=_Platform())
    standin("vllm.triton_utils", triton=triton, tl=tl)
    standin(
        "vllm.v1.kv_cache_interface",
        KVQuantMode=KVQuantMode,
        is_quantized_kv_cache=is_quantized_kv_cache,
    )
    if installed_version("packaging") is None:  # triton_decode_attention: version.parse
        standin("packaging.version", parse=_version)
    finfo = torch.finfo(torch.float8_e4m3fn)
    standin(
        "vllm.model_executor.layers.quantization.utils.quant_utils",
        FP8_DTYPE=torch.float8_e4m3fn,
        get_fp8_min_max=lambda: (finfo.min, finfo.max),
    )


def _version(text: str) -> tuple[int, ...]:
    """``packaging.version.parse`` for the one comparison the decode file makes (a Triton
    release against ``3.2.0``), where ``packaging`` is not installed.

    >>> _version("3.6.0") < _version("3.2.0"), _version("3.10.1+git") > _version("3.9")
    (False, True)
    """
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)
