"""What the suite will draw for one backend: its shapes and dtypes, and what it must skip.

Shapes come from small fixed sets (every new shape can cost a GPU backend a
recompile). Values a backend does not declare in its
:class:`~spec.backend.Capabilities` are left out and named in the report;
when it declares none of the suite's usual block sizes or head dims, its own
smallest ones are used instead, so every backend is tested on something.

>>> from spec.backend import Capabilities
>>> plan = plan_for(Capabilities("x", dtypes=frozenset({"float16"}), copy_on_write=False))
>>> plan.dtypes
('float16',)
>>> for why in plan.skipped:
...     print(why)
dtype float32: not in the backend capabilities
dtype bfloat16: not in the backend capabilities
fork and copy-on-write rules: capabilities.copy_on_write is False
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from hypothesis import strategies as st

from conformance.variants import kv_quantization, layer_variants
from conformance.workload import (
    BLOCK_SIZES,
    GQA_GROUPS,
    HEAD_DIMS,
    KV_HEADS,
    LARGE_LOGIT_GAIN,
    LAYERS,
    WorkloadConfig,
    geometry_for,
    scale_for,
)
from spec.backend import DTYPES, Capabilities

_DTYPE_ORDER = ("float16", "float32", "bfloat16")
"""fp16 first: Hypothesis draws the first value most, and fp16 overflows where others do not."""


class SetupError(Exception):
    """The suite cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class Plan:
    """The values the suite draws from, after the backend's capabilities."""

    capabilities: Capabilities
    block_sizes: tuple[int, ...]
    head_dims: tuple[int, ...]
    groups: tuple[int, ...]
    dtypes: tuple[str, ...]
    copy_on_write: bool
    prefix_caching: bool
    skipped: tuple[str, ...]
    long_context: bool = False  # draw long-context workloads only (the suite's second pass)

    def configs(self) -> st.SearchStrategy[WorkloadConfig]:
        """Workload configurations; they shrink towards the first value of each set."""
        return _configs(self).filter(self._supported)

    def _supported(self, config: WorkloadConfig) -> bool:
        caps, g = self.capabilities, config.geometry
        layers = range(g.num_layers)
        return not any(caps.unsupported(g, config.num_heads, config.variant(i)) for i in layers)


@st.composite
def _configs(draw: st.DrawFn, plan: Plan) -> WorkloadConfig:
    """One workload's shape, dtype, options, and each layer's attention variant."""
    long_context = plan.long_context
    layers = 1 if long_context else draw(st.sampled_from(LAYERS))  # long prompts cost per layer
    geometry, num_heads = geometry_for(
        draw(st.sampled_from(plan.block_sizes)),
        draw(st.sampled_from(KV_HEADS)),
        draw(st.sampled_from(plan.groups)),
        draw(st.sampled_from(plan.head_dims)),
        draw(st.sampled_from(plan.dtypes)),
        layers,
        long_context,
    )
    large_logits = draw(st.sampled_from((True, False)))  # large logits first: drawn more often
    prefix_caching = draw(st.booleans()) if plan.prefix_caching else False
    kv_dtype, kv_scales = draw(kv_quantization(plan.capabilities, layers))
    geometry = replace(geometry, kv_dtype=kv_dtype, kv_scales=kv_scales)
    spread = LARGE_LOGIT_GAIN if large_logits else 1.0  # the scores' spread, see scale_for
    variants = draw(layer_variants(plan.capabilities, layers, num_heads, long_context, spread))
    return WorkloadConfig(
        geometry,
        num_heads,
        scale_for(geometry.head_dim, large_logits),
        draw(st.integers(0, 2**32 - 1)),
        prefix_caching,
        long_context,
        variants=() if all(v.is_plain for v in variants) else variants,
    )


def plan_for(capabilities: Capabilities, dtypes: Iterable[str] | None = None) -> Plan:
    """The plan for a backend with these capabilities, optionally limited to ``dtypes``."""
    caps = capabilities
    skipped: list[str] = []
    wanted = tuple(DTYPES) if dtypes is None else tuple(dtypes)
    unknown = [d for d in wanted if d not in DTYPES]
    if unknown:
        raise SetupError(f"unknown dtype {unknown[0]!r}: choose from {', '.join(DTYPES)}")
    chosen_dtypes = tuple(d for d in _DTYPE_ORDER if d in wanted and d in caps.dtypes)
    skipped += [
        f"dtype {d}: not in the backend capabilities"
        for d in DTYPES
        if d in wanted and d not in caps.dtypes
    ]
    if not chosen_dtypes:
        raise SetupError(
            f"the backend declares dtypes {sorted(caps.dtypes)}, none of the requested "
            f"{list(wanted)}: pass --dtype with one it supports"
        )
    if caps.max_gqa_ratio is not None and caps.max_gqa_ratio < 1:
        raise SetupError(f"capabilities.max_gqa_ratio is {caps.max_gqa_ratio}; it must be >= 1")
    groups = tuple(g for g in GQA_GROUPS if caps.max_gqa_ratio is None or g <= caps.max_gqa_ratio)
    skipped += [
        f"GQA ratio {g}: above capabilities.max_gqa_ratio" for g in GQA_GROUPS if g not in groups
    ]
    if not caps.copy_on_write:
        skipped.append("fork and copy-on-write rules: capabilities.copy_on_write is False")
    if not caps.prefix_caching:
        skipped.append("prefix-cache hits: capabilities.prefix_caching is False")
    return Plan(
        capabilities=caps,
        block_sizes=_choose("block size", BLOCK_SIZES, caps.block_sizes, skipped),
        head_dims=_choose("head dim", HEAD_DIMS, caps.head_dims, skipped),
        groups=groups,
        dtypes=chosen_dtypes,
        copy_on_write=caps.copy_on_write,
        prefix_caching=caps.prefix_caching,
        skipped=tuple(skipped),
    )


def _choose(
    label: str, ours: tuple[int, ...], declared: AbstractSet[int] | None, skipped: list[str]
) -> tuple[int, ...]:
    """Our values the backend supports; its two smallest if it supports none of ours."""
    if declared is None:
        return ours
    if not declared:
        raise SetupError(f"the backend declares no supported {label}: declare at least one")
    chosen = tuple(x for x in ours if x in declared)
    skipped += [f"{label} {x}: not in the backend capabilities" for x in ours if x not in chosen]
    if not chosen:
        chosen = tuple(sorted(declared)[:2])
        skipped.append(f"{label}: used the backend's own {list(chosen)} instead")
    return chosen
