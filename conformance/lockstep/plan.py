"""What the suite will draw for one backend: its capabilities intersected with the envelope.

The envelope (:mod:`conformance.lockstep.envelope`) is what production kernels run plus
the small shapes failures shrink to. A dimension the backend leaves open
(``None``) is drawn from the envelope; a small declared set (up to
:data:`EXACT_SET_MAX` values) is drawn exactly as declared; a large one (a
range, say) is intersected with the envelope. Everything left out is named in
the report, and a capability set that leaves nothing to draw is a
:class:`SetupError` that names the empty intersection.

>>> from spec.backend import Capabilities
>>> plan = plan_for(Capabilities("x", dtypes=frozenset({"float16"}), copy_on_write=False,
...                              head_dims=frozenset({64, 128})))
>>> plan.dtypes, plan.head_dims
(('float16',), (64, 128))
>>> for line in plan.notes:
...     print(line)
head dims: drawn exactly as declared: 64, 128
>>> for why in plan.skipped:
...     print(why)
dtype float32: not in the backend capabilities
dtype bfloat16: not in the backend capabilities
head dims 8, 16, 32, 80, 96, 112, 256 of the envelope: not declared by the backend
fork and copy-on-write rules: capabilities.copy_on_write is False
KV cache groups (a block table per group of layers): capabilities.kv_groups is False

The suite runs in passes (:data:`PASSES`), each a plan of its own kind:

>>> [p.kind for p in plan_for(Capabilities("y", variants={"sinks"})).passes()]
['short', 'wide', 'long', 'large pool', 'production', 'production', 'feature']
>>> plan_for(Capabilities("z", kv_groups=True)).passes()[-1].kind
'groups'
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from hypothesis import strategies as st

from conformance.errors import SetupError
from conformance.lockstep.envelope import Envelope, Shape, envelope_for
from conformance.lockstep.groups import (
    GROUPS,
    group_kv_heads,
    group_layer_counts,
    group_layouts,
    group_skips,
)
from conformance.lockstep.pairs import split_keys
from conformance.lockstep.variants import (
    feature_variant,
    fp8_layer_scales,
    kv_quantization,
    layer_variants,
)
from conformance.lockstep.workload import (
    LARGE_LOGIT_GAIN,
    WorkloadConfig,
    geometry_for,
    large_pool_base,
    pool_blocks,
    scale_for,
)
from spec.block_manager import cdiv
from spec.capabilities import Capabilities
from spec.kv_geometry import DTYPES, KVGeometry

_DTYPE_ORDER = ("float16", "float32", "bfloat16")
"""fp16 first: Hypothesis draws the first value most, and fp16 overflows where others do not."""
EXACT_SET_MAX = 16
"""A declared set of at most this many values is drawn exactly; a larger one is a range."""
PASSES = ("short", "wide", "long", "large pool", "production", "feature", "groups")
"""The kinds of example, in the order they run (see docs/conformance.md)."""
_WIDE_EXTRA = 4
"""Sequences a wide example may add beyond its starting width (new prompts mid-run)."""
_WIDE_TOKENS = 24
MAX_DRAFT = 4
"""Draft tokens per speculative row at most (the step's row then holds 1 + 4 tokens)."""
"""Tokens a wide example's sequence may grow by after its prompt (decodes)."""


@dataclass(frozen=True)
class Plan:
    """The values the suite draws from, after the backend's capabilities, for one pass."""

    capabilities: Capabilities
    envelope: Envelope
    block_sizes: tuple[int, ...]
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    gqa_ratios: tuple[int, ...]
    dtypes: tuple[str, ...]
    copy_on_write: bool
    prefix_caching: bool
    skipped: tuple[str, ...]
    notes: tuple[str, ...] = ()
    kind: str = "short"
    shape: Shape | None = None  # the production pass's one shape
    feature: str | None = None  # the feature pass's declared variant or fp8 KV dtype
    poison: bool = True  # may examples poison the slots no live token owns (NaN, +-inf)

    @property
    def long_context(self) -> bool:
        """Long-context examples only (the long pass)."""
        return self.kind == "long"

    @property
    def wide(self) -> bool:
        """Many live sequences per step (the wide and production passes)."""
        return self.kind in ("wide", "production")

    @property
    def widths(self) -> tuple[int, ...]:
        """Live sequences a wide example starts with."""
        env = self.envelope.wide_seqs
        return env[:1] if self.kind == "production" else env

    @property
    def max_live(self) -> int:
        """Live sequences at most."""
        return self.widths[-1] + _WIDE_EXTRA if self.wide else self.envelope.short_seqs

    @property
    def max_draft(self) -> int:
        """Drafts a speculative row may carry: 0 when the backend runs no such row.

        A row of ``1 + k`` tokens after cached context needs ``speculative``,
        ``chunked_prefill`` and ``max_query_len >= 1 + k``.
        """
        caps = self.capabilities
        if not (caps.speculative and caps.chunked_prefill):
            return 0
        limit = MAX_DRAFT if caps.max_query_len is None else caps.max_query_len - 1
        return max(0, min(MAX_DRAFT, limit))

    def configs(self) -> st.SearchStrategy[WorkloadConfig]:
        """Workload configurations; they shrink towards the first value of each set."""
        return _configs(self).filter(self._supported).filter(self._has_feature)

    def passes(self) -> list[Plan]:
        """One plan per pass, in order: the production pass once per production shape, the
        feature pass once per declared attention variant and fp8 KV dtype, the groups pass
        when the backend declares KV cache groups."""
        plans = [replace(self, kind=k) for k in PASSES[:4]]
        plans += [replace(self, kind="production", shape=s) for s in self._shapes()]
        caps = self.capabilities
        features = [*sorted(caps.variants), *sorted(caps.kv_dtypes)]
        plans += [replace(self, kind="feature", feature=f) for f in features]
        return plans + ([replace(self, kind="groups")] if caps.kv_groups else [])

    def _has_feature(self, config: WorkloadConfig) -> bool:
        """A feature pass's example uses its feature (some layer's variant, or the KV dtype)."""
        f = self.feature
        if f is None or f == config.geometry.kv_dtype:
            return True
        return any(f in config.variant(i).features for i in range(config.geometry.num_layers))

    def _supported(self, config: WorkloadConfig) -> bool:
        caps, g = self.capabilities, config.geometry
        layers = range(g.num_layers)
        return not any(caps.unsupported(g, config.num_heads, config.variant(i)) for i in layers)

    def _shapes(self) -> list[Shape]:
        """The envelope's production shapes, each value moved to the nearest one the plan draws."""
        shapes = []
        for s in self.envelope.production:
            snapped = Shape(
                _nearest(s.head_dim, self.head_dims),
                _nearest(s.num_kv_heads, self.kv_heads),
                _nearest(s.gqa_ratio, self.gqa_ratios),
                _nearest(s.block_size, self.block_sizes),
            )
            if snapped not in shapes and self._runs(snapped):
                shapes.append(snapped)
        return shapes

    def _runs(self, s: Shape) -> bool:
        """Some drawn dtype runs this shape (``excludes`` may veto it)."""
        heads = s.num_kv_heads * s.gqa_ratio
        return any(
            not self.capabilities.unsupported(
                KVGeometry(1, 4, s.block_size, s.num_kv_heads, s.head_dim, d), heads
            )
            for d in self.dtypes
        )


def _nearest(value: int, allowed: tuple[int, ...]) -> int:
    return min(allowed, key=lambda x: (abs(x - value), x))


@st.composite
def _configs(draw: st.DrawFn, plan: Plan) -> WorkloadConfig:
    """One workload's shape, dtype, options, and each layer's attention variant."""
    env = plan.envelope
    grouped = plan.kind == "groups"
    if plan.shape is not None:
        s = plan.shape
        block_size, kv, ratio, head_dim = s.block_size, s.num_kv_heads, s.gqa_ratio, s.head_dim
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
    geometry = replace(geometry, num_blocks=_pool_blocks(plan, block_size))
    layout = draw(group_layouts(plan.capabilities, layers, block_size)) if grouped else None
    large_logits = draw(st.sampled_from((True, False)))  # large logits first: drawn more often
    prefix_caching = draw(st.booleans()) if plan.prefix_caching else False
    kv_dtype, kv_scales = draw(kv_quantization(plan.capabilities, layers))
    spread = LARGE_LOGIT_GAIN if large_logits else 1.0  # the scores' spread, see scale_for
    variants = draw(layer_variants(plan.capabilities, layers, num_heads, plan.long_context, spread))
    if plan.feature is not None:  # the feature, on the first layer, at every kernel path
        first = feature_variant(
            plan.capabilities, plan.feature, num_heads, spread, split_keys(env.device)
        )
        variants = (first, *variants[1:])
        if plan.feature in plan.capabilities.kv_dtypes:
            kv_dtype, kv_scales = plan.feature, draw(fp8_layer_scales(plan.feature, layers))
    if plan.kind in OPENS_WITH_PAIRS and plan.prefix_caching:
        prefix_caching = True  # the opening's prefix hit
    geometry = replace(geometry, kv_dtype=kv_dtype, kv_scales=kv_scales)
    poison = draw(st.sampled_from(_POISON_DRAWS)) if plan.poison else None
    if kv_dtype is not None and poison is not None:
        poison = "NaN"  # an fp8 write saturates infinities to the largest finite value
    windows: tuple[int | None, ...] = ()
    if layout is not None:
        geometry = replace(geometry, layer_groups=layout.layer_groups)
        variants, windows = layout.variants(variants), layout.windows
    return WorkloadConfig(
        geometry,
        num_heads,
        scale_for(geometry.head_dim, large_logits),
        draw(st.integers(0, 2**32 - 1)),
        prefix_caching,
        plan.long_context,
        variants=() if all(v.is_plain for v in variants) else variants,
        block_base=large_pool_base(geometry) if plan.kind == "large pool" else 0,
        group_windows=windows,
        poison=poison,
    )


_POISON_DRAWS = (None, "NaN", "+inf", None, "-inf")
"""What slots no live token owns hold: finite values in two examples of five (shrinking there)."""


OPENS_WITH_PAIRS = ("feature", "large pool")
"""The passes whose examples open with every kernel path (see
:meth:`~conformance.lockstep.machine.LockstepMachine.start`)."""


def _pool_blocks(plan: Plan, block_size: int) -> int:
    """The pool of one example: small for short ones, room for every sequence of wide ones,
    and for a split-KV context twice over in the passes that open with one (per group in
    the groups pass)."""
    if plan.kind in OPENS_WITH_PAIRS:
        return _split_blocks(plan, block_size)
    if plan.long_context:
        return cdiv(plan.envelope.long_pool_tokens, block_size)
    if plan.wide:
        per_seq = cdiv(2 * block_size + 1 + _WIDE_TOKENS, block_size) + 1
        return plan.max_live * per_seq
    if plan.kind == "groups":  # the groups share one pool: each gets a split-KV context's
        return GROUPS * max(pool_blocks(block_size), _split_blocks(plan, block_size))
    return pool_blocks(block_size)


def _split_blocks(plan: Plan, block_size: int) -> int:
    return cdiv(2 * split_keys(plan.envelope.device), block_size) + 8


def _large_pool_dtypes(dtypes: tuple[str, ...]) -> tuple[str, ...]:
    """One 16-bit dtype for a large pool: 4 GiB of (lazily allocated) memory per tensor, not 8.

    float16 when declared: a numpy backend may hold bfloat16 in float32.
    """
    for d in ("float16", "bfloat16"):
        if d in dtypes:
            return (d,)
    return dtypes


def plan_for(
    capabilities: Capabilities, dtypes: Iterable[str] | None = None, device: str | None = None
) -> Plan:
    """The plan for a backend with these capabilities, optionally limited to ``dtypes``.

    ``device`` overrides ``capabilities.device`` in choosing the envelope.
    """
    caps = capabilities
    env = envelope_for(caps.device if device is None else device)
    skipped: list[str] = []
    notes: list[str] = []
    chosen_dtypes = _dtypes(caps, dtypes, skipped)
    ratios = _ratios(caps, env, skipped, notes)
    plan = Plan(
        capabilities=caps,
        envelope=env,
        block_sizes=_choose("block size", env.block_sizes, caps.block_sizes, skipped, notes),
        head_dims=_choose("head dim", env.head_dims, caps.head_dims, skipped, notes),
        kv_heads=_choose("KV head count", env.kv_heads, caps.num_kv_heads, skipped, notes),
        gqa_ratios=ratios,
        dtypes=chosen_dtypes,
        copy_on_write=caps.copy_on_write,
        prefix_caching=caps.prefix_caching,
        skipped=(),
    )
    if not caps.copy_on_write:
        skipped.append("fork and copy-on-write rules: capabilities.copy_on_write is False")
    if not caps.prefix_caching:
        skipped.append("prefix-cache hits: capabilities.prefix_caching is False")
    skipped += group_skips(caps)
    skipped += _query_skips(caps, env)
    if not plan.max_draft:
        skipped.append(
            "speculative rules (draft, verify, roll back): capabilities.speculative, "
            "chunked_prefill or max_query_len >= 2 missing"
        )
    skipped += _excluded(plan)
    return replace(plan, skipped=tuple(skipped), notes=tuple(notes))


def _dtypes(
    caps: Capabilities, dtypes: Iterable[str] | None, skipped: list[str]
) -> tuple[str, ...]:
    wanted = tuple(DTYPES) if dtypes is None else tuple(dtypes)
    unknown = [d for d in wanted if d not in DTYPES]
    if unknown:
        raise SetupError(f"unknown dtype {unknown[0]!r}: choose from {', '.join(DTYPES)}")
    chosen = tuple(d for d in _DTYPE_ORDER if d in wanted and d in caps.dtypes)
    skipped += [
        f"dtype {d}: not in the backend capabilities"
        for d in DTYPES
        if d in wanted and d not in caps.dtypes
    ]
    if not chosen:
        raise SetupError(
            f"the backend declares dtypes {sorted(caps.dtypes)}, none of the requested "
            f"{list(wanted)}: pass --dtype with one it supports"
        )
    return chosen


def _ratios(
    caps: Capabilities, env: Envelope, skipped: list[str], notes: list[str]
) -> tuple[int, ...]:
    ratios = _choose("GQA ratio", env.gqa_ratios, caps.gqa_ratios, skipped, notes)
    if caps.max_gqa_ratio is None:
        return ratios
    kept = tuple(r for r in ratios if r <= caps.max_gqa_ratio)
    if not kept:
        raise SetupError(
            f"no GQA ratio to draw: the ratios {list(ratios)} and capabilities.max_gqa_ratio "
            f"{caps.max_gqa_ratio} do not intersect"
        )
    above = [r for r in ratios if r not in kept]
    if above:
        skipped.append(
            f"GQA ratios {', '.join(map(str, above))}: above capabilities.max_gqa_ratio "
            f"{caps.max_gqa_ratio}"
        )
    return kept


def _choose(
    label: str,
    ours: tuple[int, ...],
    declared: AbstractSet[int] | None,
    skipped: list[str],
    notes: list[str],
) -> tuple[int, ...]:
    """One dimension's values to draw: the envelope's, a declared set, or their intersection."""
    if declared is None:
        return ours
    if not declared:
        raise SetupError(
            f"capabilities: the declared {label}s are an empty set, so there is nothing to draw: "
            "declare at least one, or None for any"
        )
    if len(declared) <= EXACT_SET_MAX:
        chosen = tuple(sorted(declared))
        notes.append(f"{label}s: drawn exactly as declared: {', '.join(map(str, chosen))}")
    else:
        chosen = tuple(x for x in ours if x in declared)
        if not chosen:
            chosen = tuple(sorted(declared)[:4])
            notes.append(
                f"{label}s: none of the envelope's {list(ours)} is declared; "
                f"drawing the backend's smallest {list(chosen)}"
            )
    missing = [x for x in ours if x not in chosen]
    if missing:
        skipped.append(
            f"{label}s {', '.join(map(str, missing))} of the envelope: not declared by the backend"
        )
    return chosen


def _query_skips(caps: Capabilities, env: Envelope) -> list[str]:
    """What the backend's batch limits leave out, and what the suite does instead."""
    out = []
    if caps.max_query_len == 1:
        out.append(
            "prefill attention (queries of more than one token): max_query_len is 1 "
            "(decode-only); prompts are still written and their KV compared"
        )
    elif caps.max_query_len is not None:
        out.append(
            f"queries of more than {caps.max_query_len} tokens: max_query_len; longer prefill "
            "chunks are written and compared, their attention is not run"
        )
    if not caps.decode:
        out.append("decode attention: capabilities.decode is False; decodes' KV is compared")
    if not caps.chunked_prefill:
        out.append(
            "prefill chunks after cached context: chunked_prefill is False; prompts are "
            "prefilled whole, and a chunk after cached context (a prefix hit) is not attended"
        )
    if not caps.mixed_batches:
        out.append(
            "decodes and prefill chunks in one attention call: mixed_batches is False; "
            "each step runs them as separate calls"
        )
    if caps.max_num_seqs is not None and caps.max_num_seqs < env.wide_seqs[-1] + _WIDE_EXTRA:
        out.append(
            f"attention calls of more than {caps.max_num_seqs} sequences: max_num_seqs; "
            "wider steps are split into several calls"
        )
    if caps.max_context_len is not None and caps.max_context_len < env.long_prompts[1]:
        out.append(
            f"contexts over {caps.max_context_len} tokens: max_context_len; sequences stop "
            "growing there and long prompts are cut to fit"
        )
    return out


def _excluded(plan: Plan) -> list[str]:
    """The shapes ``capabilities.excludes`` vetoes, by reason; an error if it vetoes them all."""
    caps = plan.capabilities
    if caps.excludes is None:
        return []
    reasons: Counter[str] = Counter()
    total = 0
    for dtype, d, b, kv, r in itertools.product(
        plan.dtypes, plan.head_dims, plan.block_sizes, plan.kv_heads, plan.gqa_ratios
    ):
        total += 1
        why = caps.unsupported(KVGeometry(1, 4, b, kv, d, dtype), kv * r)
        if why:
            reasons["; ".join(why)] += 1
    if sum(reasons.values()) == total:
        first = next(iter(reasons))
        raise SetupError(
            f"capabilities.excludes vetoes every shape of the intersection ({total} combinations "
            f"of dtypes {list(plan.dtypes)}, head dims {list(plan.head_dims)}, block sizes "
            f"{list(plan.block_sizes)}, KV heads {list(plan.kv_heads)}, GQA ratios "
            f"{list(plan.gqa_ratios)}), for example: {first}"
        )
    return [
        f"excluded by the backend: {why} ({n} of {total} shape combinations)"
        for why, n in sorted(reasons.items())
    ]
