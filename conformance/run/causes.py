"""A failure's cause, so that a pass can go on drawing without it and show the next failure.

One failure per pass would hide an independent difference behind it: a
kernel whose fp8 write is wrong would never have its ALiBi judged. So after a
failure the pass is drawn again with the failure's :class:`Cause` excluded,
as if the backend had vetoed it (:func:`excluding`): the latent layout of
the example, else its fp8 KV dtype, else the attention variant of the
failing layer (every variant that has its features), else the activation
dtype. The report lists each failure under its cause (:func:`cause_of` says
which).

>>> from spec.attention import AttentionVariant
>>> from spec.kv_geometry import KVGeometry
>>> from conformance.lockstep.workload import WorkloadConfig
>>> v = AttentionVariant(sinks=(1.0, 2.0), alibi_slopes=(0.5, 0.25))
>>> config = WorkloadConfig(KVGeometry(1, 4, 4, 1, 8, "float16"), 2, 0.3, 0, variants=(v,))
>>> cause = cause_of(config, layer=0)
>>> cause.describe()
'attention variant alibi+sinks'
>>> cause.vetoes(config.geometry, AttentionVariant(window=4, sinks=(1.0, 2.0),
...                                                  alibi_slopes=(0.5, 0.25)))
True
>>> cause.vetoes(config.geometry, AttentionVariant(sinks=(1.0, 2.0)))
False
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from conformance.judges.hypotheses import named, needs
from conformance.lockstep.workload import WorkloadConfig
from spec.attention import AttentionVariant
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry

MAX_CAUSES = 4
"""Causes a pass excludes at most, one after each failure: then the pass ends."""


@dataclass(frozen=True)
class Cause:
    """What a failure is excluded by: the ``"layout"`` ``"latent"``, an fp8 ``"KV dtype"``, an
    attention ``"variant"`` (its features joined by ``+``) or an activation ``"dtype"``."""

    axis: str
    value: str

    def describe(self) -> str:
        return f"{_AXIS_WORDS.get(self.axis, self.axis)} {self.value}"

    def vetoes(self, geometry: KVGeometry, variant: AttentionVariant | None) -> bool:
        """Whether an example of ``geometry`` (a layer of ``variant``) has this cause."""
        if self.axis == "layout":
            return geometry.is_latent
        if self.axis == "KV dtype":
            return geometry.kv_dtype == self.value
        if self.axis == "dtype":
            return geometry.dtype == self.value
        features = frozenset(self.value.split("+"))
        return variant is not None and features <= variant.features


_AXIS_WORDS = {"variant": "attention variant", "layout": "KV layout"}


def cause_of(
    config: WorkloadConfig, layer: int | None, diagnosis: str | None = None, what: str = "output"
) -> Cause:
    """The cause of a failure of kind ``what`` in an example of ``config`` (at ``layer``, if
    it names one): a latent layout (a backend wrong on latent rows is wrong on every one of
    them, whatever else the example holds); else an fp8 cache's KV dtype; else, for a KV
    difference or an example's mean error or lean, the activation dtype (no variant touches
    a write, and a lean is the arithmetic's); else the variants the diagnosed mistake is
    about (ALiBi for an ALiBi origin), when one is named, else every variant of the layer;
    else the dtype."""
    g = config.geometry
    if g.is_latent:
        return Cause("layout", "latent")
    if g.kv_dtype is not None:
        return Cause("KV dtype", g.kv_dtype)
    if what in ("K", "V", "outputs"):
        return Cause("dtype", g.dtype)
    layers = range(g.num_layers) if layer is None else [layer]
    mistake = named(diagnosis)
    about = frozenset() if mistake is None else needs(mistake)
    for i in layers:
        features = config.variant(i).features
        if features:
            chosen = about if about and about <= features else features
            return Cause("variant", "+".join(sorted(chosen)))
    return Cause("dtype", g.dtype)


def excluding(caps: Capabilities, causes: Sequence[Cause]) -> Capabilities:
    """``caps`` with each of ``causes`` vetoed too (its reason names it)."""
    if not causes:
        return caps
    own = caps.excludes

    def veto(geometry: KVGeometry, num_heads: int, variant: AttentionVariant | None) -> str | None:
        for cause in causes:
            if cause.vetoes(geometry, variant):
                return f"{cause.describe()}: excluded after a failure, to find the next"
        return None if own is None else own(geometry, num_heads, variant)

    return replace(caps, excludes=veto)
