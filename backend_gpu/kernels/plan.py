"""Launch plans: each attention kernel's tiles, warps and split-KV parts; each KV write's tile.

A plan is a function of the batch and of a :class:`~.target.LaunchTarget`: a GPU's (the
device, or the H200 the interpreter plays), or the interpreter's own few fat programs.
Each attention kernel picks its query tile (:func:`.attention.plan`,
:func:`.latent_attention.latent_plan`); the rest of a plan is one rule for both
(:func:`finish_plan`), the split rule included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from backend_gpu.kernels._checks import next_pow2
from backend_gpu.kernels.target import LaunchTarget
from spec.errors import InvalidRequestError
from spec.kv_budget import cdiv


class BatchShape(NamedTuple):
    """What a plan is made for: the batch's sequences, its longest query and context, and
    the layer's window."""

    num_seqs: int
    max_query_len: int
    max_seq_len: int
    window: int | None


@dataclass(frozen=True)
class Plan:
    """One launch: programs of ``block_q`` query tokens x ``heads`` query heads,
    ``q_tiles`` of them along a sequence's queries and ``head_tiles`` across its heads,
    ``block_n`` keys a tile, ``num_splits`` KV ranges; ``keys`` the most keys one query
    tile sees (the window's span, or the longest context), which the splits divide."""

    heads: int
    head_tiles: int
    block_q: int
    q_tiles: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    keys: int

    @property
    def keys_per_split(self) -> int:
        """The keys of one split's range: whole key tiles."""
        return cdiv(cdiv(self.keys, self.num_splits), self.block_n) * self.block_n

    def grid(self, num_seqs: int) -> tuple[int, int, int]:
        """``(sequences x query tiles, head tiles, splits)``."""
        return num_seqs * self.q_tiles, self.head_tiles, self.num_splits


@dataclass(frozen=True)
class SplitRule:
    """When a plan splits a decode's keys: from ``min_keys`` visible keys, about ``part_keys``
    keys a part, at most ``max_parts`` parts; on a GPU only while the call's programs
    (sequences x KV heads, or x head tiles) are fewer than twice the SMs."""

    min_keys: int
    part_keys: int
    max_parts: int


def split_rule(target: LaunchTarget) -> SplitRule:
    """The split rule of ``target``'s plans (both attention kernels follow it).

    >>> from backend_gpu.kernels.target import FAT_PROGRAMS, H200
    >>> split_rule(H200), split_rule(FAT_PROGRAMS).min_keys
    (SplitRule(min_keys=1024, part_keys=512, max_parts=64), 256)
    """
    return SplitRule(1024, 512, 64) if target.gpu else SplitRule(256, 128, 4)


def finish_plan(
    target: LaunchTarget,
    heads: int,
    head_tiles: int,
    block_q: int,
    rows: int,
    gpu_tile: tuple[int, int, int],
    batch: BatchShape,
    num_splits: int | None,
    block_n: int | None,
) -> Plan:
    """The plan of programs of ``block_q`` tokens x ``heads`` (``rows`` rows), ``head_tiles``
    of them across the heads.

    The key tile: a GPU's ``gpu_tile`` ``(block_n, warps, stages)``; the interpreter's
    follows the keys. ``block_n`` (a power of two >= 16) and ``num_splits`` (1..1024)
    override. With a window, "keys" is what one query tile sees (``w + BLOCK_Q - 1`` at
    most), not the context: a short window over a long context needs no split.
    """
    q_tiles = cdiv(batch.max_query_len, block_q)
    keys = batch.max_seq_len
    if batch.window is not None:
        keys = min(keys, batch.window + min(batch.max_query_len, block_q) - 1)
    tile_n, warps, stages = gpu_tile if target.gpu else (min(64, max(16, next_pow2(keys))), 4, 1)
    if block_n is None:
        block_n = tile_n
    elif block_n < 16 or block_n != next_pow2(block_n):
        raise InvalidRequestError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        num_splits = _count_splits(batch.num_seqs * q_tiles * head_tiles, rows, keys, target)
    if not 1 <= num_splits <= 1024:
        raise InvalidRequestError(f"num_splits must be in 1..1024, got {num_splits}")
    return Plan(heads, head_tiles, block_q, q_tiles, block_n, num_splits, warps, stages, keys)


def _count_splits(programs: int, rows: int, max_keys: int, target: LaunchTarget) -> int:
    """Parts for a decode (16 rows or fewer) by :func:`split_rule`: on a GPU enough to fill
    its SMs twice over, if the call's programs alone do not."""
    rule = split_rule(target)
    if rows > 16 or max_keys < rule.min_keys:
        return 1
    if target.num_sms is None:
        return min(rule.max_parts, cdiv(max_keys, rule.part_keys))
    if programs >= 2 * target.num_sms:
        return 1
    fill = cdiv(2 * target.num_sms, programs)
    return max(1, min(fill, cdiv(max_keys, rule.part_keys), rule.max_parts))


def write_tile(row_width: int, target: LaunchTarget) -> tuple[int, int]:
    """A KV write's ``(ROW_PAD, BLOCK_T)``: rows padded to a power of two, tokens a program.

    A GPU's plan: about 4K elements a program; the interpreter's own: few fat programs. The
    tile does not follow the token count, which would make a kernel per power of two.
    """
    row_pad = next_pow2(row_width)
    return row_pad, max(1, (4096 if target.gpu else 1 << 16) // row_pad)
