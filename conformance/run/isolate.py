"""Finding a failure's cause: a named mistake that reproduces it, else replays without a feature.

:func:`find_cause` reads the failure's diagnosis first (a named mistake that
reproduces the backend's output: :mod:`conformance.judges.hypotheses`); when
there is none, it replays the failing workload, through a fresh
:class:`~conformance.lockstep.driver.Lockstep`, once without each feature the
failing example holds (:func:`candidates`): the poison in the slots no token
owns, the large pool (its blocks past 2^31 elements), the fp8 KV dtype, the
latent layout (the same rows as per-head K and V of one KV head), each
attention variant of the failing layer. The features
whose removal makes the workload pass are the cause (:mod:`conformance.run.causes`);
when none does, the cause is not isolated. A candidate the backend's
capabilities refuse is not tried.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from conformance.bounds.checker import BoundsChecker
from conformance.errors import SuiteStopped
from conformance.judges.compare import Difference
from conformance.judges.hypotheses import named_with_name
from conformance.judges.oracle import OracleChoice
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.workload import WorkloadConfig
from conformance.run.causes import UNISOLATED, Cause, Condition, for_mistake, from_replays
from spec.attention import AttentionVariant
from spec.backend import Backend
from spec.capabilities import Capabilities


def find_cause(
    backend: Backend,
    log: Sequence[str],
    config: WorkloadConfig,
    difference: Difference,
    bounds_mode: str | None = None,
    oracle: OracleChoice | None = None,
) -> Cause:
    """The cause of ``difference``, found in the failing workload ``log`` of ``config``."""
    found = named_with_name(difference.diagnosis)
    if found is not None:
        name, mistake = found
        return for_mistake(name, mistake.products, config.geometry, mistake)
    if difference.what == "bounds":
        return out_of_bounds(difference.detail)
    caps = backend.capabilities
    passing = [
        condition
        for condition, changed in candidates(config, difference.layer, caps)
        if passes(backend, log, changed, bounds_mode, oracle)
    ]
    return from_replays(passing) if passing else UNISOLATED


_BOUNDS = re.compile(
    r"kernel (?P<kernel>\S+), launch \d+: \d+ (?P<access>\w+?)s? "
    r"(?:outside every tensor of the launch, nearest|of block-table padding in) (?P<arg>\w+)"
)


def out_of_bounds(detail: str) -> Cause:
    """A bounds failure's cause, as the checker saw it: which kernel reached which tensor's
    edge (the same access in several passes is one cause); nothing to draw without it.

    >>> out_of_bounds("attention (layer 0), kernel k, launch 1: 2 loads outside every tensor "
    ...               "of the launch, nearest table_ptr (int32 [1, 3]); first ...").describe()
    'kernel k: a load outside its tensors, nearest table_ptr (the bounds check saw it)'
    """
    m = _BOUNDS.search(detail)
    if m is None:
        return UNISOLATED
    where = "outside its tensors, nearest" if "outside every" in m.group(0) else "of padding in"
    return Cause(
        f"kernel {m['kernel']}: a {m['access']} {where} {m['arg']} (the bounds check saw it)",
        "observed",
    )


def candidates(
    config: WorkloadConfig, layer: int | None, caps: Capabilities
) -> list[tuple[Condition, WorkloadConfig]]:
    """The failing example's features, each with the configuration that lacks it, and only
    those the backend can run without it.

    >>> from spec.kv_geometry import KVGeometry
    >>> v = AttentionVariant(sinks=(1.0, 2.0), alibi_slopes=(0.5, 0.25))
    >>> c = WorkloadConfig(KVGeometry(1, 4, 4, 1, 8), 2, 0.3, 0, variants=(v,), poison="NaN")
    >>> caps = Capabilities("x", variants={"sinks", "alibi"})
    >>> [cond for cond, _ in candidates(c, 0, caps)]
    [('poison', 'NaN'), ('variant', 'alibi'), ('variant', 'sinks')]
    """
    g = config.geometry
    changes: list[tuple[Condition, dict[str, Any]]] = []
    if config.block_base:
        changes.append((("pool", "large"), {"block_base": 0}))
    if config.poison is not None:
        changes.append((("poison", config.poison), {"poison": None}))
    if g.kv_dtype is not None:
        plain = replace(g, kv_dtype=None, kv_scales=())
        changes.append((("KV dtype", g.kv_dtype), {"geometry": plain}))
    if g.is_latent:
        changes.append((("layout", "latent"), {"geometry": replace(g, latent_dim=None)}))
    layers = range(g.num_layers) if layer is None else [layer]
    for feature in sorted({f for i in layers for f in config.variant(i).features}):
        without = tuple(_without(v, feature) for v in config.variants)
        changes.append((("variant", feature), {"variants": without}))
    out = []
    for condition, change in changes:
        try:  # a window a KV cache group needs, say, cannot go: that candidate is not tried
            changed = replace(config, **change)
        except ValueError:
            continue
        if _runs(caps, changed):
            out.append((condition, changed))
    return out


def passes(
    backend: Backend,
    log: Sequence[str],
    config: WorkloadConfig,
    bounds_mode: str | None = None,
    oracle: OracleChoice | None = None,
) -> bool:
    """Whether the workload ``log`` (a failure's, its first line the lockstep's creation)
    passes on ``backend`` with ``config`` instead: every operation, then no difference."""
    bounds = None if bounds_mode is None else BoundsChecker.for_mode(bounds_mode)
    try:
        ls = Lockstep(backend, config, bounds=bounds, oracle=oracle)
        for line in log[1:]:
            exec(compile(line, "<replay>", "exec"), {"ls": ls})  # the failure's own log
    except (ConformanceFailure, SuiteStopped, ValueError, AssertionError):
        return False  # it still fails (or cannot be replayed so): not the cause
    return True


def _runs(caps: Capabilities, config: WorkloadConfig) -> bool:
    g = config.geometry
    return not any(
        caps.unsupported(g, config.num_heads, config.variant(i)) for i in range(g.num_layers)
    )


def _without(v: AttentionVariant, feature: str) -> AttentionVariant:
    """``v`` without one of its variants."""
    return replace(v, **{_FIELDS[feature]: None}) if feature in v.features else v


_FIELDS = {"window": "window", "softcap": "softcap", "sinks": "sinks", "alibi": "alibi_slopes"}
