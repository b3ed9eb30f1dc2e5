"""How hard a run looks: the profiles (``quick``, ``standard``, ``thorough``) and what each asks of
each pass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """How hard to look: examples (random workloads), steps (rules) per example, and passes.

    After the short examples, each further pass (:data:`conformance.lockstep.plan.PASSES`)
    runs a fixed number of examples, because each costs seconds on an
    interpreted kernel and a chance draw would either miss or repeat them:
    long contexts, wide batches, a large pool, each production shape, each
    declared attention variant and fp8 KV dtype, and KV cache groups.
    """

    name: str
    max_examples: int
    steps: int
    long_examples: int
    description: str
    wide_examples: int = 2
    large_pool_examples: int = 1
    production_examples: int = 1  # per production shape
    feature_examples: int = 1  # per declared attention variant and fp8 KV dtype
    groups_examples: int = 3  # layers in KV cache groups, when declared
    split_examples: int = 1  # a decode split into more than 8 parts, when the plan has one

    def examples(self, override: int | None) -> tuple[int, int]:
        """Short and long examples; an override scales the long ones (at least one).

        >>> PROFILES["quick"].examples(None), PROFILES["quick"].examples(12)
        ((60, 5), (12, 1))
        """
        return self.pass_examples("short", override), self.pass_examples("long", override)

    def pass_examples(self, kind: str, override: int | None = None) -> int:
        """Examples of one pass; an override scales the fixed passes (at least one each).

        >>> from conformance.lockstep.plan import PASSES
        >>> [PROFILES["quick"].pass_examples(k) for k in PASSES]
        [60, 2, 5, 1, 1, 1, 1, 3]
        """
        fixed = {
            "wide": self.wide_examples,
            "long": self.long_examples,
            "split": self.split_examples,
            "large pool": self.large_pool_examples,
            "production": self.production_examples,
            "feature": self.feature_examples,
            "groups": self.groups_examples,
        }
        if kind == "short":
            return self.max_examples if override is None else override
        if override is None:
            return fixed[kind]
        return max(1, override * fixed[kind] // self.max_examples)

    def pass_steps(self, kind: str) -> int:
        """Rules per example of a pass: fewer where each step runs many sequences or blocks, or
        decodes a context long enough to split (the passes whose opening is the point).

        >>> [PROFILES["quick"].pass_steps(k) for k in ("short", "feature", "split", "wide")]
        [20, 10, 5, 5]
        """
        if kind in ("wide", "production", "split"):
            return max(3, self.steps // 4)
        return max(3, self.steps // 2) if kind == "feature" else self.steps


PROFILES = {
    p.name: p
    for p in (
        Profile(
            "quick", 60, 20, 5, "the default: 1.5 minutes on 2 CPUs (--jobs 2), Triton interpreted"
        ),
        Profile(
            "standard",
            300,
            40,
            25,
            "before a release or after a kernel change",
            8,
            4,
            3,
            3,
            12,
            split_examples=2,
        ),
        Profile(
            "thorough",
            2000,
            60,
            150,
            "nightly, or when hunting a rare bug",
            40,
            15,
            10,
            10,
            60,
            split_examples=5,
        ),
    )
}
