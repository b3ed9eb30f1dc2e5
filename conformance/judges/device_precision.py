"""The arithmetic a same-precision reference computes on a torch device, named by dtype.

:class:`DevicePrecision` is :class:`spec.attention.Precision` for tensors: which
products and sums run in float32, what K, V, Q and P are rounded to. The rounding
itself (:func:`round_to_dtype`, :func:`truncate_to_tf32`) agrees bit for bit with
:mod:`conformance.judges.dtypes` and :mod:`spec.quant`, and :func:`resolve_device`
names a device this machine does not have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spec.errors import InvalidRequestError
from spec.quant import FP8_FORMATS
from spec.validate import check_choice

if TYPE_CHECKING:
    import torch

ROUNDING_DTYPES = ("float32", "float16", "bfloat16")
"""The activation dtypes a same-precision reference rounds to."""
FP8_NAMES = tuple(FP8_FORMATS)
"""The fp8 formats a kernel declaring ``"fp8"`` products casts Q and P to."""


class DeviceUnavailableError(InvalidRequestError):
    """A device this machine does not have, or torch missing: a setup error naming it."""


@dataclass(frozen=True)
class DevicePrecision:
    """:class:`spec.attention.Precision` for tensors: the roundings named by dtype, not callables.

    ``compute``: the dtype of every product and sum. ``round_kv``: the dtype
    the K and V read are rounded to (through float32, as
    :func:`conformance.judges.dtypes.round_to` does). ``round_p``: the dtype the
    unnormalised probabilities are rounded to before ``P @ V`` (an fp8 format, for a
    kernel declaring ``"fp8"`` products). The declared products
    (:data:`spec.capabilities.PRODUCTS`): ``tf32`` truncates both operands of
    both products to TF32; ``round_q`` rounds the query (to an fp8 format);
    ``round_qk_products`` each ``q_d * k_d`` before the score's sum; ``p_normalised``:
    ``round_p`` rounds the normalised probabilities (``"normalised"`` products).
    """

    compute: str = "float64"
    round_kv: str | None = None
    round_p: str | None = None
    tf32: bool = False
    round_q: str | None = None
    round_qk_products: str | None = None
    p_normalised: bool = False

    def __post_init__(self) -> None:
        check_choice("compute", self.compute, ("float64", "float32"))
        for name in ("round_kv", "round_p", "round_q", "round_qk_products"):
            value = getattr(self, name)
            if value is not None:
                check_choice(name, value, ROUNDING_DTYPES + FP8_NAMES)


EXACT = DevicePrecision()
"""The spec's own arithmetic: float64, nothing rounded."""


def same_precision(
    dtype: str, quantized_kv: bool, products: str = "exact", kv_dtype: str | None = None
) -> DevicePrecision:
    """What :func:`conformance.judges.numerics.same_precision` computes, on tensors.

    >>> same_precision("float16", quantized_kv=True)  # doctest: +NORMALIZE_WHITESPACE
    DevicePrecision(compute='float32', round_kv='float16', round_p='float16', tf32=False,
                    round_q=None, round_qk_products=None, p_normalised=False)
    """
    dtype = check_choice("dtype", dtype, ROUNDING_DTYPES)
    fp8 = kv_dtype if products == "fp8" else None
    return DevicePrecision(
        compute="float32",
        round_kv=dtype if quantized_kv else None,
        round_p=fp8 or (None if dtype == "float32" else dtype),
        tf32=products == "tf32" and dtype == "float32",
        round_q=fp8,
        round_qk_products=dtype if products == "activation" and dtype != "float32" else None,
        p_normalised=products == "normalised" and dtype != "float32",
    )


def round_to_dtype(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """``x`` rounded to ``dtype`` through float32, as :func:`~conformance.judges.dtypes.round_to`
    (or, for an fp8 format, as :func:`spec.quant.round_fp8`: saturating).

    Both round to nearest, ties to even, so the two agree bit for bit
    (``tests/test_fast_reference.py`` checks ties, subnormals and overflow).
    """
    th = import_torch()
    name = check_choice("dtype", dtype, ROUNDING_DTYPES + FP8_NAMES)
    if name in FP8_NAMES:
        top = FP8_FORMATS[name].max_finite
        fp8 = th.float8_e4m3fn if name == "fp8_e4m3" else th.float8_e5m2
        saturated: torch.Tensor = x.to(th.float32).clamp(-top, top).to(fp8)
        return saturated
    out: torch.Tensor = x.to(th.float32).to(getattr(th, name))
    return out


def truncate_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` with the low 13 mantissa bits dropped: a TF32 tensor-core operand."""
    th = import_torch()
    bits = x.to(th.float32).contiguous().view(th.int32) & -(1 << 13)
    out: torch.Tensor = bits.view(th.float32)
    return out


def import_torch() -> Any:
    """torch, imported on first use: the rest of the suite runs without it."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the test environment has torch
        raise DeviceUnavailableError(f"the fast reference needs torch: {e}") from e
    return torch


def resolve_device(device: object) -> torch.device:
    """``device`` as a torch device this machine has; otherwise :class:`DeviceUnavailableError`.

    >>> resolve_device("cpu")
    device(type='cpu')
    >>> try:
    ...     resolve_device("cuda:7" if not __import__("torch").cuda.is_available() else "cuda:999")
    ... except DeviceUnavailableError as e:
    ...     print(str(e).split(":")[0])
    device 'cuda
    """
    torch = import_torch()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceUnavailableError(f"device {device!r} is not a torch device: {e}") from e
    if dev.type == "cpu":
        return dev  # type: ignore[no-any-return]
    if dev.type != "cuda":
        raise DeviceUnavailableError(f"device {device!r}: the fast reference runs on cpu or cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if dev.index is None else dev.index
    if not 0 <= index < count:  # torch keeps the index in 8 bits: cuda:999 reads as -25
        raise DeviceUnavailableError(
            f"device {device!r}: this machine has {count} CUDA device(s)"
            + (f" (cuda:0 .. cuda:{count - 1})" if count else "")
        )
    return torch.device("cuda", index)  # type: ignore[no-any-return]
