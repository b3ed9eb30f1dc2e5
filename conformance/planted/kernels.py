"""Planted kernels for the bounds checker: an outside project's adapter, with one bug each.

The adapter builds its own int32 block table from :class:`~spec.batch.BatchMetadata`
(tight, wider with another row stride, a view into a bigger buffer, or
column-major) and launches its own Triton kernel that sums each sequence's
keys through the table. ``bug`` chooses how it counts a row's entries:
exactly ``ceil(seq_len / B)`` (correct), ``floor(seq_len / B) + 1`` (one
entry too many when ``B`` divides ``seq_len``: a padding read), or the whole
power-of-two tile unmasked (padding, and past the end of the table tensor).
Every output stays right, so only an address-level check sees the bugs.

The same bugs in a whole backend, for the suite (``--check-bounds``): each of
:data:`PLANTED_BOUNDS` is :class:`~backend_gpu.triton_backend.TritonBackend`'s
KV write and block copy with an adapter's own float32 attention kernel
(:func:`_planted_attention`), which counts a row's table entries as ``bug``
says. Its outputs are right, so the suite without the check passes it.

>>> for line in sample_report():
...     print(line.split(": ", 1)[1][:58])
1 load of block-table padding in table_ptr (int32 [2, 3]);
1 load outside every tensor of the launch, nearest table_p
"""

from __future__ import annotations

# isort: split
# First: on a CPU-only machine this sets TRITON_INTERPRET, which must happen before triton
# is first imported (kernels are interpreted or compiled when they are decorated).
import backend_gpu  # noqa: F401

# isort: split
import numpy as np
import torch
import triton
import triton.language as tl

from backend_gpu.triton_backend import TritonBackend
from conformance.bounds.checker import BoundsChecker
from spec.attention import AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchMetadata
from spec.block_manager import cdiv
from spec.capabilities import Capabilities
from spec.errors import InvalidRequestError

EXACT, FLOOR_PLUS_ONE, WHOLE_TILE = 0, 1, 2  # how _paged_sum counts a row's table entries


@triton.jit  # type: ignore[untyped-decorator]
def _paged_sum(  # type: ignore[no-untyped-def]
    k_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    stride_kb,
    stride_row,
    stride_col,
    B: tl.constexpr,
    NB: tl.constexpr,
    D: tl.constexpr,
    BUG: tl.constexpr,
):
    """out[seq] = the sum of the sequence's keys, found through its block table."""
    seq = tl.program_id(0)
    seq_len = tl.load(lens_ptr + seq)
    j = tl.arange(0, NB)
    row = table_ptr + seq * stride_row
    if BUG == 2:  # the whole power-of-two tile of entries, unmasked
        ids = tl.load(row + j * stride_col)
    else:
        # BUG 1: floor + 1 where ceil was meant, one entry too many when B divides seq_len
        n = seq_len // B + 1 if BUG == 1 else (seq_len + B - 1) // B
        ids = tl.load(row + j * stride_col, mask=j < n, other=0)
    s = tl.arange(0, B)
    t = j[:, None] * B + s[None, :]
    d = tl.arange(0, D)
    off = ids.to(tl.int64)[:, None, None] * stride_kb + s[None, :, None] * D + d[None, None, :]
    k = tl.load(k_ptr + off, mask=(t < seq_len)[:, :, None], other=0.0)
    tl.store(out_ptr + seq * D + d, tl.sum(tl.sum(k, 0), 0))


def _table(batch: BatchMetadata, layout: str) -> torch.Tensor:
    """The adapter's own int32 table: ``tight``, ``wide``, ``view`` or ``colmajor``."""
    rows, width = batch.num_seqs, max(len(t) for t in batch.block_tables)
    host = torch.tensor(batch.block_tables, dtype=torch.int32).reshape(rows, width)
    if layout == "tight":
        return host
    buf = torch.full((rows + 2, width + 3), -1, dtype=torch.int32)  # wider, more rows
    buf[:rows, :width] = host
    if layout == "wide":
        return buf
    if layout == "view":
        return buf[:rows, :width]  # row stride width + 3, rows of a bigger buffer
    assert layout == "colmajor"
    return host.t().contiguous().t()


def paged_sum(
    k_cache: torch.Tensor, batch: BatchMetadata, bug: int = EXACT, layout: str = "tight"
) -> torch.Tensor:
    """Launch :func:`_paged_sum` for ``batch`` over ``k_cache`` ``[N, B, D]``."""
    table = _table(batch, layout)
    lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
    out = torch.empty(batch.num_seqs, k_cache.shape[2], dtype=torch.float32)
    nb = triton.next_power_of_2(table.shape[1])
    _paged_sum[(batch.num_seqs,)](
        k_cache,
        table,
        lens,
        out,
        k_cache.stride(0),
        *table.stride(),
        B=k_cache.shape[1],
        NB=nb,
        D=k_cache.shape[2],
        BUG=bug,
    )
    return out


def expected_sum(k_cache: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
    flat = k_cache.reshape(-1, k_cache.shape[2])
    b = batch.block_size
    rows = [
        flat[[table[p // b] * b + p % b for p in range(n)]].sum(0)
        for table, n in zip(batch.block_tables, batch.seq_lens, strict=True)
    ]
    return torch.stack(rows)


def batch_of(seq_lens: list[int], block_size: int, seed: int = 0) -> BatchMetadata:
    """A decode step's metadata: scattered block ids, rows padded with -1 to the longest."""
    used = [cdiv(n, block_size) for n in seq_lens]
    ids = np.random.default_rng(seed).permutation(sum(used)).tolist()
    width, tables, at = max(used), [], 0
    for u in used:
        tables.append(tuple(ids[at : at + u]) + (-1,) * (width - u))
        at += u
    starts = tuple(range(len(seq_lens) + 1))
    return BatchMetadata(
        block_size, tuple(range(len(seq_lens))), starts, tuple(seq_lens), tuple(tables), (), ()
    )


def cache_for(batch: BatchMetadata, head_dim: int = 4) -> torch.Tensor:
    blocks = sum(cdiv(n, batch.block_size) for n in batch.seq_lens)
    gen = torch.Generator().manual_seed(1)
    return torch.randn(blocks, batch.block_size, head_dim, generator=gen)


def sample_report(strict: bool = True) -> list[str]:
    """What the checker says of the whole-tile kernel on a 2 x 3 table (docs/bounds-checking.md)."""
    batch = batch_of([8, 11], block_size=4)
    checker = BoundsChecker(strict=strict)
    with checker.watch("attention", layer=0, batch=batch) as seen:
        paged_sum(cache_for(batch), batch, WHOLE_TILE, "tight")
    return [v.describe() for v in seen.violations]


# -- whole backends for the suite ------------------------------------------------------------


@triton.jit  # type: ignore[untyped-decorator]
def _planted_attention(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    table_ptr,
    lens_ptr,
    qsl_ptr,
    seq_of_ptr,
    stride_row,
    scale,
    H: tl.constexpr,
    HP: tl.constexpr,
    GROUP: tl.constexpr,
    HKV: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    NB: tl.constexpr,
    BUG: tl.constexpr,
):
    """out[token, h] = softmax(scale * q[h] . k) . v over the keys at or before the token.

    One program per token, every head and the whole context in one tile: the
    table row's ``NB`` entries, ``BP`` slots each, ``HP`` heads, ``DP``
    elements a key (query head ``h`` reads KV head ``h // GROUP``).
    """
    tok = tl.program_id(0)
    seq = tl.load(seq_of_ptr + tok)
    seq_len = tl.load(lens_ptr + seq)
    first = tl.load(qsl_ptr + seq)
    pos = seq_len - (tl.load(qsl_ptr + seq + 1) - first) + (tok - first)
    h = tl.arange(0, HP)
    d = tl.arange(0, DP)
    hd = (h[:, None] < H) & (d[None, :] < D)  # [HP, DP]
    q = tl.load(q_ptr + (tok * H + h[:, None]) * D + d[None, :], mask=hd, other=0.0)
    j = tl.arange(0, NB)
    row = table_ptr + seq * stride_row
    if BUG == 2:  # the whole power-of-two tile of entries, unmasked
        ids = tl.load(row + j)
    else:
        # BUG 1: floor + 1 where ceil was meant, one entry too many when B divides seq_len
        n = seq_len // B + 1 if BUG == 1 else (seq_len + B - 1) // B
        ids = tl.load(row + j, mask=j < n, other=0)
    s = tl.arange(0, BP)
    ok = (s[None, :] < B) & (j[:, None] * B + s[None, :] <= pos)  # [NB, BP]: keys 0 .. pos
    slot = ids.to(tl.int64)[:, None] * B + s[None, :]
    head_off = ((h // GROUP)[:, None] * D + d[None, :])[None, None, :, :]  # [1, 1, HP, DP]
    off = (slot * HKV * D)[:, :, None, None] + head_off
    lanes = ok[:, :, None, None] & hd[None, None, :, :]
    k = tl.load(k_ptr + off, mask=lanes, other=0.0)
    scores = tl.sum(k * q[None, None, :, :], 3) * scale  # [NB, BP, HP]
    scores = tl.where(ok[:, :, None], scores, float("-inf"))
    p = tl.exp(scores - tl.max(tl.max(scores, 0), 0)[None, None, :])
    v = tl.load(v_ptr + off, mask=lanes, other=0.0)
    out = tl.sum(tl.sum(p[:, :, :, None] * v, 0), 0) / tl.sum(tl.sum(p, 0), 0)[:, None]
    tl.store(out_ptr + (tok * H + h[:, None]) * D + d[None, :], out, mask=hd)


class TableAdapterBackend(TritonBackend):
    """An outside project's backend: the project's KV write and copy, its own attention kernel.

    The adapter builds its own block table (``layout``, see :func:`_table`) and
    launches :func:`_planted_attention`, counting each row's entries as
    ``bug`` says. Float32, plain attention, one KV cache group: what the
    kernel runs, declared so that the suite draws nothing else. ``bug`` =
    ``EXACT`` is the correct kernel (it passes strict mode).
    """

    bug = EXACT
    layout = "tight"

    def __init__(self) -> None:
        super().__init__(device="cpu")

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name=type(self).__name__, dtypes=frozenset({"float32"}))

    def attention(  # type: ignore[override]  # the numpy contract only (never tensors="torch")
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        q, k_cache, v_cache, scale, v = self._query_inputs(layer, query, batch, scale, variant)
        if not v.is_plain:
            raise InvalidRequestError(f"{type(self).__name__} runs plain attention only")
        q = q[: batch.num_tokens].contiguous()
        table = _table(batch, self.layout)
        lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
        qsl = torch.tensor(batch.query_start_loc, dtype=torch.int32)
        seq_of = torch.repeat_interleave(
            torch.arange(batch.num_seqs, dtype=torch.int32), torch.diff(qsl.to(torch.int64))
        )
        out = torch.empty_like(q)
        _, b, kv_heads, d = k_cache.shape
        heads = q.shape[1]
        _planted_attention[(batch.num_tokens,)](
            q,
            k_cache,
            v_cache,
            out,
            table,
            lens,
            qsl,
            seq_of,
            table.stride(0),
            scale,
            H=heads,
            HP=triton.next_power_of_2(heads),
            GROUP=heads // kv_heads,
            HKV=kv_heads,
            B=b,
            BP=triton.next_power_of_2(b),
            D=d,
            DP=triton.next_power_of_2(d),
            NB=triton.next_power_of_2(table.shape[1]),
            BUG=self.bug,
        )
        return out.numpy().copy()


class ReadsOnePastARow(TableAdapterBackend):
    """Counts a row's table entries as ``floor(seq_len / B) + 1``: one too many when ``B``
    divides ``seq_len``, a read of one padding entry. Its table has spare columns, so the read
    never leaves the tensor: the default check allows it, strict mode flags it."""

    bug = FLOOR_PLUS_ONE
    layout = "wide"


class ReadsPastTheTable(TableAdapterBackend):
    """Loads a whole power-of-two tile of table entries, unmasked: past every row, and past the
    end of the (tight) table tensor from the last row when the width is not a power of two.
    Flagged in both modes."""

    bug = WHOLE_TILE
    layout = "tight"


class ReadsTheWideRow(TableAdapterBackend):
    """Asks for an engine's persistent table (``table_width`` 64) and loads a whole
    power-of-two tile of its row unmasked, as the suite's table: inside the tensor, so the
    default check allows it, but every entry past the row's used ones is padding, which
    strict mode flags. (With the exact-width table it reads past the tensor instead.)"""

    bug = WHOLE_TILE
    layout = "tight"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=type(self).__name__, dtypes=frozenset({"float32"}), table_width=WIDE_TABLE
        )


WIDE_TABLE = 64
"""The persistent table width :class:`ReadsTheWideRow` declares (a power of two: its tile)."""

PLANTED_BOUNDS: dict[str, tuple[type[TableAdapterBackend], str]] = {
    "reads one block-table entry past a row (padding)": (ReadsOnePastARow, "strict"),
    "reads past the end of the block-table tensor": (ReadsPastTheTable, "default"),
    "reads a wide (persistent) table's padding past a row": (ReadsTheWideRow, "strict"),
}
"""Planted bounds bugs for the suite: label -> (backend, the least mode that must flag it)."""
