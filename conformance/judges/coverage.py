"""What a run reached: the shapes, batch widths and memory offsets its steps actually exercised.

A profile says what the suite *may* draw; the coverage says what it did, so a
report can show that head dim 128, a block size that is not a power of two, a
GQA ratio of 3 or more, a step of 16 sequences and KV offsets past 2^31
elements were all run, not merely possible.

>>> cov = Coverage()
>>> cov.note_shape(head_dim=128, block_size=48, num_kv_heads=2, gqa_ratio=3, dtype="float16")
>>> cov.note_shape(head_dim=48, block_size=16, num_kv_heads=1, gqa_ratio=4, dtype="float16",
...                latent=(32, 16))
>>> cov.note_step(num_seqs=18, decodes=15, max_offset=2**31 + 5)
>>> print("\\n".join(cov.describe()))
head dims: 128 (non-power-of-two: none)
block sizes: 16, 48 (non-power-of-two: 48)
GQA ratios: 3; KV heads: 2; dtypes: float16
KV layouts: per-head K and V; latent (c_kv + k_rope) 32+16, with 4 query heads
widest step: 18 sequences (15 decodes, 3 prefill chunks)
widest mixed step: 15 decodes with 3 prefill chunks
largest KV element offset: 2147483653 (past 2^31: yes)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conformance.judges.paths import PathCoverage

INT32_LIMIT = 2**31


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _list(values: set[int]) -> str:
    return ", ".join(str(v) for v in sorted(values)) or "none"


@dataclass
class Coverage:
    """Shapes, widths and offsets reached by the steps of a run."""

    head_dims: set[int] = field(default_factory=set)
    block_sizes: set[int] = field(default_factory=set)
    gqa_ratios: set[int] = field(default_factory=set)
    kv_heads: set[int] = field(default_factory=set)
    dtypes: set[str] = field(default_factory=set)
    latent_layouts: set[tuple[int, int]] = field(default_factory=set)  # (latent_dim, rope_dim)
    latent_heads: set[int] = field(default_factory=set)  # query heads of latent examples
    ordinary: bool = False  # some example had per-head K and V
    widest_step: int = 0
    widest_decodes: int = 0
    widest_mixed: tuple[int, int] = (0, 0)  # decodes and prefill chunks of the widest mixed call
    max_offset: int = 0
    group_examples: int = 0  # examples whose layers form several KV cache groups
    group_layouts: set[str] = field(default_factory=set)  # their groups, as reports name them
    released_entries: int = 0  # block-table entries that sliding windows released
    released_rows: int = 0  # batch table rows handed over with released entries
    paths: PathCoverage = field(default_factory=PathCoverage)  # kernel paths met, observed

    def note_shape(
        self,
        *,
        head_dim: int,
        block_size: int,
        num_kv_heads: int,
        gqa_ratio: int,
        dtype: str,
        latent: tuple[int, int] | None = None,
    ) -> None:
        """One example's shape; ``latent``: its ``(latent_dim, rope_dim)``, when it has the
        latent layout (its row width is then no head dim, and its query heads no GQA ratio)."""
        self.block_sizes.add(block_size)
        self.dtypes.add(dtype)
        if latent is not None:
            self.latent_layouts.add(latent)
            self.latent_heads.add(gqa_ratio * num_kv_heads)
            return
        self.ordinary = True
        self.head_dims.add(head_dim)
        self.kv_heads.add(num_kv_heads)
        self.gqa_ratios.add(gqa_ratio)

    def note_step(self, *, num_seqs: int, decodes: int, max_offset: int) -> None:
        """One backend attention call of ``num_seqs`` sequences; its largest KV element offset."""
        if num_seqs > self.widest_step:
            self.widest_step, self.widest_decodes = num_seqs, decodes
        if 0 < decodes < num_seqs and num_seqs > sum(self.widest_mixed):
            self.widest_mixed = (decodes, num_seqs - decodes)
        self.max_offset = max(self.max_offset, max_offset)

    def note_group_example(self, layout: str) -> None:
        """An example whose layers form KV cache groups (``layout`` names them)."""
        self.group_examples += 1
        self.group_layouts.add(layout)

    def note_released(self, entries: int, rows: int) -> None:
        """A step of such an example: ``entries`` newly released, ``rows`` rows that show some."""
        self.released_entries += entries
        self.released_rows += rows

    def add(self, other: Coverage) -> None:
        """What ``other`` reached too (a shard of the same run: the same planned pairs).

        >>> a, b = Coverage(), Coverage()
        >>> a.note_step(num_seqs=3, decodes=2, max_offset=10)
        >>> b.note_step(num_seqs=5, decodes=5, max_offset=7)
        >>> a.add(b)
        >>> a.widest_step, a.widest_decodes, a.widest_mixed, a.max_offset
        (5, 5, (2, 1), 10)
        """
        mine, theirs = self.paths.planned, other.paths.planned
        assert not mine or not theirs or mine == theirs, "parts of different runs"
        self.head_dims |= other.head_dims
        self.block_sizes |= other.block_sizes
        self.gqa_ratios |= other.gqa_ratios
        self.kv_heads |= other.kv_heads
        self.dtypes |= other.dtypes
        self.latent_layouts |= other.latent_layouts
        self.latent_heads |= other.latent_heads
        self.ordinary |= other.ordinary
        self.group_layouts |= other.group_layouts
        if other.widest_step > self.widest_step:
            self.widest_step, self.widest_decodes = other.widest_step, other.widest_decodes
        self.widest_mixed = max(self.widest_mixed, other.widest_mixed, key=sum)
        self.max_offset = max(self.max_offset, other.max_offset)
        self.group_examples += other.group_examples
        self.released_entries += other.released_entries
        self.released_rows += other.released_rows
        self.paths.add(other.paths)

    def describe(self) -> list[str]:
        odd_d = {d for d in self.head_dims if not _pow2(d)}
        odd_b = {b for b in self.block_sizes if not _pow2(b)}
        past = "yes" if self.max_offset >= INT32_LIMIT else "no"
        chunks = self.widest_step - self.widest_decodes
        return [
            f"head dims: {_list(self.head_dims)} (non-power-of-two: {_list(odd_d)})",
            f"block sizes: {_list(self.block_sizes)} (non-power-of-two: {_list(odd_b)})",
            f"GQA ratios: {_list(self.gqa_ratios)}; KV heads: {_list(self.kv_heads)}; "
            f"dtypes: {', '.join(sorted(self.dtypes)) or 'none'}",
            self._describe_layouts(),
            f"widest step: {self.widest_step} sequences "
            f"({self.widest_decodes} decodes, {chunks} prefill chunks)",
            "widest mixed step: none"
            if not any(self.widest_mixed)
            else f"widest mixed step: {self.widest_mixed[0]} decodes with "
            f"{self.widest_mixed[1]} prefill chunks",
            f"largest KV element offset: {self.max_offset} (past 2^31: {past})",
            *self._describe_groups(),
            *self.paths.describe(),
        ]

    def _describe_layouts(self) -> str:
        """The KV layouts drawn: per-head K and V, and each latent ``latent+rope`` layout.

        >>> Coverage()._describe_layouts()
        'KV layouts: none (latent: none)'
        """
        kinds = ["per-head K and V"] if self.ordinary else []
        if self.latent_layouts:
            pairs = ", ".join(f"{a}+{b}" for a, b in sorted(self.latent_layouts))
            heads = _list(self.latent_heads)
            kinds.append(f"latent (c_kv + k_rope) {pairs}, with {heads} query heads")
        none = "" if self.latent_layouts else " (latent: none)"
        return f"KV layouts: {'; '.join(kinds) or 'none'}{none}"

    def _describe_groups(self) -> list[str]:
        """A line on the KV cache group examples, when any ran.

        >>> cov = Coverage()
        >>> cov.note_group_example("full attention (layer 0) + sliding window 4 (layer 1)")
        >>> cov.note_released(entries=3, rows=5)
        >>> print("\\n".join(cov._describe_groups()))
        KV cache groups: 1 example (1 layout), 3 table entries released, 5 rows attended past them
        """
        if not self.group_examples:
            return []
        n, k = self.group_examples, len(self.group_layouts)
        return [
            f"KV cache groups: {n} example{'s' * (n != 1)} ({k} layout{'s' * (k != 1)}), "
            f"{self.released_entries} table entries released, "
            f"{self.released_rows} rows attended past them"
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "head_dims": sorted(self.head_dims),
            "block_sizes": sorted(self.block_sizes),
            "gqa_ratios": sorted(self.gqa_ratios),
            "kv_heads": sorted(self.kv_heads),
            "dtypes": sorted(self.dtypes),
            "latent_layouts": [list(p) for p in sorted(self.latent_layouts)],
            "latent_query_heads": sorted(self.latent_heads),
            "widest_step": self.widest_step,
            "widest_step_decodes": self.widest_decodes,
            "widest_mixed_step": {
                "decodes": self.widest_mixed[0],
                "prefill_chunks": self.widest_mixed[1],
            },
            "max_kv_element_offset": self.max_offset,
            "past_int32": self.max_offset >= INT32_LIMIT,
            "pairs": self.paths.to_json(),
            "kv_groups": {
                "examples": self.group_examples,
                "layouts": sorted(self.group_layouts),
                "released_entries": self.released_entries,
                "released_rows": self.released_rows,
            },
        }
