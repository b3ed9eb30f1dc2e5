"""A failure's cause: what explains it, found by observation, and what its pass then runs without.

One failure per pass would hide an independent difference behind it, so after
a failure the pass is drawn again without the failure's cause. The cause is
what the backend was *seen* to do, never what the example happened to hold:

* a named mistake that reproduces the backend's output
  (:mod:`conformance.judges.hypotheses`): products rounded to TF32, to the
  activation dtype or cast to fp8, probabilities rounded after normalising, an
  ALiBi origin, a sink counted twice, ... The exclusion follows from it: TF32
  excludes float32 examples only, activation rounding its dtype, an fp8 cast
  its KV dtype, a variant's mistake that variant; a mistake that is about no
  feature (a causal mask off by one) leaves nothing to draw without it;
* a kernel's access out of bounds that the bounds check saw: the kernel and
  the tensor whose edge it crossed (nothing is drawn without it);
* else a replay of the failing workload without one feature at a time (the
  poison in slots no token owns, the fp8 KV dtype, the latent layout, each
  attention variant of the failing layer: :mod:`conformance.run.isolate`):
  the features whose removal makes it pass are the cause, together. Poison
  is not excluded but made finite: the rest of the pass still reads what a
  kernel should not, and reports says so;
* else the cause is not isolated, and the pass ends there.

Failures are grouped by cause in the report (a kernel that rounds its float32
products to TF32 is one cause, however many passes show it).

>>> from spec.attention import AttentionVariant
>>> from spec.kv_geometry import KVGeometry
>>> tf32 = for_mistake("float32 products rounded to TF32", "tf32", KVGeometry(1, 4, 4, 1, 8))
>>> tf32.describe(), tf32.excluded()
('float32 products rounded to TF32', 'float32')
>>> tf32.vetoes(KVGeometry(1, 4, 4, 1, 8, "float32"), None)
True
>>> tf32.vetoes(KVGeometry(1, 4, 4, 1, 8, "float16"), AttentionVariant(sinks=(1.0,)))
False
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from conformance.judges.hypotheses import Mistake, needs
from spec.attention import AttentionVariant
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry

MAX_CAUSES = 4
"""Causes a pass excludes at most, one after each failure: then the pass ends."""

Condition = tuple[str, str]
"""What an excluded example has: ``("dtype", "float32")``, ``("KV dtype", "fp8_e5m2")``,
``("layout", "latent")`` or ``("variant", "alibi")`` (a feature of its layer's variant)."""
_WORDS = {"dtype": "{}", "KV dtype": "KV dtype {}", "layout": "the {} layout", "variant": "{}"}


@dataclass(frozen=True)
class Cause:
    """What explains a failure (``name``, how the report groups it), how it was found
    (``found``: ``"mistake"``, ``"replay"`` or ``"unisolated"``), the conditions an example
    must all meet to be excluded after it, and whether poison is made finite instead."""

    name: str
    found: str
    conditions: tuple[Condition, ...] = ()
    finite_poison: bool = False

    def describe(self) -> str:
        return self.name

    @property
    def final(self) -> bool:
        """Nothing can be drawn without it: the pass ends after this failure."""
        return not self.conditions and not self.finite_poison

    def excluded(self) -> str:
        """What the rest of the pass runs without, in words (``float32``, ``sinks in the latent
        layout``, ``non-finite poison``)."""
        if self.finite_poison:
            return "non-finite poison"
        return " with ".join(_WORDS[axis].format(value) for axis, value in self.conditions)

    def vetoes(self, geometry: KVGeometry, variant: AttentionVariant | None) -> bool:
        """Whether an example of ``geometry`` (a layer of ``variant``) meets every condition."""
        return bool(self.conditions) and all(
            _meets(geometry, variant, axis, value) for axis, value in self.conditions
        )


def _meets(geometry: KVGeometry, variant: AttentionVariant | None, axis: str, value: str) -> bool:
    if axis == "dtype":
        return geometry.dtype == value
    if axis == "KV dtype":
        return geometry.kv_dtype == value
    if axis == "layout":
        return geometry.is_latent
    return variant is not None and frozenset(value.split("+")) <= variant.features


PRODUCT_CAUSES = {
    "tf32": "float32 products rounded to TF32",
    "activation": "q.k products rounded to the activation dtype",
    "fp8": "Q and P cast to the fp8 cache dtype",
    "normalised": "probabilities normalised, then rounded to the activation dtype before P @ V",
}
"""The cause each product rounding names (:data:`spec.capabilities.PRODUCTS`), dtype apart: one
kernel that rounds to float16 and to bfloat16 is one cause."""


def for_mistake(name: str, products: str, geometry: KVGeometry, m: Mistake | None = None) -> Cause:
    """The cause a named mistake stands for, in an example of ``geometry``: its name, and the
    examples it changes (a product rounding: the dtypes it touches; a variant's mistake: that
    variant; a latent one: the layout; the rest: none, so nothing can be drawn without it)."""
    g = geometry
    if products != "exact":
        if products == "tf32":
            conditions: tuple[Condition, ...] = (("dtype", "float32"),)
        elif products == "fp8":
            conditions = (("KV dtype", str(g.kv_dtype)),)
        else:
            conditions = (("dtype", g.dtype),)
        return Cause(PRODUCT_CAUSES[products], "mistake", conditions)
    m = m or Mistake()
    about = needs(m)
    if about:
        return Cause(name, "mistake", (("variant", "+".join(sorted(about))),))
    if m.latent_no_rope or m.latent_value_late:
        return Cause(name, "mistake", (("layout", "latent"),))
    if m.kv_scales_swapped and g.kv_dtype is not None:
        return Cause(name, "mistake", (("KV dtype", g.kv_dtype),))
    return Cause(name, "mistake")


def from_replays(passing: Sequence[Condition]) -> Cause:
    """The cause that replays isolated: the workload passed without each of ``passing``
    (``("poison", ...)`` among them: it passed with finite values in the slots no token owns;
    ``("pool", "large")``: it passed in a small pool).

    The name says only what the replays saw, never the example's draw (which poison it
    held), so one kernel's reads of such slots are one cause however they show:

    >>> cause = from_replays([("poison", "finite")])
    >>> cause.name.split(" (")[0], cause.finite_poison
    ('reads slots no token owns', True)
    """
    if any(axis == "pool" for axis, _ in passing):
        return LARGE_POOL
    if any(axis == "poison" for axis, _ in passing):
        return READS_UNOWNED
    named = " with ".join(_WORDS[axis].format(value) for axis, value in passing)
    return Cause(f"{named} (the workload passes without it)", "replay", tuple(passing))


READS_UNOWNED = Cause(
    "reads slots no token owns (the workload fails while they hold NaN or infinities, and "
    "passes when they hold finite values)",
    "replay",
    finite_poison=True,
)
UNISOLATED = Cause(
    "not isolated (no named mistake reproduces it, and the workload still fails without each "
    "one of its features)",
    "unisolated",
)
LARGE_POOL = Cause(
    "the large pool: KV offsets past 2^31 elements (the workload passes in a small pool)",
    "replay",
)
"""A failure only a large pool shows: its pass draws nothing but large pools, so it ends."""


def excluding(caps: Capabilities, causes: Sequence[Cause]) -> Capabilities:
    """``caps`` with each of ``causes`` vetoed too (its reason names it)."""
    vetoing = [c for c in causes if c.conditions]
    if not vetoing:
        return caps
    own = caps.excludes

    def veto(geometry: KVGeometry, num_heads: int, variant: AttentionVariant | None) -> str | None:
        for cause in vetoing:
            if cause.vetoes(geometry, variant):
                return f"{cause.excluded()}: excluded after a failure ({cause.name})"
        return None if own is None else own(geometry, num_heads, variant)

    return replace(caps, excludes=veto)
