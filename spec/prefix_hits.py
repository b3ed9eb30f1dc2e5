"""Prefix-cache hits: a new sequence shares the resident blocks of its prompt's prefix.

A block full of verified tokens is named by its chained hash (:mod:`spec.prefix_cache`);
a new prompt shares its leading blocks whose names are resident, but always leaves one
token to compute, since its output (the next token's logits) is needed.

>>> from spec.block_manager import BlockManager
>>> m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
>>> m.add_sequence(0, list(range(10))), len(m.append_slots(0, list(range(10))))
(0, 10)
>>> m.cached_prefix(list(range(9)) + [99])     # blocks 0, 1 are full and named: 8 tokens hit
8
>>> m.add_sequence(1, list(range(8)))          # one token is left to compute: 1 block hits
4
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from spec.block_pool import BlockHash
from spec.block_table import PAD_BLOCK, BlockTables, _Sequence
from spec.kv_budget import cdiv
from spec.prefix_cache import prompt_block_hashes
from spec.validate import check_int, check_keys, check_token_ids


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were found."""

    queried_tokens: int = 0  # prompt tokens looked up, cumulative
    hit_tokens: int = 0  # of those, found resident

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixHits(BlockTables):
    """The prompt's cached prefix (a pure query), and naming the blocks that fill.

    Several managers may share one pool (the KV cache groups of one model,
    :mod:`spec.cache_manager`): ``group_key`` keeps each group's names apart,
    since equal tokens give different KV in different layers.
    """

    enable_prefix_caching: bool  # name full blocks, and look prompts up
    prefix_stats: PrefixCacheStats  # what admissions looked up and found
    _group_keys: tuple[Hashable, ...]  # mixed into every hash: the KV cache group, if several

    def cached_prefix(
        self,
        prompt: Sequence[int],
        extra_keys: Sequence[Hashable] = (),
        *,
        limit: int | None = None,
    ) -> int:
        """How many prompt tokens :meth:`add_sequence` would take from the cache (a pure query).

        With ``limit``, the most it would take when told ``max_cached=limit``.
        """
        tokens = check_token_ids("prompt", prompt)
        hits = self._cache_hits(tokens, self._keys(extra_keys), self._limit(limit))
        return len(hits) * self.block_size

    def blocks_to_admit(
        self,
        prompt: Sequence[int],
        num_new: int,
        *,
        extra_keys: Sequence[Hashable] = (),
        max_cached: int | None = None,
    ) -> int:
        """Available blocks :meth:`add_sequence` then ``num_new`` appended tokens would consume.

        A prefix hit on a block nobody holds (cached, evictable) takes it out
        of the available count just like an allocation, so it counts.
        """
        tokens = check_token_ids("prompt", prompt)
        hits = self._cache_hits(tokens, self._keys(extra_keys), self._limit(max_cached))
        evictable = sum(b != PAD_BLOCK and self.pool.ref_count(b) == 0 for _, b in hits)
        cached = len(hits) * self.block_size
        n = check_int("num_new", num_new, low=0, high=len(tokens) - cached)
        return evictable + cdiv(cached + n, self.block_size) - len(hits)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (held blocks stay held, but are no longer findable)."""
        self.pool.reset_cache()

    def _keys(self, extra_keys: Sequence[Hashable]) -> tuple[Hashable, ...]:
        return self._group_keys + check_keys("extra_keys", extra_keys)

    def _limit(self, limit: int | None) -> int | None:
        return None if limit is None else check_int("max_cached", limit, low=0)

    def _cache_hits(
        self, tokens: tuple[int, ...], extra_keys: tuple[Hashable, ...], limit: int | None = None
    ) -> list[tuple[BlockHash, int]]:
        """The prompt's leading cached full blocks, as ``(hash, block)``.

        One rule for :meth:`cached_prefix`, :meth:`blocks_to_admit` and
        :meth:`add_sequence`: at least one token is left to compute, and at
        most ``limit`` tokens come from the cache. Without a window every
        block of the prefix must be resident, so the first miss ends the run
        (hashes are chained, so nothing after a miss can hit). With a window,
        ``k`` blocks hit when the ones the query at ``k * B`` sees are
        resident; the blocks before them come back as :data:`PAD_BLOCK`.
        """
        if not self.enable_prefix_caching or not tokens:
            return []
        b = self.block_size
        usable = (len(tokens) - 1) // b  # leave >= 1 token to compute
        if limit is not None:
            usable = min(usable, limit // b)
        hashes = prompt_block_hashes(tokens[: usable * b], b, extra_keys)
        blocks = [self.pool.cached_block(h) for h in hashes]
        best, run = 0, 0
        for j, block in enumerate(blocks):
            run = run + 1 if block is not None else 0
            if self.window is None and block is None:
                break
            if run >= j + 1 - self.held_from((j + 1) * b):
                best = j + 1
        first = self.held_from(best * b)
        return [
            (h, PAD_BLOCK if i < first or x is None else x)
            for i, (h, x) in enumerate(zip(hashes[:best], blocks, strict=False))
        ]

    def _name_full_blocks(self, seq: _Sequence) -> None:
        """Hash the blocks that have just filled, and offer the held ones to the prefix cache.

        Without prefix caching nothing is named: no lookup could use the names.
        Only verified tokens are named: a block holding a draft may yet lose it.
        """
        if not self.enable_prefix_caching:
            return
        b, first = self.block_size, len(seq.hashes)
        parent = seq.hashes[-1] if seq.hashes else None
        new = seq.tokens[first * b : seq.num_verified // b * b]
        seq.hashes.extend(prompt_block_hashes(new, b, seq.extra_keys, parent=parent))
        for i in range(max(first, seq.released), len(seq.hashes)):
            self.pool.register(seq.table[i], seq.hashes[i])
