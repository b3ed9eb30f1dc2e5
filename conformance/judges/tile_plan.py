"""How the fast reference cuts one step's attention into tiles that fit a memory limit.

The fast reference (:mod:`conformance.judges.fast_reference`) never builds a
``[queries, heads, keys]`` score matrix for a whole step. It cuts each
sequence's new tokens into *items* of at most ``q_tile`` queries, each with the
key positions ``lo .. hi - 1`` its queries can see, and runs items in
*launches*: items of one launch share a query count (padded to the largest)
and are walked ``k_tile`` keys at a time. What one launch holds in memory at
once is :func:`tile_bytes`; the plan keeps it under the limit, whatever the
shape, or says by how much it cannot (:class:`MemoryLimitError`).

>>> shape = HeadShape(heads=64, kv_heads=8, head_dim=128)
>>> q, k = choose_tiles(shape, max_queries=8192, max_keys=32768, limit=DEFAULT_MEMORY_LIMIT)
>>> q, k, tile_bytes(shape, 1, q, k) <= DEFAULT_MEMORY_LIMIT
(512, 512, True)
>>> try:
...     choose_tiles(shape, 8192, 32768, limit=1000)
... except MemoryLimitError as e:
...     print(e)
memory limit 1000 bytes is too small for one tile of the fast reference: one query and one key \
over 64 query heads, 8 KV heads of dimension 128 need 183344 bytes; raise the memory limit
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from spec.errors import InvalidRequestError
from spec.validate import check_int

DEFAULT_MEMORY_LIMIT = 1 << 30
"""Bytes of temporaries one call of the fast reference may hold at once (1 GiB)."""

_WORD = 8
"""Bytes per element counted for every temporary: float64, the widest the reference uses."""
_KV_COPIES = 3
"""Copies of a gathered K (or V) tile alive at once: as gathered, dequantised, zeroed."""
_SCORE_COPIES = 4
"""Score-sized temporaries alive at once: the scores, an ALiBi or rounding temporary, the mask."""


class MemoryLimitError(InvalidRequestError):
    """The memory limit cannot hold even one query against one key: a setup error naming it."""


@dataclass(frozen=True)
class Tiles:
    """The largest tiles the plan may use; it shrinks them to fit the memory limit.

    Tests pass small ones, so that a short context already spans many tiles.
    """

    queries: int = 1024  # queries of one sequence per item
    keys: int = 4096  # keys per step of the walk over an item's visible range

    def __post_init__(self) -> None:
        check_int("Tiles.queries", self.queries, low=1)
        check_int("Tiles.keys", self.keys, low=1)


@dataclass(frozen=True)
class HeadShape:
    """Query heads, KV heads and head dimension of one layer."""

    heads: int
    kv_heads: int
    head_dim: int


def tile_bytes(shape: HeadShape, items: int, queries: int, keys: int) -> int:
    """Bytes of temporaries a launch of ``items`` items, ``queries`` x ``keys`` each, holds at once.

    Per item: the query tile and the output accumulator (``queries x H x D``),
    the row maxima and sums, ``_KV_COPIES`` copies each of the K and V tiles
    (``keys x H_kv x D``), ``_SCORE_COPIES`` score-sized temporaries
    (``H x queries x keys``), and the int64 key positions, slots and masks.
    Counted at 8 bytes an element, an upper bound for the float32 arithmetic too.
    """
    h, d = shape.heads, shape.head_dim
    per_item = (
        2 * queries * h * d
        + 2 * h * queries
        + 2 * _KV_COPIES * keys * shape.kv_heads * d
        + _SCORE_COPIES * h * queries * keys
        + 4 * keys
        + 2 * queries * keys
    )
    return _WORD * items * per_item


def choose_tiles(
    shape: HeadShape, max_queries: int, max_keys: int, limit: int, tiles: Tiles = Tiles()
) -> tuple[int, int]:
    """The query and key tile sizes: as large as ``tiles`` allows, one item under ``limit``.

    Starts from the smaller of ``tiles`` and the step's longest query run and
    key range, then halves the larger of the two until one item fits.
    """
    limit = check_int("memory_limit", limit, low=1)
    q = max(1, min(tiles.queries, max_queries))
    k = max(1, min(tiles.keys, max_keys))
    while tile_bytes(shape, 1, q, k) > limit and (q > 1 or k > 1):
        if k >= q:
            k = (k + 1) // 2
        else:
            q = (q + 1) // 2
    need = tile_bytes(shape, 1, q, k)
    if need > limit:
        raise MemoryLimitError(
            f"memory limit {limit} bytes is too small for one tile of the fast reference: one "
            f"query and one key over {shape.heads} query heads, {shape.kv_heads} KV heads of "
            f"dimension {shape.head_dim} need {need} bytes; raise the memory limit"
        )
    return q, k


@dataclass(frozen=True)
class Items:
    """A step's work, one entry per item (numpy int64 arrays of equal length).

    Item ``j`` is ``count[j]`` queries of batch sequence ``seq[j]``, at rows
    ``row[j] ..`` of the query and positions ``first[j] ..``; together they
    see keys ``lo[j] .. hi[j] - 1``.
    """

    seq: NDArray[np.int64]
    row: NDArray[np.int64]
    count: NDArray[np.int64]
    first: NDArray[np.int64]
    lo: NDArray[np.int64]
    hi: NDArray[np.int64]

    def __len__(self) -> int:
        return int(self.seq.shape[0])

    def take(self, index: NDArray[np.int64]) -> Items:
        return Items(*(a[index] for a in self._arrays()))

    def _arrays(self) -> tuple[NDArray[np.int64], ...]:
        return (self.seq, self.row, self.count, self.first, self.lo, self.hi)


def split_items(
    starts: NDArray[np.int64], seq_lens: NDArray[np.int64], window: int | None, q_tile: int
) -> Items:
    """Each sequence's new tokens cut into runs of at most ``q_tile`` queries.

    ``starts`` is ``query_start_loc`` (``S + 1``). A run at positions
    ``p0 .. p1`` sees keys ``first_visible(p0) .. p1``: causal, and no earlier
    than the window of its first query, so a windowed group's released blocks
    are never in range.
    """
    counts = np.diff(starts)
    pieces = -(-counts // q_tile)
    seq = np.repeat(np.arange(counts.shape[0], dtype=np.int64), pieces)
    offset = (np.arange(seq.shape[0]) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * q_tile
    count = np.minimum(counts[seq] - offset, q_tile)
    first = seq_lens[seq] - counts[seq] + offset
    lo = np.zeros_like(first) if window is None else np.maximum(first - window + 1, 0)
    return Items(seq, starts[seq] + offset, count, first, lo, first + count)


def plan_launches(items: Items, shape: HeadShape, k_tile: int, limit: int) -> list[Items]:
    """Items grouped into launches: equal query counts, similar key ranges, under ``limit``.

    Sorted by query count, then key range, so that padding each launch to its
    longest wastes little; a launch takes items while its tiles fit.
    """
    order = np.lexsort((items.hi - items.lo, items.count))
    launches: list[Items] = []
    group: list[int] = []
    for j in order.tolist():
        trial = [*group, j]
        n = int(items.count[trial].max())
        k = min(k_tile, int((items.hi - items.lo)[trial].max()))
        if group and (
            int(items.count[group[0]]) != int(items.count[j])
            or tile_bytes(shape, len(trial), n, k) > limit
        ):
            launches.append(items.take(np.asarray(group, dtype=np.int64)))
            trial = [j]
        group = trial
    if group:
        launches.append(items.take(np.asarray(group, dtype=np.int64)))
    return launches
