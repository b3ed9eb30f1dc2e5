"""What a run exercised, counted: examples, steps, rules applied, checks made, coverage, time.

One :class:`RunStats` is the run's (each shard's or job's, merged at the end);
each example adds to it as it runs, and the report reads it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from conformance.judges.coverage import Coverage
from conformance.judges.numerics import Margins
from conformance.lockstep.groups import group_label
from conformance.lockstep.variants import label
from conformance.lockstep.workload import WorkloadConfig


@dataclass
class RunStats:
    """What a run exercised: examples, steps, rules applied, checks made, skips, coverage."""

    examples: int = 0
    steps: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    configs: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)  # attention the backend cannot run
    drawn: Counter[str] = field(default_factory=Counter)  # examples per variant, dtype, KV dtype
    coverage: Coverage = field(default_factory=Coverage)
    margins: Margins = field(default_factory=Margins)  # how close the outputs came to failing
    longest: int = 0  # the most tokens any sequence held when a step ran
    specialisations: set[str] = field(default_factory=set)  # compiled kernels' keys launched
    call_seconds: dict[str, float] = field(default_factory=dict)  # backend time, by call
    compiles: int = 0  # Triton kernels compiled during the run (compiled Triton only)
    compile_seconds: float = 0.0  # their compile (or disk-cache load) time, within call_seconds
    first_failure_example: int | None = None  # examples run when the first failure appeared

    def note_failure(self) -> None:
        if self.first_failure_example is None:
            self.first_failure_example = self.examples

    def add(self, other: RunStats) -> None:
        """Count ``other``'s examples in these stats too (the shards of one run, merged).

        The first failure's example is not added: it is the merged run's headline's to set.
        """
        self.examples += other.examples
        self.steps += other.steps
        for mine, theirs in (
            (self.rules, other.rules),
            (self.checks, other.checks),
            (self.configs, other.configs),
            (self.skips, other.skips),
            (self.drawn, other.drawn),
        ):
            mine.update(theirs)
        self.coverage.add(other.coverage)
        self.margins.add(other.margins)
        self.longest = max(self.longest, other.longest)
        self.specialisations |= other.specialisations
        for call, seconds in other.call_seconds.items():
            self.call_seconds[call] = self.call_seconds.get(call, 0.0) + seconds
        self.compiles += other.compiles
        self.compile_seconds += other.compile_seconds


def drawn_names(config: WorkloadConfig) -> set[str]:
    """What an example drew, as the report counts it: its dtype, KV dtype, latent layout and
    layers' variants (combined ones by their names joined in alphabetical order,
    "alibi+sinks" say, as :mod:`conformance.lockstep.pairs` names them)."""
    g = config.geometry
    names = {g.dtype, g.kv_dtype or f"KV {g.dtype}"}
    if g.is_latent:
        names.add(f"latent {g.latent_dim}+{g.rope_dim}")
    for layer in range(g.num_layers):
        features = sorted(config.variant(layer).features)
        names.update(features)
        if len(features) > 1:
            names.add("+".join(features))
    return names


def _shape(config: WorkloadConfig, kind: str) -> str:
    g = config.geometry
    extra = {"short": "", "long": " long-context", "groups": ""}.get(kind, f" {kind}")
    width = f"latent {g.latent_dim}+{g.rope_dim}" if g.is_latent else f"D={g.head_dim}"
    shape = f"{g.dtype} B={g.block_size} H={config.num_heads}/{g.num_kv_heads} {width}"
    return shape + label(config) + group_label(config) + extra  # fp8, variants, groups


def timed_progress(
    stats: RunStats, report: Callable[[str], None] | None, every_s: float = 5.0
) -> Callable[[], None]:
    """A callback for the end of each example that reports progress every ``every_s`` seconds."""
    start = last = time.monotonic()

    def tick() -> None:
        nonlocal last
        now = time.monotonic()
        if report is not None and now - last >= every_s:
            last = now
            phase = "" if stats.first_failure_example is None else "shrinking a failure: "
            report(f"{phase}{stats.examples} examples, {stats.steps} steps, {now - start:.0f} s")

    return tick
