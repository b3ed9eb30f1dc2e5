"""One mixed step, from the scheduler's output to the metadata a kernel receives.

Two requests are prefilled in step 0; a third arrives, and step 1 runs both
decodes and a 6-token chunk of its 10-token prompt in one flattened batch. The
picture draws that step's :class:`~spec.sched_types.SchedulerOutput` as the
kernel sees it: rows of the flattened batch, ``query_start_loc`` cutting them
into sequences, each sequence's ``seq_len`` (its whole context) beside its
``query_len`` (its new tokens this step), the block tables, and
``slot_mapping`` pointing every new token's K and V into the pool.

>>> out = mixed_step()
>>> out.scheduled, out.batch.query_start_loc, out.batch.seq_lens
(((0, 1), (1, 1), (2, 6)), (0, 1, 2, 8), (6, 4, 6))
>>> out.batch.block_tables, out.batch.slot_mapping
(((0, 1), (2, -1), (3, 4)), (5, 11, 12, 13, 14, 15, 16, 17))
"""

from __future__ import annotations

from paged_spec.svg import Svg
from spec.block_manager import PAD_BLOCK
from spec.request import Request
from spec.sched_types import SchedulerOutput
from spec.scheduler import ContinuousScheduler, SchedulerConfig

__all__ = ["MIXED_CONFIG", "draw_mixed_step", "mixed_step"]

MIXED_CONFIG = SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=8, max_num_seqs=3)

# Each sequence's (fill, stroke): two decodes in blues, the prefill chunk in the
# scheduler diagram's prompt orange. Text on every fill is near-black.
SEQ_COLORS = (("#dbeafe", "#2563eb"), ("#ede9fe", "#6d28d9"), ("#fed7aa", "#c2410c"))
INK, MUTED = "#111827", "#4b5563"


def mixed_step() -> SchedulerOutput:
    """Step 1 of a real scheduler: two decodes and a prefill chunk, within an 8-token budget."""
    sched = ContinuousScheduler(MIXED_CONFIG)
    sched.submit(Request(0, tuple(range(1, 6)), max_new_tokens=4))
    sched.submit(Request(1, tuple(range(1, 4)), max_new_tokens=4))
    first = sched.step()  # both prompts whole: 5 + 3 tokens
    sched.update({s.seq_id: 7 for s in first.samples})
    sched.submit(Request(2, tuple(range(1, 11)), max_new_tokens=2))
    return sched.step()


LEFT, CW, RH = 150, 62, 30  # label gutter, one flattened row's width, one row's height


def _row(svg: Svg, y: float, label: str, values: list[int], owner: list[int]) -> None:
    """One array indexed by flattened row: a labelled strip of cells, coloured by sequence."""
    svg.text(10, y + RH / 2, label, anchor="start", size=12, mono=True)
    for t, (v, s) in enumerate(zip(values, owner, strict=True)):
        fill, stroke = SEQ_COLORS[s]
        svg.rect(LEFT + t * CW + 2, y + 2, CW - 4, RH - 4, fill=fill, stroke=stroke)
        svg.text(LEFT + t * CW + CW / 2, y + RH / 2, str(v), size=12, mono=True, color=INK)


def _scheduled(svg: Svg, y: float, out: SchedulerOutput) -> None:
    """The scheduler's decision: one box per sequence over the rows it owns."""
    b = out.batch
    svg.text(10, y + RH / 2, "scheduled", anchor="start", size=12, bold=True)
    for i, seq in enumerate(b.seq_ids):
        lo, hi = b.query_start_loc[i], b.query_start_loc[i + 1]
        pos = b.positions[lo]
        what = "decode" if b.query_len(i) == 1 and pos > 0 else f"chunk {pos}..{pos + hi - lo - 1}"
        fill, stroke = SEQ_COLORS[i]
        x, w = LEFT + lo * CW + 2, (hi - lo) * CW - 4
        svg.rect(x, y - 4, w, RH + 4, fill=fill, stroke=stroke)
        svg.text(x + w / 2, y + 6, f"seq {seq}", size=11, color=INK, bold=True)
        svg.text(x + w / 2, y + 20, what, size=11, color=INK)


def _per_sequence(svg: Svg, y: float, out: SchedulerOutput, block_size: int) -> float:
    """seq_lens, query_len and block tables: one line per sequence; returns the next y."""
    b = out.batch
    svg.text(10, y + 10, "per sequence", anchor="start", size=12, bold=True)
    heads = ("i", "seq_lens[i]", "query_len", "block_tables[i]")
    xs = (LEFT, LEFT + 50, LEFT + 160, LEFT + 260)
    for x, h in zip(xs, heads, strict=True):
        svg.text(x, y + 10, h, anchor="start", size=11, mono=True, color=MUTED)
    for i in range(b.num_seqs):
        ry = y + 22 + i * RH
        fill, stroke = SEQ_COLORS[i]
        svg.rect(LEFT - 6, ry + 2, 500, RH - 4, fill=fill, stroke=stroke)
        cells = (str(i), str(b.seq_lens[i]), str(b.query_len(i)))
        for x, c in zip(xs[:3], cells, strict=True):
            svg.text(x, ry + RH / 2, c, anchor="start", size=12, mono=True, color=INK)
        row = ", ".join("PAD" if blk == PAD_BLOCK else str(blk) for blk in b.block_tables[i])
        svg.text(xs[3], ry + RH / 2, f"[{row}]", anchor="start", size=12, mono=True, color=INK)
    note = (
        f"seq_len counts the whole context, new tokens included; query_len only the new ones. "
        f"Blocks hold {block_size} slots."
    )
    svg.text(LEFT - 6, y + 22 + b.num_seqs * RH + 12, note, anchor="start", size=11, color=MUTED)
    return y + 22 + b.num_seqs * RH + 30


def _pool(svg: Svg, y: float, out: SchedulerOutput, cfg: SchedulerConfig) -> None:
    """The KV pool's slots: context already written (pale), and this step's writes (bold)."""
    b, bs = out.batch, cfg.block_size
    sw = 22
    svg.text(10, y + 26, "KV pool (slots)", anchor="start", size=12, bold=True)
    owner: dict[int, int] = {}  # slot -> row of the sequence that holds it
    for i, table in enumerate(b.block_tables):
        for j, blk in enumerate(table):
            for k in range(bs):
                if blk != PAD_BLOCK and j * bs + k < b.seq_lens[i]:
                    owner[blk * bs + k] = i
    new = set(b.slot_mapping)
    for blk in range(cfg.num_blocks):
        bx = LEFT + blk * (bs * sw + 8)
        svg.text(bx + bs * sw / 2, y + 6, f"block {blk}", size=10, color=MUTED)
        for k in range(bs):
            slot = blk * bs + k
            fill, stroke = SEQ_COLORS[owner[slot]] if slot in owner else ("#ffffff", "#9ca3af")
            bold = slot in new
            svg.rect(
                bx + k * sw, y + 16, sw - 2, sw, fill=fill, stroke=stroke, width=2.5 if bold else 1
            )
            svg.text(bx + k * sw + sw / 2 - 1, y + 16 + sw / 2, str(slot), size=9, color=INK)
    svg.text(
        LEFT, y + 16 + sw + 14, "bold: the slots slot_mapping writes this step", anchor="start",
        size=11, color=MUTED,
    )  # fmt: skip


def draw_mixed_step() -> str:
    """The picture: :func:`mixed_step` from the scheduler's decision down to the pool."""
    out, cfg = mixed_step(), MIXED_CONFIG
    b = out.batch
    owner = [i for i in range(b.num_seqs) for _ in range(b.query_len(i))]
    width = max(LEFT + b.num_tokens * CW + 20, LEFT + cfg.num_blocks * (cfg.block_size * 22 + 8))
    svg = Svg(width, 520)
    svg.text(10, 16, "One mixed step: two decodes and a prefill chunk, as the kernel receives it",
             anchor="start", size=15, bold=True)  # fmt: skip
    svg.text(10, 36, f"step {out.step} of ContinuousScheduler, budget "
             f"{cfg.max_num_batched_tokens} tokens: the batch is flattened into "
             f"{b.num_tokens} rows", anchor="start", size=11, color=MUTED)  # fmt: skip
    _scheduled(svg, 50, out)
    for t in range(b.num_tokens):
        svg.text(LEFT + t * CW + CW / 2, 92, f"row {t}", size=10, color=MUTED)
    y: float = 100
    _row(svg, y, "token_ids", list(out.token_ids), owner)
    _row(svg, y + RH, "positions", list(b.positions), owner)
    _row(svg, y + 2 * RH, "slot_mapping", list(b.slot_mapping), owner)
    qy = y + 3 * RH + 8
    svg.text(10, qy + 12, "query_start_loc", anchor="start", size=12, mono=True)
    for q in b.query_start_loc:
        svg.line(
            LEFT + q * CW, y - 8, LEFT + q * CW, qy + 2, color="#374151", width=1.5, arrow=False
        )
        svg.text(LEFT + q * CW, qy + 12, str(q), size=12, mono=True, bold=True)
    y = _per_sequence(svg, qy + 30, out, cfg.block_size)
    _pool(svg, y, out, cfg)
    svg.height = y + 70
    return svg.render()
