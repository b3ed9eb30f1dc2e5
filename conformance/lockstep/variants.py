"""What the suite draws for attention variants and quantized KV, from a backend's capabilities.

Each layer of a workload gets its own :class:`~spec.attention.AttentionVariant`
(hybrid models mix windowed and full layers), drawn only from what the backend
declares in :attr:`~spec.capabilities.Capabilities.variants`, with values chosen so
that every variant changes the output, relative to ``score_spread`` (the
standard deviation of the scaled scores ``scale * q . k``, 1 or 16 in the suite):

* windows shorter than the context, and in a long-context workload (prompts
  of 300 to 1100 tokens) several times shorter, so that whole 64-key tiles lie
  before the window;
* soft-caps at 0.5 to 2.5 standard deviations, below the largest scores;
* sinks at 0 to 2 standard deviations, near the largest score, so that a
  sink takes real weight (most of it in a short context, some in a long one),
  a different one for every head and every layer;
* ALiBi slopes in the standard ratios between heads, the steepest 0.5 or
  0.125 standard deviations per token, so that distance matters within a few
  tokens (the standard slopes of the suite's 1 to 8 heads start at 2^-8 to
  2^-1: too gentle for a flipped sign to show in a short context), steeper by
  an eighth on each later layer; ALiBi and sinks are drawn together too (a
  bias measured from key 0 rather than from the query is a per-row constant
  that only a sink makes visible).

A quantized cache (``kv_dtype``) gets per-layer scales, different for K and V
(a kernel that swaps or shares them shows), at which unit-variance K and V
saturate beyond about 0.77, 1.5 or 3. Each is ``7/8`` times a power of two,
not a power of two, and the workload's K and V include values whose exact
quotient is an fp8 rounding tie (:func:`~conformance.lockstep.workload.tie_values`):
there a compiled kernel's division (or a multiply by the reciprocal) may
round either way, which the spec allows (:func:`spec.quant.quantize_range`)
and the report counts, while a quantizer that truncates still fails. Every
dequantized value (an fp8 value of at most 4 significant bits times 7) still
has at most 7 significant bits, exact in every activation dtype, so a kernel
may dequantize into float16 or bfloat16 without rounding and the output
tolerance stays the dtype's own.

A latent cache (one row ``[c_kv, k_rope]`` a token) has one scale for its
whole row, so its layers' pairs hold two equal scales (``latent=True``).

About half the layers are plain and half the caches unquantized, so that
the bugs of plain attention keep their share of the examples. Everything
shrinks towards plain attention and an unquantized cache.

>>> from hypothesis import find
>>> from spec.backend import Capabilities
>>> caps = Capabilities("x", variants={"window", "sinks"})
>>> draws = layer_variants(caps, num_layers=2, num_heads=4, long_context=False)
>>> [v.is_plain for v in find(draws, lambda v: True)]
[True, True]
>>> find(layer_variants(caps, 1, 2, False, score_spread=16.0), lambda v: v[0].sinks is not None)
(AttentionVariant(window=None, softcap=None, sinks=(8.0, 16.0), alibi_slopes=None),)
>>> fp8_scales("fp8_e4m3", 1.75), fp8_scales("fp8_e5m2", 1.75)   # 448 * 2**-8, 57344 * 2**-15
((0.00390625, 0.00390625), (3.0517578125e-05, 3.0517578125e-05))
>>> [x * 2**11 for x in drawn_scales("fp8_e4m3", 1.75, 0.875)]   # 7/8 of 2^-8 and of 2^-9
[7.0, 3.5]
"""

from __future__ import annotations

import itertools
import math

from hypothesis import strategies as st

from conformance.lockstep.workload import SCALE_MANTISSA, WorkloadConfig
from spec.attention import PLAIN, VARIANTS, AttentionVariant, alibi_slopes
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry
from spec.quant import FP8_FORMATS

WINDOWS = (3, 1, 8, 16, 5)
"""Windows for short workloads (contexts up to about 50): around block boundaries."""
LONG_WINDOWS = (64, 100, 256)
"""Windows for long-context workloads (300..1100 tokens): whole key tiles fall outside them."""
SOFTCAPS = (1.0, 2.5, 0.5)
"""Caps, in standard deviations of the scores: below the largest score of any context."""
SINK_LEVELS = (1.0, 0.0, 2.0)
"""Sink logits, in standard deviations of the scores (per head, plus or minus half of one)."""
ALIBI_STEEPEST = (0.5, 0.125)
"""The first head's slope, in standard deviations of the scores per token of distance."""
FP8_SATURATION = (1.75, 0.875, 3.5)
"""Where unit-variance K and V saturate: the scale is this over the format's largest value."""


def fp8_scales(kv_dtype: str, saturates_at: float) -> tuple[float, float]:
    """``(k_scale, v_scale)`` at which values beyond ``saturates_at`` saturate (a power of two
    when ``saturates_at`` is 1.75 times one, as every value of :data:`FP8_SATURATION` is)."""
    scale = saturates_at / FP8_FORMATS[kv_dtype].max_finite
    return scale, scale


LAYER_STEP = 0.125
"""How much steeper each later layer's ALiBi slopes are; sinks move by a quarter of it."""


def drawn_scales(kv_dtype: str, k_level: float, v_level: float) -> tuple[float, float]:
    """``(k_scale, v_scale)`` as the suite draws them: :func:`fp8_scales` of each level times
    :data:`SCALE_MANTISSA`, so not powers of two."""
    k, _ = fp8_scales(kv_dtype, k_level)
    v, _ = fp8_scales(kv_dtype, v_level)
    return k * SCALE_MANTISSA, v * SCALE_MANTISSA


def _variant(
    caps: Capabilities, num_heads: int, long_context: bool, spread: float, layer: int = 0
) -> st.SearchStrategy[AttentionVariant]:
    declared = caps.variants
    if not declared:
        return st.just(PLAIN)

    def maybe(name: str, values: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
        return st.one_of(st.none(), values) if name in declared else st.none()

    windows = LONG_WINDOWS if long_context else WINDOWS
    sinks = st.sampled_from(SINK_LEVELS).map(
        lambda level: sink_values(level, spread, num_heads, layer)
    )
    standard = alibi_slopes(num_heads)
    steeper = 1.0 + LAYER_STEP * layer
    slopes = st.builds(
        lambda top: tuple(top * spread * steeper * s / standard[0] for s in standard),
        st.sampled_from(ALIBI_STEEPEST),
    )
    varied = st.builds(
        _combine,
        maybe("window", st.sampled_from(windows)),
        maybe("softcap", st.sampled_from(SOFTCAPS).map(lambda c: c * spread)),
        maybe("sinks", sinks),
        maybe("alibi", slopes),
    )
    return st.one_of(st.just(PLAIN), varied)


def sink_values(level: float, spread: float, num_heads: int, layer: int = 0) -> tuple[float, ...]:
    """One sink per head, each different: head ``h`` at ``level + (h % 3 - 1) / 2`` standard
    deviations, moved by a sixteenth per three heads and by a thirty-second per layer.

    >>> sink_values(1.0, 16.0, 4, layer=1)
    (8.5, 16.5, 24.5, 9.5)
    """
    step = LAYER_STEP / 4
    return tuple(
        spread * (level + 0.5 * (h % 3 - 1) + 2 * step * (h // 3) + step * layer)
        for h in range(num_heads)
    )


def feature_variant(
    caps: Capabilities, feature: str, num_heads: int, spread: float, window: int
) -> AttentionVariant:
    """The variant of a feature pass's first layer: the pass's variant with the one it matters
    with (ALiBi with sinks, a window with a soft-cap) when declared; every declared variant
    under an fp8 KV dtype. The window is ``window`` keys (a split-KV context), sinks at the
    highest level, so that both still matter over hundreds of keys.

    >>> caps = Capabilities("x", variants={"sinks", "alibi", "window"})
    >>> sorted(feature_variant(caps, "sinks", 2, 1.0, 256).features)
    ['alibi', 'sinks']
    >>> sorted(feature_variant(caps, "fp8_e4m3", 2, 1.0, 256).features)
    ['alibi', 'sinks', 'window']
    """
    declared = caps.variants
    partners = {"alibi": "sinks", "sinks": "alibi", "window": "softcap", "softcap": "window"}
    pair = {feature, partners[feature]} & declared if feature in VARIANTS else set(declared)
    wanted = pair | ({feature} & set(VARIANTS))
    standard = alibi_slopes(num_heads)
    return AttentionVariant(
        window=window if "window" in wanted else None,
        softcap=SOFTCAPS[0] * spread if "softcap" in wanted else None,
        sinks=sink_values(max(SINK_LEVELS), spread, num_heads) if "sinks" in wanted else None,
        alibi_slopes=tuple(ALIBI_STEEPEST[1] * spread * x / standard[0] for x in standard)
        if "alibi" in wanted
        else None,
    )


def feature_variants(
    caps: Capabilities, feature: str, num_heads: int, spread: float, window: int
) -> list[AttentionVariant]:
    """The feature pass's first-layer variants, most wanted first: :func:`feature_variant`,
    then with one partner fewer at a time, down to the feature alone (or plain attention, for
    an fp8 pass): a backend that excludes a pairing (ALiBi with sinks) is drawn without it.

    >>> caps = Capabilities("x", variants={"sinks", "alibi"})
    >>> [sorted(v.features) for v in feature_variants(caps, "alibi", 2, 1.0, 256)]
    [['alibi', 'sinks'], ['alibi']]
    """
    best = feature_variant(caps, feature, num_heads, spread, window)
    out = [best]
    extra = sorted(best.features - {feature})
    for size in range(len(extra) - 1, -1, -1):
        for kept in itertools.combinations(extra, size):
            one = _only(best, {*kept} | ({feature} & set(VARIANTS)))
            if one not in out:
                out.append(one)
    return out


def _only(v: AttentionVariant, features: set[str]) -> AttentionVariant:
    """``v`` with only ``features`` kept."""
    return AttentionVariant(
        window=v.window if "window" in features else None,
        softcap=v.softcap if "softcap" in features else None,
        sinks=v.sinks if "sinks" in features else None,
        alibi_slopes=v.alibi_slopes if "alibi" in features else None,
    )


def _combine(window: object, softcap: object, sinks: object, slopes: object) -> AttentionVariant:
    return AttentionVariant(window, softcap, sinks, slopes)  # type: ignore[arg-type]


def layer_variants(
    caps: Capabilities,
    num_layers: int,
    num_heads: int,
    long_context: bool,
    score_spread: float = 1.0,
) -> st.SearchStrategy[tuple[AttentionVariant, ...]]:
    """One variant per layer, from the declared variants (all plain when none is declared)."""
    return st.tuples(
        *(_variant(caps, num_heads, long_context, score_spread, i) for i in range(num_layers))
    )


_Quantization = tuple[str | None, tuple[tuple[float, float], ...]]


def kv_quantization(
    caps: Capabilities, num_layers: int, latent: bool = False
) -> st.SearchStrategy[_Quantization]:
    """``(kv_dtype, kv_scales)``: unquantized, or a declared fp8 dtype with per-layer scales
    (equal K and V scales for a ``latent`` cache).

    >>> from hypothesis import find
    >>> caps = Capabilities("x", kv_dtypes={"fp8_e4m3"})
    >>> _, scales = find(kv_quantization(caps, 2, latent=True), lambda q: q[0] is not None)
    >>> all(k == v for k, v in scales)
    True
    """
    if not caps.kv_dtypes:
        return st.just((None, ()))

    def quantized(kv_dtype: str, levels: tuple[tuple[float, float], ...]) -> _Quantization:
        return kv_dtype, tuple(drawn_scales(kv_dtype, k, v) for k, v in levels)

    pairs = _LATENT_LEVELS if latent else _LEVEL_PAIRS
    levels = st.tuples(*(st.sampled_from(pairs) for _ in range(num_layers)))
    fp8 = st.builds(quantized, st.sampled_from(sorted(caps.kv_dtypes)), levels)
    return st.one_of(st.just((None, ())), fp8)


_LEVEL_PAIRS = [(k, v) for k in FP8_SATURATION for v in FP8_SATURATION if k != v]  # K != V
_LATENT_LEVELS = [(k, k) for k in FP8_SATURATION]  # one scale for a latent row


def fp8_layer_scales(
    kv_dtype: str, num_layers: int, latent: bool = False
) -> st.SearchStrategy[tuple[tuple[float, float], ...]]:
    """Each layer's ``(k_scale, v_scale)`` for a cache of ``kv_dtype``, as :func:`kv_quantization`
    draws them."""
    pairs = _LATENT_LEVELS if latent else _LEVEL_PAIRS
    one = st.sampled_from(pairs).map(lambda kv: drawn_scales(kv_dtype, *kv))
    return st.tuples(*(one for _ in range(num_layers)))


def describe(variant: AttentionVariant) -> str:
    """A short name for a layer's variant, as reports print it.

    >>> describe(AttentionVariant(window=8, softcap=2.5, sinks=(1.0, 2.0)))
    'attention with window 8, softcap 2.5, sinks (1, 2)'
    >>> describe(PLAIN)
    'plain attention'
    """
    parts = []
    if variant.window is not None:
        parts.append(f"window {variant.window}")
    if variant.softcap is not None:
        parts.append(f"softcap {variant.softcap:g}")
    for name, values in (("sinks", variant.sinks), ("ALiBi slopes", variant.alibi_slopes)):
        if values is not None:
            shown = ", ".join(f"{x:.4g}" for x in values[:4]) + (", ..." if len(values) > 4 else "")
            parts.append(f"{name} ({shown})")
    return "attention with " + ", ".join(parts) if parts else "plain attention"


def label(config: WorkloadConfig) -> str:
    """What a workload's shape line adds: its fp8 dtype and each layer's variants, if any.

    >>> from spec.backend import KVGeometry
    >>> g = KVGeometry(2, 4, 2, 1, 8, kv_dtype="fp8_e5m2", kv_scales=((1.0, 1.0),) * 2)
    >>> label(WorkloadConfig(g, 2, 0.3, 0, variants=(AttentionVariant(4, 2.0), PLAIN)))
    ' fp8_e5m2 window+softcap/plain'
    """
    parts = [config.geometry.kv_dtype] if config.geometry.kv_dtype else []
    if config.variants:
        names = (
            "+".join(n for n in VARIANTS if n in v.features) or "plain" for v in config.variants
        )
        parts.append("/".join(names))
    return "".join(" " + p for p in parts)


def describe_kv(geometry: KVGeometry, layer: int | None = None) -> str:
    """The cache dtype, with the layer's fp8 scales when quantized.

    >>> describe_kv(KVGeometry(1, 4, 2, 1, 8, "float16", "fp8_e4m3", ((2**-8, 2**-7),)), 0)
    'KV fp8_e4m3 (k_scale 2^-8, v_scale 2^-7)'
    """
    if geometry.kv_dtype is None:
        return f"KV {geometry.dtype}"
    if layer is None:
        return f"KV {geometry.kv_dtype}"
    k, v = geometry.kv_scales[layer]
    return f"KV {geometry.kv_dtype} (k_scale {_pow2(k)}, v_scale {_pow2(v)})"


def _pow2(x: float) -> str:
    mantissa, exponent = math.frexp(x)
    return f"2^{exponent - 1}" if mantissa == 0.5 else f"{x:.6g}"
