"""The batch metadata both attention kernels take, checked on the host before a launch.

``query_start_loc`` ``[S + 1]``, ``seq_lens`` ``[S]`` and ``block_tables`` ``[S, W]``
are int32 as in :mod:`spec.batch`. A kernel follows every table entry it reads, so each
one that will be read must be a block of the cache (a GPU sync to check; an engine that
trusts its scheduler may skip it).
"""

from __future__ import annotations

import itertools

import torch

from backend_gpu.kernels._checks import check_tensor
from spec.errors import InvalidRequestError
from spec.kv_budget import cdiv


def check_batch(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Types, shapes and strides; the values are :func:`batch_maxima`'s."""
    qsl = check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    lens = check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    tables = check_tensor("block_tables", block_tables, 2, (torch.int32,))
    num_seqs = lens.shape[0]
    if qsl.shape[0] != num_seqs + 1 or tables.shape[0] != num_seqs:
        raise InvalidRequestError(
            f"{num_seqs} seq_lens need query_start_loc of {num_seqs + 1} and {num_seqs} table "
            f"rows, got {qsl.shape[0]} and {tables.shape[0]}"
        )
    if not (qsl.is_contiguous() and lens.is_contiguous() and tables.stride(1) == 1):
        raise InvalidRequestError("query_start_loc, seq_lens and block_tables rows must be dense")
    return qsl, lens, tables


def batch_maxima(
    qsl: torch.Tensor,
    lens: torch.Tensor,
    tables: torch.Tensor,
    cache_shape: torch.Size,
    query_rows: int,
    window: int | None,
    given: tuple[int | None, int | None],
    check: bool,
) -> tuple[int, int]:
    """``(max_query_len, max_seq_len)``: ``given`` where not ``None``, else read from the batch.

    With ``check``, the metadata's values first (:func:`_check_values`), and ``given``
    must not be less than the batch's own (the grid would miss tokens).
    """
    if check:
        true_max = _check_values(qsl, lens, tables, cache_shape, query_rows, window)
        if any(g is not None and g < t for g, t in zip(given, true_max, strict=True)):
            raise InvalidRequestError(
                f"max_query_len, max_seq_len = {given} but the batch has {true_max}"
            )
    max_query_len, max_seq_len = given
    num_seqs = lens.shape[0]
    if max_query_len is None:
        max_query_len = int((qsl[1:] - qsl[:-1]).max()) if num_seqs else 0
    if max_seq_len is None:
        max_seq_len = int(lens.max()) if num_seqs else 0
    return max_query_len, max_seq_len


def _check_values(
    qsl: torch.Tensor,
    lens: torch.Tensor,
    tables: torch.Tensor,
    cache_shape: torch.Size,
    query_rows: int,
    window: int | None = None,
) -> tuple[int, int]:
    """The metadata is well formed and every table entry that will be read is a block.

    With a window, entries of blocks wholly before the first query's window are
    never read: they may be anything (``-1`` for a released block).
    Returns the batch's true ``(max_query_len, max_seq_len)``.
    """
    num_blocks, block_size = cache_shape[0], cache_shape[1]
    starts, seq_lens = qsl.cpu().tolist(), lens.cpu().tolist()
    if starts[0] != 0 or any(b < a for a, b in itertools.pairwise(starts)):
        raise InvalidRequestError(f"query_start_loc must start at 0 and not decrease: {starts}")
    if starts[-1] > query_rows:
        raise InvalidRequestError(
            f"the batch has {starts[-1]} tokens but query has {query_rows} rows"
        )
    host_tables = tables.cpu()
    width = host_tables.shape[1]
    for i, seq_len in enumerate(seq_lens):
        query_len = starts[i + 1] - starts[i]
        if seq_len < query_len:
            raise InvalidRequestError(
                f"sequence {i}: seq_len {seq_len} < its {query_len} new tokens"
            )
        used = cdiv(seq_len, block_size)
        if used > width:
            raise InvalidRequestError(
                f"sequence {i}: {seq_len} tokens need {used} blocks, the table has {width}"
            )
        first = 0 if window is None else max(0, seq_len - query_len - window + 1) // block_size
        row = host_tables[i, first:used]
        bad = (row < 0) | (row >= num_blocks)
        if bool(bad.any()):
            raise InvalidRequestError(
                f"sequence {i}: block {int(row[bad][0])} is outside 0..{num_blocks - 1}"
            )
    query_lens = [b - a for a, b in itertools.pairwise(starts)]
    return max(query_lens, default=0), max(seq_lens, default=0)
