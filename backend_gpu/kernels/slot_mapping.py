"""Slot mapping on the device: where each scheduled token's K and V go.

Token ``j`` of sequence ``i`` sits at position ``p = seq_len - query_len + j``
and goes to slot ``block_tables[i, p // B] * B + p % B`` (int64: a large pool
times a block size overflows int32). Computing it in a kernel spares a GPU
engine a host round trip per step; :func:`spec.batch.build_batch` is the
host-side reference it must match.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from backend_gpu.kernels._checks import check_device, check_tensor, next_pow2
from backend_gpu.kernels.target import launch_target
from spec.block_manager import cdiv
from spec.errors import InvalidRequestError


@triton.jit(do_not_specialize=["stride_bt"])  # type: ignore[untyped-decorator]
def _slot_mapping_kernel(  # type: ignore[no-untyped-def]
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    slot_ptr,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Program ``(i, c)`` maps tokens ``c * BLOCK_Q ..`` of sequence ``i``."""
    seq = tl.program_id(0)
    start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - start
    seq_len = tl.load(seq_lens_ptr + seq)
    j = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    ok = j < query_len
    pos = (seq_len - query_len + j).to(tl.int64)
    row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    block = tl.load(row + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    tl.store(slot_ptr + start + j, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=ok)


def compute_slot_mapping(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    *,
    num_tokens: int | None = None,
    max_query_len: int | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Slots ``[num_tokens]`` (int64) for the batch, computed on the tables' device.

    ``block_tables`` is ``[S, W]`` int32, ``query_start_loc`` ``[S + 1]`` int32 and
    ``seq_lens`` ``[S]`` int32. ``num_tokens`` and ``max_query_len`` size the
    output and the grid; a ``num_tokens`` above the batch's token count pads the
    mapping with -1 (the padding slot). With ``check`` (the default) both are
    checked against the metadata, which reads it back from the device; pass
    ``check=False`` only with values known to be right (then nothing stops a
    kernel read past a table row).
    """
    tables = check_tensor("block_tables", block_tables, 2, (torch.int32,))
    qsl = check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    lens = check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    if block_size < 1:
        raise InvalidRequestError(f"block_size must be >= 1, got {block_size}")
    num_seqs = lens.shape[0]
    if qsl.shape[0] != num_seqs + 1 or tables.shape[0] != num_seqs:
        raise InvalidRequestError(
            f"{num_seqs} seq_lens need query_start_loc of {num_seqs + 1} and {num_seqs} table "
            f"rows, got {qsl.shape[0]} and {tables.shape[0]}"
        )
    check_device(tables.device, ("query_start_loc", qsl), ("seq_lens", lens))
    if tables.stride(1) != 1 or not qsl.is_contiguous() or not lens.is_contiguous():
        raise InvalidRequestError("block_tables rows, query_start_loc and seq_lens must be dense")
    if num_tokens is None or max_query_len is None or check:
        _check_rows(qsl, lens, tables.shape[1], block_size)
        true_tokens = int(qsl[-1]) if num_seqs else 0
        true_max = int((qsl[1:] - qsl[:-1]).max()) if num_seqs else 0
        if num_tokens is not None and num_tokens < true_tokens:
            raise InvalidRequestError(
                f"num_tokens {num_tokens} is below the batch's {true_tokens} tokens"
            )
        if max_query_len is not None and max_query_len < true_max:
            raise InvalidRequestError(
                f"max_query_len {max_query_len} is below the batch's longest query {true_max}"
            )
        num_tokens = true_tokens if num_tokens is None else num_tokens
        max_query_len = true_max if max_query_len is None else max_query_len
    out = torch.full((num_tokens,), -1, dtype=torch.int64, device=tables.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_q = min(next_pow2(max_query_len), 256 if launch_target(tables.device).gpu else 4096)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q))
    _slot_mapping_kernel[grid](
        tables, qsl, lens, out, tables.stride(0), BLOCK_SIZE=block_size, BLOCK_Q=block_q
    )
    return out


def _check_rows(qsl: torch.Tensor, lens: torch.Tensor, width: int, block_size: int) -> None:
    """Every position the kernel maps lies in its table row: no read past the row's end.

    ``query_start_loc`` starts at 0 and never decreases, each ``seq_len`` is at
    least its query length (so no position is negative), and each row holds
    ``ceil(seq_len / B)`` entries (so ``table[p // B]`` exists for every ``p``).
    """
    starts, seq_lens = qsl.cpu().tolist(), lens.cpu().tolist()
    if starts and (starts[0] != 0 or any(b < a for a, b in itertools.pairwise(starts))):
        raise InvalidRequestError(f"query_start_loc must start at 0 and not decrease: {starts}")
    for i, seq_len in enumerate(seq_lens):
        query_len = starts[i + 1] - starts[i]
        if seq_len < query_len:
            raise InvalidRequestError(
                f"sequence {i}: seq_len {seq_len} < its {query_len} new tokens"
            )
        if query_len and cdiv(seq_len, block_size) > width:
            raise InvalidRequestError(
                f"sequence {i}: seq_len {seq_len} needs {cdiv(seq_len, block_size)} table "
                f"entries of {block_size} tokens, but block_tables rows are {width} wide"
            )
