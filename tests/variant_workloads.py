"""Scripted workloads for the planted variant and fp8 bugs (:mod:`conformance.planted.variants`).

``test_conformance_lockstep.py`` runs each on the correct backends (it must
pass) and on its planted bug (it must be caught, as one of the listed kinds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from conformance.lockstep.driver import Lockstep
from conformance.lockstep.variants import drawn_scales, fp8_scales
from conformance.lockstep.workload import WorkloadConfig, geometry_for, scale_for
from spec.attention import PLAIN, AttentionVariant

HEADS = 4  # two KV heads, two query heads each


def _prefill_then_decode(ls: Lockstep) -> None:
    """A 9-token prompt (B = 4: a partial last block), then two decodes."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    ls.add(0, prompt)
    ls.step([(0, prompt)])
    ls.step([(0, [3])])
    ls.step([(0, [5])])


def _config(
    variant: AttentionVariant = PLAIN,
    kv_dtype: str | None = None,
    large: bool = False,
    drawn: bool = False,
) -> WorkloadConfig:
    """One layer of 4 query heads on 2 KV heads; ``drawn``: fp8 scales as the suite draws them
    (K and V different, 7/8 of a power of two), else one power of two for both."""
    geometry, heads = geometry_for(4, 2, HEADS // 2, 8, "float32", 1)
    assert heads == HEADS
    if kv_dtype is not None:
        scales = drawn_scales(kv_dtype, 1.75, 0.875) if drawn else fp8_scales(kv_dtype, 1.75)
        geometry = replace(geometry, kv_dtype=kv_dtype, kv_scales=(scales,))
    variants = () if variant.is_plain else (variant,)
    return WorkloadConfig(geometry, heads, scale_for(8, large), 13, variants=variants)


Workload = tuple[Callable[[Lockstep], None], WorkloadConfig, set[str]]

VARIANT_WORKLOADS: dict[str, Workload] = {
    "WindowOffByOne": (_prefill_then_decode, _config(AttentionVariant(window=3)), {"output"}),
    "SoftcapUnscaled": (
        _prefill_then_decode,
        _config(AttentionVariant(softcap=16.0), large=True),
        {"output"},
    ),
    "SoftcapAfterExp": (_prefill_then_decode, _config(AttentionVariant(softcap=1.0)), {"output"}),
    "SinkNotInDenominator": (
        _prefill_then_decode,
        _config(AttentionVariant(sinks=(1.0, 0.5, 2.0, 0.0))),
        {"output"},
    ),
    "AlibiSignFlipped": (
        _prefill_then_decode,
        _config(AttentionVariant(alibi_slopes=(0.5, 0.25, 0.125, 0.0625))),
        {"output"},
    ),
    "Fp8ScaleTwice": (_prefill_then_decode, _config(kv_dtype="fp8_e4m3"), {"output"}),
    "Fp8ScaleIgnored": (_prefill_then_decode, _config(kv_dtype="fp8_e5m2"), {"output"}),
    "Fp8NoSaturation": (_prefill_then_decode, _config(kv_dtype="fp8_e4m3"), {"K", "V"}),
    "KVScalesSwapped": (
        _prefill_then_decode,
        _config(kv_dtype="fp8_e4m3", drawn=True),
        {"output"},
    ),
    "Fp8Truncates": (
        _prefill_then_decode,
        _config(kv_dtype="fp8_e5m2", drawn=True),
        {"K", "V"},
    ),
    "AlibiFromKeyZero": (
        _prefill_then_decode,
        _config(AttentionVariant(sinks=(1.0, 0.5, 2.0, 0.0), alibi_slopes=(0.5, 0.25, 0.2, 0.1))),
        {"output"},
    ),
}
