"""Input validation shared by the kernel wrappers: every failure names the argument and the fix.

A Triton kernel trusts its pointers: a wrong dtype reinterprets bits, a wrong
stride or an index past the end reads or writes someone else's memory without
any error. So each wrapper checks what it can before launching, and raises
:class:`~spec.errors.InvalidRequestError` (the spec's error for arguments that
can never be valid) before touching any state.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from spec.batch import check_copies
from spec.errors import InvalidRequestError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Query (activation) dtypes the kernels accept, and cache dtypes of an unquantized cache."""
CACHE_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2)
"""Cache dtypes: the activation dtypes, or fp8 (a quantized cache, see :mod:`._fp8`)."""


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def bf16_as_compiled() -> bool:
    """Whether bfloat16 arithmetic and conversions here are what compiled Triton computes.

    Always when compiled. Triton's own interpreter computes bfloat16 on raw
    bits and converts to it by truncation; the conformance suite's honest
    interpreter corrects both. Which one runs is found by running one tiny
    kernel, again whenever the interpreter's operations change (the suite's
    corrections install and uninstall), so a kernel can take the GPU's
    bfloat16 path under the interpreter wherever that computes right.
    """
    if not interpreting():
        return True
    from triton.runtime import interpreter

    ops = interpreter.InterpreterBuilder.__dict__
    key = tuple(id(ops.get(name)) for name in ("binary_op", "cast_impl", "create_fp_to_fp"))
    if key not in _BF16_PROBES:
        _BF16_PROBES.clear()  # one interpreter at a time: only the latest answer is kept
        x = torch.tensor([1.01171875], dtype=torch.float32)
        out = torch.zeros(1, dtype=torch.float32)
        _bf16_probe[(1,)](x, out)
        _BF16_PROBES[key] = float(out[0]) == 2.03125  # 1.015625 (to nearest) doubled
    return _BF16_PROBES[key]


_BF16_PROBES: dict[tuple[int, ...], bool] = {}


@triton.jit
def _bf16_probe(x_ptr, out_ptr):  # type: ignore[no-untyped-def]
    b = tl.load(x_ptr).to(tl.bfloat16)  # rounded to nearest: 1.015625; truncated: 1.0078125
    tl.store(out_ptr, (b + b).to(tl.float32))


def check_device(device: torch.device, *tensors: tuple[str, torch.Tensor]) -> None:
    """Every tensor lives on ``device``, and a kernel can run there."""
    for name, t in tensors:
        if t.device != device:
            raise InvalidRequestError(f"{name} is on {t.device}, expected {device}")
    if device.type == "cpu" and not interpreting():
        raise InvalidRequestError(
            "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing triton"
        )
    if device.type == "cuda" and interpreting():
        raise InvalidRequestError(
            "TRITON_INTERPRET=1 is set, so kernels cannot run on CUDA tensors"
        )
    if device.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"device {device} is not supported (cpu or cuda)")


def check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """``t`` is a torch tensor of ``ndim`` dimensions and one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise InvalidRequestError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise InvalidRequestError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise InvalidRequestError(f"{name} has dtype {t.dtype}, expected one of: {names}")
    return t


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels index ``t`` as a dense row-major array."""
    if not t.is_contiguous():
        raise InvalidRequestError(
            f"{name} must be contiguous (call .contiguous()), strides {t.stride()}"
        )


def check_last_dim_dense(name: str, t: torch.Tensor) -> None:
    """The last dimension is unit-stride (rows may be strided, e.g. a slice of a QKV buffer)."""
    if t.stride(-1) != 1:
        raise InvalidRequestError(
            f"{name} must have unit stride in its last dimension: {t.stride()}"
        )


def check_cache_pair(k_cache: object, v_cache: object) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches: same ``[num_blocks, block_size, H_kv, D]`` shape and dtype."""
    k = check_tensor("k_cache", k_cache, 4, CACHE_DTYPES)
    v = check_tensor("v_cache", v_cache, 4, CACHE_DTYPES)
    if k.shape != v.shape or k.dtype != v.dtype:
        raise InvalidRequestError(
            f"k_cache {tuple(k.shape)} {k.dtype} and v_cache {tuple(v.shape)} {v.dtype} differ"
        )
    check_contiguous("k_cache", k)
    check_contiguous("v_cache", v)
    return k, v


def check_write_slots(slots: torch.Tensor, num_slots: int, check_range: bool) -> None:
    """A KV write's slots are dense and (``check_range``: a host check, a GPU sync) each is
    ``-1`` (padding) or in ``0..num_slots - 1``."""
    if not slots.is_contiguous():
        raise InvalidRequestError("slot_mapping must be contiguous")
    if not check_range or slots.shape[0] == 0:
        return
    bad = (slots != -1) & ((slots < 0) | (slots >= num_slots))
    if bool(bad.any()):
        first = int(slots[bad][0])
        raise InvalidRequestError(f"slot {first} is outside 0..{num_slots - 1} (and is not -1)")


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``tl.arange`` lengths must be powers of two).

    >>> [next_pow2(n) for n in (1, 3, 16, 24, 96)]
    [1, 4, 16, 32, 128]
    """
    return 1 << max(0, (n - 1).bit_length())


def independent_copies(copies: Sequence[tuple[int, int]], num_blocks: int) -> list[tuple[int, int]]:
    """A step's copy list, validated: ids in the pool, copies independent of their order.

    No block may be both a source and a destination, and no destination may
    repeat; otherwise the result would depend on the order the copies run in.
    The spec's rule, :func:`spec.batch.check_copies`: ids are ints (``1.7``,
    ``'3'`` and ``True`` are refused, never truncated or parsed).
    """
    return list(check_copies(copies, num_blocks))
