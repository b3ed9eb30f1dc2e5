"""What the suite draws for attention variants and quantized KV, from a backend's capabilities.

Each layer of a workload gets its own :class:`~spec.attention.AttentionVariant`
(hybrid models mix windowed and full layers), drawn only from what the backend
declares in :attr:`~spec.backend.Capabilities.variants`, with values chosen so
that every variant changes the output: windows shorter than the context,
soft-caps below the score range, sinks that take real weight, steep ALiBi
slopes. A quantized cache (``kv_dtype``) gets per-layer scales small enough
that some values saturate.

Everything shrinks towards plain attention and an unquantized cache.

>>> from hypothesis import find
>>> from spec.backend import Capabilities
>>> caps = Capabilities("x", variants={"window", "sinks"})
>>> draws = layer_variants(caps, num_layers=2, num_heads=4, long_context=False)
>>> [v.is_plain for v in find(draws, lambda v: True)]
[True, True]
"""

from __future__ import annotations

from hypothesis import strategies as st

from spec.attention import PLAIN, AttentionVariant, alibi_slopes
from spec.backend import Capabilities

WINDOWS = (3, 1, 8, 16, 33)
"""Windows for short workloads: shorter than most contexts, around block boundaries."""
LONG_WINDOWS = (64, 100, 256)
"""Windows for long-context workloads (300..1100 tokens): whole key tiles fall outside them."""
SOFTCAPS = (2.0, 5.0, 20.0)
"""Caps below the spread of the scores (up to about 16 with large logits)."""
SINK_LEVELS = (0.0, 2.0, -2.0)
"""Offsets of the per-head sink logits: near the scores, so a sink takes real weight."""
ALIBI_GAINS = (4.0, 1.0)
"""Multipliers on the standard slopes: steep slopes make distance matter within a few tokens."""
FP8_SCALES = (1 / 64, 1 / 256, 1 / 16)
"""Per-layer fp8 scales: with unit-variance K and V, 1/256 saturates e4m3 beyond |x| = 1.75."""


def _variant(
    caps: Capabilities, num_heads: int, long_context: bool
) -> st.SearchStrategy[AttentionVariant]:
    declared = caps.variants
    if not declared:
        return st.just(PLAIN)

    def maybe(name: str, values: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
        return st.one_of(st.none(), values) if name in declared else st.none()

    windows = LONG_WINDOWS if long_context else WINDOWS
    sinks = st.builds(
        lambda level, spread: tuple(level + spread * (h % 3 - 1) for h in range(num_heads)),
        st.sampled_from(SINK_LEVELS),
        st.sampled_from((1.0, 0.0)),
    )
    slopes = st.builds(
        lambda gain: tuple(gain * s for s in alibi_slopes(num_heads)), st.sampled_from(ALIBI_GAINS)
    )
    return st.builds(
        _combine,
        maybe("window", st.sampled_from(windows)),
        maybe("softcap", st.sampled_from(SOFTCAPS)),
        maybe("sinks", sinks),
        maybe("alibi", slopes),
    )


def _combine(window: object, softcap: object, sinks: object, slopes: object) -> AttentionVariant:
    # ALiBi with sinks is used by no known model and depends on the bias convention (a per-row
    # constant offset changes nothing without a sink): the suite does not combine them.
    if slopes is not None and sinks is not None:
        sinks = None
    return AttentionVariant(window, softcap, sinks, slopes)  # type: ignore[arg-type]


def layer_variants(
    caps: Capabilities, num_layers: int, num_heads: int, long_context: bool
) -> st.SearchStrategy[tuple[AttentionVariant, ...]]:
    """One variant per layer, from the declared variants (all plain when none is declared)."""
    return st.tuples(*(_variant(caps, num_heads, long_context) for _ in range(num_layers)))


def kv_quantization(
    caps: Capabilities, num_layers: int
) -> st.SearchStrategy[tuple[str | None, tuple[tuple[float, float], ...]]]:
    """``(kv_dtype, kv_scales)``: unquantized, or a declared fp8 dtype with per-layer scales."""
    if not caps.kv_dtypes:
        return st.just((None, ()))
    scales = st.tuples(
        *(
            st.tuples(st.sampled_from(FP8_SCALES), st.sampled_from(FP8_SCALES))
            for _ in range(num_layers)
        )
    )
    fp8 = st.tuples(st.sampled_from(sorted(caps.kv_dtypes)), scales)
    return st.one_of(st.just((None, ())), fp8)
