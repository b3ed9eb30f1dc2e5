"""One example's workload, drawn from a pass's plan: shape, dtype, pool, options and variants.

Each value shrinks towards the first of its set, so a failure shrinks to fp16, the
smallest block, one layer, plain attention. A pass's examples are the draws its backend
runs (:meth:`~conformance.lockstep.plan.Plan.supports`) that use its feature, if any
(:meth:`~conformance.lockstep.plan.Plan.has_feature`).
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from conformance.lockstep.groups import GROUPS, group_kv_heads, group_layer_counts, group_layouts
from conformance.lockstep.pairs import split_keys
from conformance.lockstep.plan import (
    LATENT,
    LATENT_FP8,
    LATENT_KINDS,
    LATENT_ONE_IN,
    Plan,
    many_parts_keys,
    nearest,
)
from conformance.lockstep.variants import (
    feature_variants,
    fp8_layer_scales,
    kv_quantization,
    layer_variants,
)
from conformance.lockstep.workload import (
    LARGE_LOGIT_GAIN,
    WorkloadConfig,
    geometry_for,
    large_pool_base,
    latent_geometry,
    latent_scale,
    nope_dims,
    pool_blocks,
    scale_for,
)
from spec.block_manager import cdiv

_WIDE_TOKENS = 24
"""Tokens a wide example's sequence may grow by after its prompt (decodes)."""


def configs(plan: Plan) -> st.SearchStrategy[WorkloadConfig]:
    """The pass's workload configurations: those its backend runs that use its feature."""
    return _configs(plan).filter(plan.supports).filter(plan.has_feature)


@st.composite
def _configs(draw: st.DrawFn, plan: Plan) -> WorkloadConfig:
    """One workload's shape, dtype, options, and each layer's attention variant."""
    env = plan.envelope
    grouped = plan.kind == "groups"
    latent = _latent_layout(draw, plan)
    if latent is not None:  # one KV head shared by every query head: drawn apart
        block_size, kv = draw(st.sampled_from(plan.block_sizes)), 1
        ratio, head_dim = draw(st.sampled_from(env.latent_heads)), sum(latent)
        if plan.shape is not None:
            block_size, ratio = plan.shape.block_size, plan.shape.gqa_ratio
    elif plan.shape is not None:
        s = plan.shape
        block_size, kv, ratio, head_dim = s.block_size, s.num_kv_heads, s.gqa_ratio, s.head_dim
    elif plan.kind == "split":  # one cheap shape: a prefill of thousands of keys costs per head
        block_size, kv, ratio = draw(st.sampled_from(plan.block_sizes)), 1, min(plan.gqa_ratios)
        head_dim = nearest(SPLIT_HEAD_DIM, plan.head_dims)
    else:
        block_size = draw(st.sampled_from(plan.block_sizes))
        kv_heads = env.kv_heads_for(plan.kind, plan.kv_heads)
        kv = draw(st.sampled_from(group_kv_heads(env, kv_heads) if grouped else kv_heads))
        ratio = draw(st.sampled_from(plan.gqa_ratios))
        head_dim = draw(st.sampled_from(plan.head_dims))
    dtypes = _large_pool_dtypes(plan.dtypes) if plan.kind == "large pool" else plan.dtypes
    dtype = draw(st.sampled_from(dtypes))
    layer_counts = group_layer_counts(env, kv) if grouped else env.layers_for(plan.kind, kv)
    layers = draw(st.sampled_from(layer_counts))
    geometry, num_heads = geometry_for(block_size, kv, ratio, head_dim, dtype, layers)
    if latent is not None:
        geometry = latent_geometry(block_size, *latent, dtype, layers)
    geometry = replace(geometry, num_blocks=_pool_blocks(plan, block_size))
    layout = draw(group_layouts(plan.caps, layers, block_size)) if grouped else None
    large_logits = draw(st.sampled_from((True, False)))  # large logits first: drawn more often
    prefix_caching = draw(st.booleans()) if plan.prefix_caching else False
    kv_dtype, kv_scales = draw(kv_quantization(plan.caps, layers, latent is not None))
    spread = LARGE_LOGIT_GAIN if large_logits else 1.0  # the scores' spread, see scale_for
    variants = draw(layer_variants(plan.caps, layers, num_heads, plan.long_context, spread))
    if plan.feature in (LATENT, LATENT_FP8):  # the latent pass's cache: unquantized, or fp8
        kv_dtype, kv_scales = None, ()
        if plan.feature == LATENT_FP8:
            kv_dtype = draw(st.sampled_from(sorted(plan.caps.kv_dtypes)))
            kv_scales = draw(fp8_layer_scales(kv_dtype, layers, latent=True))
    elif plan.feature is not None and plan.feature in plan.caps.kv_dtypes:
        scales = fp8_layer_scales(plan.feature, layers, latent=latent is not None)
        kv_dtype, kv_scales = plan.feature, draw(scales)
    if plan.feature is not None or plan.kind == "split":  # on the first layer, every path
        split = split_keys(plan.caps, env.device)
        if plan.kind == "split":  # a window as wide as the decode: it still runs every part
            split = many_parts_keys(plan.caps) or split
        feature = plan.feature or "every variant"  # (a name no variant has: all of them)
        wanted = feature_variants(plan.caps, feature, num_heads, spread, split)
        quantized = replace(geometry, kv_dtype=kv_dtype, kv_scales=kv_scales)
        runs = [v for v in wanted if not plan.caps.unsupported(quantized, num_heads, v)]
        variants = ((runs or wanted)[0], *variants[1:])  # its pairing, unless the backend vetoes
    if plan.kind in OPENS_WITH_PAIRS and plan.prefix_caching:
        prefix_caching = True  # the opening's prefix hit
    geometry = replace(geometry, kv_dtype=kv_dtype, kv_scales=kv_scales)
    poison = draw(st.sampled_from(_POISON_DRAWS[plan.poison]))
    if kv_dtype is not None and poison in ("+inf", "-inf"):
        poison = "NaN"  # an fp8 write saturates infinities to the largest finite value
    windows: tuple[int | None, ...] = ()
    if layout is not None:
        geometry = replace(geometry, layer_groups=layout.layer_groups)
        variants, windows = layout.variants(variants), layout.windows
    if latent is None:
        scale = scale_for(geometry.head_dim, large_logits)
    else:  # the model's, from its drawn per-head width: never the row's
        scale = latent_scale(draw(st.sampled_from(nope_dims(*latent))), latent[1], large_logits)
    return WorkloadConfig(
        geometry,
        num_heads,
        scale,
        draw(st.integers(0, 2**32 - 1)),
        prefix_caching,
        plan.long_context,
        variants=() if all(v.is_plain for v in variants) else variants,
        block_base=large_pool_base(geometry) if plan.kind == "large pool" else 0,
        group_windows=windows,
        poison=poison,
    )


def _latent_layout(draw: st.DrawFn, plan: Plan) -> tuple[int, int] | None:
    """The example's latent layout ``(latent_dim, rope_dim)``, or ``None`` for per-head K and V.

    The latent passes and a latent production shape always draw one; the
    short, wide, long and large-pool passes one example in :data:`LATENT_ONE_IN`
    (shrinking towards per-head K and V); the others never; every pass of a
    latent-only backend always. Nothing is drawn for a plan without latent
    layouts, so such a backend's examples are drawn as before.
    """
    if not plan.latent:
        return None
    s = plan.shape
    if s is not None:
        return None if s.latent_dim is None else (s.latent_dim, s.head_dim - s.latent_dim)
    if plan.feature not in (LATENT, LATENT_FP8) and not plan.latent_only:
        if plan.kind not in LATENT_KINDS:
            return None
        if draw(st.integers(0, LATENT_ONE_IN - 1)) != LATENT_ONE_IN - 1:
            return None
    return draw(st.sampled_from(plan.latent))


_POISON_DRAWS: dict[str, tuple[str | None, ...]] = {
    "nan": (None, "NaN", "+inf", None, "-inf"),
    "finite": (None, "finite"),
    "off": (None,),
}
"""What slots no live token owns hold, by the run's poison mode: with NaN, finite values in two
examples of five (shrinking there); with finite poison, a large finite value in one of two."""


OPENS_WITH_PAIRS = ("feature", "large pool")
"""The passes whose examples open with every kernel path (see
:meth:`~conformance.lockstep.machine.LockstepMachine.start`)."""


def _pool_blocks(plan: Plan, block_size: int) -> int:
    """The pool of one example: small for short ones, room for every sequence of wide ones,
    and for a split-KV context twice over in the passes that open with one (per group in
    the groups pass); the split pass's decode and a long prompt more."""
    if plan.kind in OPENS_WITH_PAIRS:
        return _split_blocks(plan, block_size)
    if plan.kind == "split":
        many = many_parts_keys(plan.caps) or 0
        return cdiv(many + plan.envelope.long_pool_tokens, block_size)
    if plan.long_context:
        return cdiv(plan.envelope.long_pool_tokens, block_size)
    if plan.wide:
        per_seq = cdiv(2 * block_size + 1 + _WIDE_TOKENS, block_size) + 1
        return plan.max_live * per_seq
    if plan.kind == "groups":  # the groups share one pool: each gets a split-KV context's
        return GROUPS * max(pool_blocks(block_size), _split_blocks(plan, block_size))
    return pool_blocks(block_size)


SPLIT_HEAD_DIM = 64
"""The split pass's head dim (the plan's nearest): its prompt of thousands of tokens costs an
interpreted kernel per key tile, and wide heads halve the tile."""


def _split_blocks(plan: Plan, block_size: int) -> int:
    return cdiv(2 * split_keys(plan.caps, plan.envelope.device), block_size) + 8


def _large_pool_dtypes(dtypes: tuple[str, ...]) -> tuple[str, ...]:
    """One 16-bit dtype for a large pool: 4 GiB of (lazily allocated) memory per tensor, not 8.

    float16 when declared: a numpy backend may hold bfloat16 in float32.
    """
    for d in ("float16", "bfloat16"):
        if d in dtypes:
            return (d,)
    return dtypes
