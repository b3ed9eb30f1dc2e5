"""Hand-built SVG for the docs' diagrams: a tiny drawing API and two pictures.

* :func:`draw_memory` draws :class:`MemoryState` panels: each sequence's
  logical tokens grouped into logical blocks, under each logical block its
  block-table entry, an arrow to that physical block, and the physical pool
  with every block's reference count and contents; copy-on-write copies are
  green arrows.
* :func:`draw_schedule` draws a scheduler run as a grid: one row per request,
  one column per step, each cell what the request did in that step.

Both take plain data captured from the spec (:func:`capture`; the schedule's
cells come from ``SchedulerOutput``), never a hand-drawn state, and their
output is deterministic text, so a test can compare it with the committed file.

>>> svg = Svg(100, 40)
>>> svg.rect(0, 0, 10, 10, fill="#fff")
>>> svg.text(5, 5, "a < b")
>>> print(svg.render().splitlines()[2])
<rect x="0" y="0" width="10" height="10" fill="#fff" stroke="#6b7280" stroke-width="1" rx="2"/>
>>> svg.render().count("a &lt; b")
1
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape

from spec.block_manager import BlockManager

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"
COLORS = {
    "free": ("#ffffff", "#9ca3af"),
    "held": ("#dbeafe", "#2563eb"),
    "shared": ("#fed7aa", "#c2410c"),
    "copy": ("#bbf7d0", "#15803d"),
    "other": ("#e5e7eb", "#6b7280"),
    "cached": ("#ede9fe", "#6d28d9"),
    "draft": ("#fef08a", "#a16207"),
    "rejected": ("#fee2e2", "#b91c1c"),
}
LEGEND = {
    "free": "free",
    "held": "held by one sequence",
    "shared": "shared (reference count > 1)",
    "copy": "copy-on-write copy",
    "other": "held by other sequences",
    "cached": "cached (no holder)",
    "draft": "draft token (lookahead slot)",
    "rejected": "rejected draft's K/V, past the length: never read",
}


def _n(x: float) -> str:
    """A coordinate: integers print without a decimal point, others with one decimal."""
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


class Svg:
    """An SVG document built element by element; :meth:`render` returns its text."""

    def __init__(self, width: float, height: float) -> None:
        self.width, self.height = width, height
        self._items: list[str] = []

    def rect(
        self,
        x: float,
        y: float,
        w: float,
        h: float,
        *,
        fill: str,
        stroke: str = "#6b7280",
        width: float = 1,
        dash: bool = False,
    ) -> None:
        extra = ' stroke-dasharray="4 3"' if dash else ""
        self._items.append(
            f'<rect x="{_n(x)}" y="{_n(y)}" width="{_n(w)}" height="{_n(h)}" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="{_n(width)}" rx="2"{extra}/>'
        )

    def text(
        self,
        x: float,
        y: float,
        s: str,
        *,
        size: float = 13,
        anchor: str = "middle",
        mono: bool = False,
        color: str = "#111827",
        bold: bool = False,
    ) -> None:
        weight = ' font-weight="bold"' if bold else ""
        self._items.append(
            f'<text x="{_n(x)}" y="{_n(y)}" font-family="{MONO if mono else FONT}" '
            f'font-size="{_n(size)}" text-anchor="{anchor}" dominant-baseline="middle" '
            f'fill="{color}"{weight}>{escape(s)}</text>'
        )

    def line(
        self,
        x1: float,
        y1: float,
        x2: float,
        y2: float,
        *,
        color: str = "#374151",
        width: float = 1.2,
        arrow: bool = True,
        dash: bool = False,
    ) -> None:
        head = f' marker-end="url(#head-{color[1:]})"' if arrow else ""
        extra = ' stroke-dasharray="5 3"' if dash else ""
        self._items.append(
            f'<line x1="{_n(x1)}" y1="{_n(y1)}" x2="{_n(x2)}" y2="{_n(y2)}" stroke="{color}" '
            f'stroke-width="{_n(width)}"{head}{extra}/>'
        )

    def polyline(
        self, points: Sequence[tuple[float, float]], *, color: str = "#374151", width: float = 1
    ) -> None:
        """Connected segments ending in an arrowhead."""
        pts = " ".join(f"{_n(x)},{_n(y)}" for x, y in points)
        self._items.append(
            f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="{_n(width)}" '
            f'marker-end="url(#head-{color[1:]})"/>'
        )

    def render(self) -> str:
        colors = sorted({i.split('stroke="')[1][:7] for i in self._items if "marker-end" in i})
        markers = "".join(
            f'<marker id="head-{c[1:]}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
            f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
            f'fill="{c}"/></marker>'
            for c in colors
        )
        w, h = _n(self.width), _n(self.height)
        return "\n".join(
            [
                f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
                f'viewBox="0 0 {w} {h}">',
                f'<defs>{markers}</defs><rect width="100%" height="100%" fill="#ffffff"/>',
                *self._items,
                "</svg>",
                "",
            ]
        )


# -- the block table and the pool --------------------------------------------------


@dataclass(frozen=True)
class SeqView:
    """One sequence as the block manager holds it."""

    label: str
    tokens: tuple[int, ...]
    table: tuple[int, ...]
    drafts: int = 0  # trailing tokens that are drafts in flight (spec.speculative)
    rejected: tuple[int, ...] = ()  # rejected drafts still in the slots past the last token


@dataclass(frozen=True)
class MemoryState:
    """What a picture of the KV memory needs, captured from a :class:`BlockManager`."""

    block_size: int
    ref_counts: tuple[int, ...]  # per physical block
    cached: frozenset[int]  # no holder, content kept for the prefix cache
    sequences: tuple[SeqView, ...]  # the sequences drawn, in order
    copies: tuple[tuple[int, int], ...] = ()  # copy-on-write (src, dst) made this step

    def contents(self, block: int) -> tuple[int, ...]:
        """The tokens a held block stores, read through any table that holds it."""
        b = self.block_size
        for seq in self.sequences:
            if block in seq.table:
                i = seq.table.index(block)
                return seq.tokens[i * b : (i + 1) * b]
        return ()

    def kind(self, block: int) -> str:
        """How the pool draws a block: copy, shared, held, other, cached or free."""
        drawn = any(block in s.table for s in self.sequences)
        if block in {dst for _, dst in self.copies}:
            return "copy"
        if self.ref_counts[block] > 1:
            return "shared"
        if self.ref_counts[block] == 1:
            return "held" if drawn else "other"
        return "cached" if block in self.cached else "free"


def capture(
    manager: BlockManager,
    labels: Mapping[int, str],
    copies: Sequence[tuple[int, int]] = (),
    rejected: Mapping[int, Sequence[int]] | None = None,
) -> MemoryState:
    """Read the state of ``manager`` through its public API; ``labels`` picks the sequences.

    ``copies`` is what :meth:`BlockManager.take_copies` returned for this step;
    ``rejected[seq]`` the rejected drafts whose K/V still sits past its tokens.
    """
    pool = manager.pool
    blocks = range(pool.num_blocks)
    cached = frozenset(
        b for b in blocks if pool.ref_count(b) == 0 and pool.block_hash(b) is not None
    )
    seqs = tuple(
        SeqView(
            label,
            manager.tokens(sid),
            manager.block_table(sid),
            manager.num_drafts(sid),
            tuple((rejected or {}).get(sid, ())),
        )
        for sid, label in labels.items()
    )
    return MemoryState(
        manager.block_size, tuple(pool.ref_count(b) for b in blocks), cached, seqs, tuple(copies)
    )


CELL = 22  # one token slot, when slots are drawn one by one
BAR = 96  # one block as a fill bar, when blocks are large
STRIP = 7  # the height of a large block's fill, under its count
GAP = 10


def _block_width(b: int) -> float:
    return b * CELL if b <= 8 else BAR


def _draw_slots(svg: Svg, x: float, y: float, tokens: Sequence[int], b: int, kind: str) -> None:
    """A block's ``b`` slots: token ids in the filled ones, or a fill bar for large blocks."""
    fill, stroke = COLORS[kind]
    used = b if kind == "other" else len(tokens)  # another sequence's block: drawn full, grey
    if b > 8:  # the count on white above a strip that fills: no edge runs through a digit
        svg.rect(x, y, BAR, CELL, fill="#ffffff", stroke=stroke)
        if used:
            svg.rect(x, y + CELL - STRIP, BAR * used / b, STRIP, fill=fill, stroke=stroke)
        if tokens:
            svg.text(x + BAR / 2, y + (CELL - STRIP) / 2 + 1, f"{len(tokens)}/{b} slots", size=11)
        return
    for i in range(b):
        svg.rect(x + i * CELL, y, CELL, CELL, fill=fill if i < used else "#ffffff", stroke=stroke)
        if i < len(tokens):
            svg.text(x + i * CELL + CELL / 2, y + CELL / 2 + 1, str(tokens[i]), size=11, mono=True)


SEQ_GAP = 40  # between two sequences' columns
LEFT = 60  # the gutter for row labels
ROW = 64  # one row of the pool: labels, slots, room for a copy arrow and routed lines


def _seq_width(seq: SeqView, bw: float) -> float:
    return max(len(seq.table), 1) * (bw + GAP) - GAP


def _memory_size(state: MemoryState, per_row: int, subtitle: str) -> tuple[float, float]:
    bw = _block_width(state.block_size)
    seqs_w = LEFT + sum(_seq_width(s, bw) + SEQ_GAP for s in state.sequences)
    pool_w = LEFT + min(per_row, len(state.ref_counts)) * (bw + GAP)
    rows = -(-len(state.ref_counts) // per_row)
    return max(seqs_w, pool_w) + 10, 30 + 96 + 40 + rows * ROW + 12 + (22 if subtitle else 0)


def _arrow_to_block(
    svg: Svg, x: float, y: float, target: tuple[float, float], first_row_top: float, bw: float
) -> None:
    """From a table entry at (x, y) to a pool block: straight into the first row; into a
    later row down the gap left of the block, so the line never crosses another block."""
    cx, top = target
    if top == first_row_top:
        svg.line(x, y, cx, top - 2, color="#6b7280", width=1)
        return
    gap_x = cx - bw / 2 - GAP / 2
    svg.polyline(
        [(x, y), (x, first_row_top - 8), (gap_x, first_row_top - 8), (gap_x, top - 6),
         (cx, top - 6), (cx, top - 2)],
        color="#6b7280",
    )  # fmt: skip


def _draw_panel(svg: Svg, y0: float, subtitle: str, state: MemoryState, per_row: int) -> None:
    """Sequences side by side (label, positions, token slots, table entries), the pool below."""
    b, bw = state.block_size, _block_width(state.block_size)
    if subtitle:
        svg.text(10, y0 + 10, subtitle, anchor="start", size=14, bold=True)
    top = y0 + (22 if subtitle else 0)  # room for the subtitle
    seq_y, pool_y = top + 48, top + 30 + 96 + 40
    tops: dict[int, tuple[float, float]] = {}  # block -> (x center, top y) in the pool
    for n in range(len(state.ref_counts)):
        row, col = divmod(n, per_row)
        tops[n] = (LEFT + col * (bw + GAP) + bw / 2, pool_y + row * ROW)
    svg.text(10, seq_y + CELL / 2, "tokens", anchor="start", size=11, color="#374151")
    svg.text(10, seq_y + CELL + 17, "table", anchor="start", size=11, color="#374151")
    svg.text(10, pool_y + 14 + CELL / 2, "pool", anchor="start", size=11, color="#374151")
    x0 = float(LEFT)
    for seq in state.sequences:
        svg.text(x0, seq_y - 22, seq.label, anchor="start", size=13, bold=True)
        for j, block in enumerate(seq.table):
            x = x0 + j * (bw + GAP)
            if b <= 8:
                for k in range(min(b, len(seq.tokens) - j * b)):
                    svg.text(
                        x + k * CELL + CELL / 2, seq_y - 7, f"p{j * b + k}", size=9, color="#6b7280"
                    )
            else:
                first, last = j * b, min(len(seq.tokens), (j + 1) * b) - 1
                svg.text(x + bw / 2, seq_y - 7, f"p{first}..p{last}", size=9, color="#6b7280")
            _draw_slots(svg, x, seq_y, seq.tokens[j * b : (j + 1) * b], b, state.kind(block))
            _draw_speculative(svg, x, seq_y, seq, j, b)
            svg.rect(x + bw / 2 - 17, seq_y + CELL + 8, 34, 18, fill="#f9fafb", stroke="#374151")
            svg.text(x + bw / 2, seq_y + CELL + 17, str(block), size=12, mono=True, bold=True)
            _arrow_to_block(svg, x + bw / 2, seq_y + CELL + 26, tops[block], pool_y, bw)
        x0 += _seq_width(seq, bw) + SEQ_GAP
    for block, (cx, top) in tops.items():
        kind = state.kind(block)
        stroke = COLORS[kind][1]
        x = cx - bw / 2
        ref = state.ref_counts[block]
        svg.text(x, top + 6, f"block {block}", anchor="start", size=10, color=stroke)
        if ref:
            svg.text(x + bw, top + 6, f"ref {ref}", anchor="end", size=10, color=stroke, bold=True)
        _draw_slots(svg, x, top + 14, state.contents(block) if ref else (), b, kind)
    for src, dst in state.copies:
        (sx, st), (dx, dt) = tops[src], tops[dst]
        y = st + 14 + CELL + 6
        svg.line(sx, y, dx, dt + 14 + CELL + 6, color="#15803d", width=2, dash=True)
        svg.text((sx + dx) / 2, y + 10, f"copy {src} -> {dst}", size=11, color="#15803d")


def _draw_speculative(svg: Svg, x: float, y: float, seq: SeqView, entry: int, b: int) -> None:
    """Over table entry ``entry``'s slots: its draft tokens, and the rejected K/V past the end."""
    n = len(seq.tokens)
    marks = [(p, seq.tokens[p], "draft") for p in range(n - seq.drafts, n)]
    marks += [(n + i, t, "rejected") for i, t in enumerate(seq.rejected)]
    for pos, token, kind in marks:
        if b > 8 or pos // b != entry:
            continue
        fill, stroke = COLORS[kind]
        cx = x + (pos % b) * CELL
        svg.rect(cx, y, CELL, CELL, fill=fill, stroke=stroke)
        svg.text(cx + CELL / 2, y + CELL / 2 + 1, str(token), size=11, mono=True, color=stroke)


def _legend(svg: Svg, y: float, kinds: Sequence[str]) -> None:
    x = 10.0
    for kind in kinds:
        fill, stroke = COLORS[kind]
        svg.rect(x, y, 14, 14, fill=fill, stroke=stroke)
        svg.text(x + 20, y + 7, LEGEND[kind], anchor="start", size=11)
        x += 30 + 6.2 * len(LEGEND[kind])


def draw_memory(title: str, panels: Sequence[tuple[str, MemoryState]], *, per_row: int = 8) -> str:
    """Panels of :class:`MemoryState`, stacked, under ``title``, with a legend of what appears.

    A panel's subtitle may be empty (a one-panel picture needs none).
    """
    sizes = [_memory_size(state, per_row, subtitle) for subtitle, state in panels]
    width = max(max(w for w, _ in sizes), 560, 20 + 8.6 * len(title))
    height = 34 + sum(h for _, h in sizes) + 30
    svg = Svg(width, height)
    svg.text(10, 16, title, anchor="start", size=15, bold=True)
    y = 34.0
    kinds: set[str] = set()
    for (subtitle, state), (_, h) in zip(panels, sizes, strict=True):
        _draw_panel(svg, y, subtitle, state, per_row)
        kinds |= {state.kind(b) for b in range(len(state.ref_counts))}
        kinds |= {"draft" for s in state.sequences if s.drafts}
        kinds |= {"rejected" for s in state.sequences if s.rejected}
        y += h
    _legend(svg, y + 4, [k for k in COLORS if k in kinds])
    return svg.render()


# -- the scheduler loop ------------------------------------------------------------

STATE_COLORS = {
    "wait": ("#f3f4f6", "#9ca3af"),
    "prefill": ("#fed7aa", "#c2410c"),
    "decode": ("#dbeafe", "#2563eb"),
    "idle": ("#ffffff", "#d1d5db"),
    "preempted": ("#fecaca", "#b91c1c"),
}


@dataclass(frozen=True)
class StepView:
    """One scheduler step: each request's cell, what was admitted and finished, pool use."""

    cells: Mapping[int, tuple[str, str]]  # request id -> (state, label); absent: not there
    admitted: tuple[int, ...]
    finished: tuple[int, ...]
    used_blocks: int


def draw_schedule(
    title: str, requests: Sequence[str], steps: Sequence[StepView], num_blocks: int
) -> str:
    """A grid: rows are requests, columns are steps; the bottom rows count admissions,
    finishes and the blocks in use."""
    cw, ch, left = 66, 30, 130
    width = max(left + len(steps) * cw + 10, 20 + 8.6 * len(title))
    height = 40 + 24 + len(requests) * ch + 3 * 22 + 40
    svg = Svg(width, height)
    svg.text(10, 16, title, anchor="start", size=15, bold=True)
    top = 40 + 24
    for s in range(len(steps)):
        svg.text(left + s * cw + cw / 2, 52, f"step {s}", size=12, bold=True)
    for r, label in enumerate(requests):
        svg.text(10, top + r * ch + ch / 2, label, anchor="start", size=12)
    for s, step in enumerate(steps):
        x = left + s * cw
        for r in range(len(requests)):
            state, text = step.cells.get(r, ("idle", ""))
            fill, stroke = STATE_COLORS[state]
            svg.rect(x + 2, top + r * ch + 2, cw - 4, ch - 4, fill=fill, stroke=stroke)
            if text:
                svg.text(x + cw / 2, top + r * ch + ch / 2, text, size=11)
        y = top + len(requests) * ch + 6
        for i, values in enumerate((step.admitted, step.finished)):
            shown = ", ".join(f"r{v}" for v in values) or "-"
            svg.text(x + cw / 2, y + 11 + i * 22, shown, size=11, color="#374151")
        used = step.used_blocks / num_blocks
        by = y + 2 * 22 + 2
        # The fill has no edge of its own (a dark edge would cut through the label)
        # and is pale enough for the near-black label to read over it.
        svg.rect(x + 6, by, cw - 12, 14, fill="#ffffff", stroke="#ffffff")
        if used:
            svg.rect(x + 6, by, (cw - 12) * used, 14, fill="#bfdbfe", stroke="#bfdbfe")
        svg.rect(x + 6, by, cw - 12, 14, fill="none", stroke="#2563eb")
        svg.text(x + cw / 2, by + 8, f"{step.used_blocks}/{num_blocks}", size=10, color="#111827")
    rows_y = top + len(requests) * ch + 6
    for i, name in enumerate(("admitted", "finished", "blocks used")):
        svg.text(10, rows_y + 11 + i * 22, name, anchor="start", size=12, color="#374151")
    lx = 10.0
    legend = {
        "wait": "waiting",
        "prefill": "prompt (chunk)",
        "decode": "decode",
        "preempted": "preempted",
    }
    for state, label in legend.items():
        fill, stroke = STATE_COLORS[state]
        svg.rect(lx, height - 24, 14, 14, fill=fill, stroke=stroke)
        svg.text(lx + 20, height - 17, label, anchor="start", size=11)
        lx += 40 + 6.2 * len(label)
    return svg.render()
