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
the split pass (a decode split into 9 parts or more): no capabilities.decode_split says so
latent layouts (multi-head latent attention): capabilities.latent is empty

The suite runs in passes (:data:`PASSES`), each a plan of its own kind:

>>> [p.kind for p in plan_for(Capabilities("y", variants={"sinks"})).passes()]
['short', 'wide', 'long', 'large pool', 'production', 'production', 'feature']
>>> plan_for(Capabilities("z", kv_groups=True)).passes()[-1].kind
'groups'

A backend that declares the latent layout (:attr:`Capabilities.latent
<spec.capabilities.Capabilities>`, ``None`` for any) has latent geometries drawn
among the others (one example in :data:`LATENT_ONE_IN` of the short, wide,
long and large-pool passes) and a feature pass of its own that opens with
every kernel path (and, when it declares an fp8 KV dtype, another with an fp8
latent cache):

>>> mla = plan_for(Capabilities("m", kv_dtypes={"fp8_e4m3"}, latent={(32, 16), (512, 64)}))
>>> mla.latent, [p.feature for p in mla.passes() if p.kind == "feature"]
(((32, 16), (512, 64)), ['fp8_e4m3', 'latent', 'latent fp8'])
>>> plan_for(Capabilities("n")).latent, plan_for(Capabilities("n")).skipped[-1]
((), 'latent layouts (multi-head latent attention): capabilities.latent is empty')
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from conformance.errors import SetupError
from conformance.lockstep.envelope import Envelope, Shape, envelope_for
from conformance.lockstep.groups import (
    group_skips,
)
from conformance.lockstep.pairs import split_keys
from conformance.lockstep.variants import (
    feature_variants,
)
from conformance.lockstep.workload import (
    WorkloadConfig,
    latent_geometry,
)
from spec.attention import AttentionVariant
from spec.capabilities import Capabilities
from spec.kv_geometry import DTYPES, KVGeometry

_DTYPE_ORDER = ("float16", "float32", "bfloat16")
"""fp16 first: Hypothesis draws the first value most, and fp16 overflows where others do not."""
EXACT_SET_MAX = 16
"""A declared set of at most this many values is drawn exactly; a larger one is a range."""
PASSES = ("short", "wide", "long", "split", "large pool", "production", "feature", "groups")
"""The kinds of example, in the order they run (see docs/conformance.md)."""
MANY_PARTS = 9
"""The split pass's decode runs this many parts or more: past 8, where a merge that reads a
fixed 8 partial results (or an 8-bit count) goes wrong."""
_WIDE_EXTRA = 4
"""Sequences a wide example may add beyond its starting width (new prompts mid-run)."""
MAX_DRAFT = 4
"""Draft tokens per speculative row at most (the step's row then holds 1 + 4 tokens)."""
LATENT = "latent"
LATENT_FP8 = "latent fp8"
"""The feature passes of the latent layout: its rows unquantized, and in an fp8 cache."""
LATENT_ONE_IN = 6
"""Of the short, wide, long and large-pool examples, about one in this many is latent."""
LATENT_KINDS = ("short", "wide", "long", "large pool")
"""The passes that draw latent geometries among the others."""


@dataclass(frozen=True)
class Plan:
    """The values the suite draws from, after the backend's capabilities, for one pass."""

    caps: Capabilities
    envelope: Envelope
    block_sizes: tuple[int, ...]
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    gqa_ratios: tuple[int, ...]
    dtypes: tuple[str, ...]
    copy_on_write: bool
    prefix_caching: bool
    skipped: tuple[str, ...]
    latent: tuple[tuple[int, int], ...] = ()  # latent layouts (latent_dim, rope_dim) to draw
    latent_only: bool = False  # the backend vetoes per-head K and V: every example is latent
    notes: tuple[str, ...] = ()
    kind: str = "short"
    shape: Shape | None = None  # the production pass's one shape
    feature: str | None = None  # the feature pass's declared variant or fp8 KV dtype
    poison: str = "nan"  # what unowned slots may hold: "nan" (NaN, +-inf), "finite", "off"

    @property
    def long_context(self) -> bool:
        """Long-context examples only (the long pass, and the split pass that opens with one)."""
        return self.kind in ("long", "split")

    @property
    def wide(self) -> bool:
        """Many live sequences per step (the wide and production passes)."""
        return self.kind in ("wide", "production")

    @property
    def widths(self) -> tuple[int, ...]:
        """Live sequences a wide example starts with (a production shape's, if it says)."""
        env = self.envelope.wide_seqs
        if self.kind != "production":
            return env
        return env[:1] if self.shape is None or self.shape.width is None else (self.shape.width,)

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
        caps = self.caps
        if not (caps.speculative and caps.chunked_prefill):
            return 0
        limit = MAX_DRAFT if caps.max_query_len is None else caps.max_query_len - 1
        return max(0, min(MAX_DRAFT, limit))

    def passes(self) -> list[Plan]:
        """One plan per pass, in order: the split pass when the backend's plan splits a decode
        into more than 8 parts, the large pool again on latent rows when declared, the
        production pass once per production shape, the feature pass once per declared
        attention variant and fp8 KV dtype, the groups pass when the backend declares KV
        cache groups."""
        caps = self.caps
        plans = [replace(self, kind=k) for k in PASSES[:3]]
        plans += [replace(self, kind="split")] if many_parts_keys(caps) else []
        plans.append(replace(self, kind="large pool"))
        plans += [replace(self, kind="large pool", feature=LATENT)] if self.latent else []
        plans += [replace(self, kind="production", shape=s) for s in self._shapes()]
        features = [*sorted(caps.variants), *sorted(caps.kv_dtypes)]
        if self.latent:
            features += [LATENT, LATENT_FP8] if caps.kv_dtypes else [LATENT]
        plans += [replace(self, kind="feature", feature=f) for f in features]
        return plans + ([replace(self, kind="groups")] if caps.kv_groups else [])

    def vetoed(self) -> str | None:
        """Why a feature pass cannot draw at all: its feature, however little is paired with
        it, is vetoed on every shape (``None`` for the other passes, and when it can draw)."""
        f, caps = self.feature, self.caps
        if f is None or caps.excludes is None:
            return None
        if f in (LATENT, LATENT_FP8):
            kv_dtypes = sorted(caps.kv_dtypes) if f == LATENT_FP8 else [None]
            if any(self._runs_latent(layout, kv) for layout in self.latent for kv in kv_dtypes):
                return None
            return f"the backend's excludes vetoes the {f} layouts on every shape"
        least = feature_variants(caps, f, 4, 1.0, split_keys(caps, self.envelope.device))[-1]
        kv = f if f in caps.kv_dtypes else None
        if self.latent_only:
            if any(self._runs_latent(layout, kv, least) for layout in self.latent):
                return None
            return f"the backend's excludes vetoes {f} on every latent layout"
        for dtype, d, b, h_kv, r in itertools.product(
            self.dtypes, self.head_dims, self.block_sizes, self.kv_heads, self.gqa_ratios
        ):
            g = KVGeometry(1, 4, b, h_kv, d, dtype)
            if kv is not None:
                g = replace(g, kv_dtype=kv, kv_scales=((1.0, 1.0),))
            if not caps.unsupported(g, h_kv * r, _heads(least, h_kv * r)):
                return None
        return f"the backend's excludes vetoes {f} on every shape"

    def _runs_latent(
        self,
        layout: tuple[int, int],
        kv_dtype: str | None,
        variant: AttentionVariant | None = None,
    ) -> bool:
        """Some drawn dtype and block size runs this latent layout (with ``variant``, when
        given): ``excludes`` may veto it."""
        heads = self.envelope.latent_heads[0]
        v = None if variant is None else _heads(variant, heads)
        for dtype, b in itertools.product(self.dtypes, self.block_sizes):
            g = latent_geometry(b, *layout, dtype, 1)
            if kv_dtype is not None:
                g = replace(g, kv_dtype=kv_dtype, kv_scales=((1.0, 1.0),))
            if not self.caps.unsupported(g, heads, v):
                return True
        return False

    def has_feature(self, config: WorkloadConfig) -> bool:
        """A feature pass's example uses its feature (some layer's variant, or the KV dtype)."""
        f, g = self.feature, config.geometry
        if f in (LATENT, LATENT_FP8):
            return g.is_latent and (f == LATENT) == (g.kv_dtype is None)
        if f is None or f == config.geometry.kv_dtype:
            return True
        return any(f in config.variant(i).features for i in range(config.geometry.num_layers))

    def supports(self, config: WorkloadConfig) -> bool:
        """The backend runs the example: asked of the geometry it allocates (a large pool's
        whole, past 2^31 elements, not the spec's part of it)."""
        caps, g = self.caps, config.geometry
        if config.block_base:
            g = replace(g, num_blocks=config.block_base + g.num_blocks + 1)
        layers = range(g.num_layers)
        return not any(caps.unsupported(g, config.num_heads, config.variant(i)) for i in layers)

    def _shapes(self) -> list[Shape]:
        """The envelope's production shapes, each value moved to the nearest one the plan draws
        (a latent shape to the nearest latent layout; none when the plan draws none)."""
        shapes = []
        for s in self.envelope.production:
            if s.latent_dim is not None:
                latent = self._latent_shape(s)
                if latent is not None and latent not in shapes:
                    shapes.append(latent)
                continue
            snapped = Shape(
                nearest(s.head_dim, self.head_dims),
                nearest(s.num_kv_heads, self.kv_heads),
                nearest(s.gqa_ratio, self.gqa_ratios),
                nearest(s.block_size, self.block_sizes),
            )
            if snapped not in shapes and self._runs(snapped):
                shapes.append(snapped)
        return shapes

    def _latent_shape(self, s: Shape) -> Shape | None:
        """A latent production shape, its layout moved to the nearest the plan draws."""
        if not self.latent:
            return None
        assert s.latent_dim is not None
        want = (s.latent_dim, s.head_dim - s.latent_dim)
        declared = self.caps.latent
        if declared is None or want in declared:  # the production layout itself, when it runs
            layout = want
        else:
            layout = min(self.latent, key=lambda x: (abs(sum(x) - sum(want)), x))
        block = nearest(s.block_size, self.block_sizes)
        if not any(
            not self.caps.unsupported(latent_geometry(block, *layout, d, 1), s.gqa_ratio)
            for d in self.dtypes
        ):
            return None
        return Shape(sum(layout), 1, s.gqa_ratio, block, layout[0], s.width)

    def _runs(self, s: Shape) -> bool:
        """Some drawn dtype runs this shape (``excludes`` may veto it)."""
        heads = s.num_kv_heads * s.gqa_ratio
        return any(
            not self.caps.unsupported(
                KVGeometry(1, 4, s.block_size, s.num_kv_heads, s.head_dim, d), heads
            )
            for d in self.dtypes
        )


def nearest(value: int, allowed: tuple[int, ...]) -> int:
    """The allowed value closest to ``value`` (the smaller on a tie)."""
    return min(allowed, key=lambda x: (abs(x - value), x))


def many_parts_keys(caps: Capabilities) -> int | None:
    """The visible keys of a lone decode that the backend's declared plan splits into
    :data:`MANY_PARTS` parts or more; ``None`` when it declares none that does (or its
    ``max_context_len`` rules it out).

    >>> from spec.capabilities import DecodeSplit
    >>> many_parts_keys(Capabilities("x", decode_split=DecodeSplit(1024, 512, 64)))
    4097
    >>> many_parts_keys(Capabilities("x", decode_split=DecodeSplit(256, 128, 4))) is None
    True
    """
    plan = caps.decode_split
    if plan is None or plan.max_parts < MANY_PARTS:
        return None
    keys = plan.keys_for(MANY_PARTS)
    if caps.max_context_len is not None and caps.max_context_len < keys:
        return None
    return keys


def plan_for(
    caps: Capabilities, dtypes: Iterable[str] | None = None, device: str | None = None
) -> Plan:
    """The plan for a backend with these capabilities, optionally limited to ``dtypes``.

    ``device`` overrides ``caps.device`` in choosing the envelope.
    """
    env = envelope_for(caps.device if device is None else device)
    skipped: list[str] = []
    notes: list[str] = []
    chosen_dtypes = _dtypes(caps, dtypes, skipped)
    ratios = _ratios(caps, env, skipped, notes)
    plan = Plan(
        caps=caps,
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
    if not many_parts_keys(caps):
        skipped.append(
            f"the split pass (a decode split into {MANY_PARTS} parts or more): "
            "no capabilities.decode_split says so"
        )
    if not plan.max_draft:
        skipped.append(
            "speculative rules (draft, verify, roll back): capabilities.speculative, "
            "chunked_prefill or max_query_len >= 2 missing"
        )
    plan = replace(plan, latent=_latent_layouts(plan, skipped, notes))
    excluded, every = _excluded(plan)
    skipped += excluded
    if every:  # a latent-only backend (an MLA kernel): every example draws a latent layout
        plan = replace(plan, latent_only=True)
    else:
        skipped += _excluded_pairings(plan)
    return replace(plan, skipped=tuple(skipped), notes=tuple(notes))


def _latent_layouts(
    plan: Plan, skipped: list[str], notes: list[str]
) -> tuple[tuple[int, int], ...]:
    """The latent layouts to draw: the envelope's when ``capabilities.latent`` is ``None``, the
    declared ones (exactly, when few), none when it is empty; each that ``excludes`` vetoes
    on every dtype and block size left out, with why."""
    caps, env = plan.caps, plan.envelope
    if caps.latent is not None and not caps.latent:
        skipped.append("latent layouts (multi-head latent attention): capabilities.latent is empty")
        return ()
    if caps.latent is None:
        chosen = env.latent
    elif len(caps.latent) <= EXACT_SET_MAX:
        chosen = tuple(sorted(caps.latent))
        notes.append(f"latent layouts: drawn exactly as declared: {_layouts(chosen)}")
    else:
        chosen = tuple(x for x in env.latent if x in caps.latent) or tuple(sorted(caps.latent))[:4]
    kept = tuple(x for x in chosen if plan._runs_latent(x, None))
    for x in chosen:
        if x not in kept:
            g = latent_geometry(plan.block_sizes[0], *x, plan.dtypes[0], 1)
            why = "; ".join(caps.unsupported(g, env.latent_heads[0]))
            skipped.append(f"latent layout {_layouts((x,))}: excluded by the backend ({why})")
    return kept


def _layouts(layouts: Iterable[tuple[int, int]]) -> str:
    return ", ".join(f"{a}+{b}" for a, b in layouts)


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
    envelope_values: tuple[int, ...],
    declared: AbstractSet[int] | None,
    skipped: list[str],
    notes: list[str],
) -> tuple[int, ...]:
    """One dimension's values to draw: the envelope's, a declared set, or their intersection."""
    if declared is None:
        return envelope_values
    if not declared:
        raise SetupError(
            f"capabilities: the declared {label}s are an empty set, so there is nothing to draw: "
            "declare at least one, or None for any"
        )
    if len(declared) <= EXACT_SET_MAX:
        chosen = tuple(sorted(declared))
        notes.append(f"{label}s: drawn exactly as declared: {', '.join(map(str, chosen))}")
    else:
        chosen = tuple(x for x in envelope_values if x in declared)
        if not chosen:
            chosen = tuple(sorted(declared)[:4])
            notes.append(
                f"{label}s: none of the envelope's {list(envelope_values)} is declared; "
                f"drawing the backend's smallest {list(chosen)}"
            )
    missing = [x for x in envelope_values if x not in chosen]
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


def _excluded_pairings(plan: Plan) -> list[str]:
    """The feature passes' pairings (ALiBi with sinks, ...) the backend's ``excludes`` vetoes
    on every shape: those passes draw their feature without them."""
    caps = plan.caps
    if caps.excludes is None:
        return []
    out = []
    for feature in sorted(caps.variants):
        split = split_keys(caps, plan.envelope.device)
        paired, *fewer = feature_variants(caps, feature, 4, 1.0, split)
        if not fewer:
            continue
        shapes = [
            (KVGeometry(1, 4, b, kv, d, dtype), kv * r)
            for dtype, d, b, kv, r in itertools.product(
                plan.dtypes, plan.head_dims, plan.block_sizes, plan.kv_heads, plan.gqa_ratios
            )
        ]
        # The reason quoted is the pairing's own: on a shape that runs the feature alone (a
        # shape vetoed for another reason, a block size say, would quote that one instead).
        alone = fewer[-1]
        runs = [(g, h) for g, h in shapes if not caps.unsupported(g, h, _heads(alone, h))]
        vetoes = [caps.unsupported(g, h, _heads(paired, h)) for g, h in runs]
        if vetoes and all(vetoes):
            pairing = "+".join(sorted(paired.features))
            out.append(
                f"attention variant {pairing}: excluded by the backend ({vetoes[0][0]}); the "
                f"{feature} feature pass draws {feature} without it"
            )
    return out


def _heads(v: AttentionVariant, num_heads: int) -> AttentionVariant:
    """``v`` with its per-head values (sinks, slopes) for ``num_heads`` heads."""
    sinks = None if v.sinks is None else v.sinks[:1] * num_heads
    slopes = None if v.alibi_slopes is None else v.alibi_slopes[:1] * num_heads
    return replace(v, sinks=sinks, alibi_slopes=slopes)


def _excluded(plan: Plan) -> tuple[list[str], bool]:
    """The shapes ``capabilities.excludes`` vetoes, by reason, and whether it vetoes them all:
    an error, unless the plan draws latent layouts (then they are all it draws)."""
    caps = plan.caps
    if caps.excludes is None:
        return [], False
    reasons: Counter[str] = Counter()
    total = 0
    for dtype, d, b, kv, r in itertools.product(
        plan.dtypes, plan.head_dims, plan.block_sizes, plan.kv_heads, plan.gqa_ratios
    ):
        total += 1
        why = caps.unsupported(KVGeometry(1, 4, b, kv, d, dtype), kv * r)
        if why:
            reasons["; ".join(why)] += 1
    if sum(reasons.values()) == total and plan.latent:
        first = next(iter(reasons))
        layouts = _layouts(plan.latent)
        return [
            f"per-head K and V: excluded by the backend on every shape ({first}); every "
            f"example draws a latent layout ({layouts})"
        ], True
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
    ], False
