"""One block of a latent KV cache (multi-head latent attention), drawn from the spec's state.

A sequence of 6 tokens is laid out by a real :class:`~spec.block_manager.BlockManager`
(blocks of 4) and its rows are written into a latent
:class:`~spec.kv_memory.KVMemory` of 8 + 4 columns (DeepSeek-V3's are 512 + 64)
through the batch's slot mapping; the picture reads the sequence's blocks back
with :meth:`~spec.kv_memory.KVMemory.read_blocks`: each written slot holds one
row ``[c_kv | k_rope]``, the unwritten ones NaN, and every query head reads
the same row.

>>> table, c_kv, k_rope = latent_block_state()
>>> table, c_kv.shape, k_rope.shape
([0, 1], (2, 4, 1, 8), (2, 4, 1, 4))
>>> float(c_kv[1, 1, 0, 0]), bool(np.isnan(c_kv[1, 2]).all())    # token 5; slot 6 unwritten
(6.0, True)
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from paged_spec.svg import Svg
from spec.batch import build_batch
from spec.block_manager import BlockManager
from spec.kv_geometry import KVGeometry
from spec.kv_memory import KVMemory

__all__ = ["LATENT_DIM", "ROPE_DIM", "draw_latent_block", "latent_block_state"]

LATENT_DIM, ROPE_DIM, BLOCK_SIZE, TOKENS = 8, 4, 4, 6
C_KV, K_ROPE, EMPTY = ("#dbeafe", "#2563eb"), ("#fed7aa", "#c2410c"), ("#f3f4f6", "#9ca3af")
INK, MUTED = "#111827", "#4b5563"
LEFT, CW, RH, TOP = 190, 30, 28, 70  # label gutter, cell width, row height, first row's y


def latent_block_state() -> tuple[list[int], NDArray[np.float64], NDArray[np.float64]]:
    """The sequence's block table and its blocks' c_kv and k_rope, read back from the memory.

    Token ``p``'s row is ``p + 1`` in every c_kv column and ``-(p + 1)`` in every k_rope column.
    """
    m = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    m.add_sequence(0, [])
    m.append_slots(0, list(range(TOKENS)))
    batch = build_batch(m, [(0, TOKENS)])
    mem = KVMemory(1, 4, BLOCK_SIZE, 1, LATENT_DIM + ROPE_DIM, latent_dim=LATENT_DIM)
    p = np.arange(1, TOKENS + 1, dtype=np.float64)[:, None, None]
    c = np.broadcast_to(p, (TOKENS, 1, LATENT_DIM)).copy()
    r = np.broadcast_to(-p, (TOKENS, 1, ROPE_DIM)).copy()
    mem.write(0, c, r, batch.slot_mapping)
    table = list(m.block_table(0))
    c_kv, k_rope = mem.read_blocks(0, table)
    return table, c_kv, k_rope


def draw_latent_block() -> str:
    """The sequence's blocks, one row a slot: c_kv cells, then k_rope cells, or an empty row."""
    table, c_kv, k_rope = latent_block_state()
    width = LEFT + (LATENT_DIM + ROPE_DIM) * CW + 250
    rows = len(table) * (BLOCK_SIZE + 1)
    svg = Svg(width, TOP + rows * RH + 90)
    svg.text(12, 22, _title(), anchor="start", size=15, bold=True)
    svg.text(12, 44, _subtitle(), anchor="start", size=12, color=MUTED)
    y = TOP
    for j, block in enumerate(table):
        svg.text(12, y + RH / 2, f"block {block} (table[{j}])", anchor="start", size=12, bold=True)
        y += RH
        for offset in range(BLOCK_SIZE):
            slot, token = block * BLOCK_SIZE + offset, j * BLOCK_SIZE + offset
            _slot_row(svg, y, slot, token, c_kv[j, offset, 0], k_rope[j, offset, 0])
            y += RH
    _braces(svg, y + 8)
    x = LEFT + (LATENT_DIM + ROPE_DIM) * CW + 16
    notes = ("one row a token and layer,", "shared by every query head:", "no per-head K, no V")
    for i, line in enumerate(notes):
        svg.text(x, TOP + RH * (1.5 + i * 0.8), line, anchor="start", size=12, color=INK)
    return svg.render()


def _title() -> str:
    return (
        f"A latent KV cache: rows of [c_kv ({LATENT_DIM}) | k_rope ({ROPE_DIM})], "
        f"blocks of {BLOCK_SIZE} tokens"
    )


def _subtitle() -> str:
    row = KVGeometry(1, 1, 1, 1, 576, "bfloat16", latent_dim=512).bytes_per_token
    return (
        f"{TOKENS} tokens written through the slot mapping; DeepSeek-V3's rows are "
        f"512 + 64 wide ({row:,} bytes in bf16)"
    )


def _slot_row(
    svg: Svg, y: float, slot: int, token: int, c: NDArray[np.float64], r: NDArray[np.float64]
) -> None:
    """One slot: its label, then its row's cells (or one empty bar when it was never written)."""
    written = not np.isnan(c).all()
    label = f"slot {slot}: token {token}" if written else f"slot {slot}: empty (NaN)"
    svg.text(28, y + RH / 2, label, anchor="start", size=12, mono=True, color=INK)
    if not written:
        w = (LATENT_DIM + ROPE_DIM) * CW - 4
        svg.rect(LEFT + 2, y + 3, w, RH - 6, fill=EMPTY[0], stroke=EMPTY[1], dash=True)
        return
    for i, value in enumerate([*c, *r]):
        fill, stroke = C_KV if i < LATENT_DIM else K_ROPE
        x = LEFT + i * CW
        svg.rect(x + 2, y + 3, CW - 4, RH - 6, fill=fill, stroke=stroke)
        svg.text(x + CW / 2, y + RH / 2, f"{value:g}", size=11, mono=True, color=INK)


def _braces(svg: Svg, y: float) -> None:
    """What each column range is for: c_kv serves scores and values, k_rope scores only."""
    spans = (
        (0, LATENT_DIM, C_KV[1], "c_kv: scores and values (V = these columns)"),
        (LATENT_DIM, LATENT_DIM + ROPE_DIM, K_ROPE[1], "k_rope: scores"),
    )
    for i, (a, b, color, text) in enumerate(spans):
        x0, x1 = LEFT + a * CW + 2, LEFT + b * CW - 2
        svg.line(x0, y, x1, y, color=color, width=2, arrow=False)
        svg.text(x0, y + 16 + 18 * i, text, anchor="start", size=12, color=INK)
