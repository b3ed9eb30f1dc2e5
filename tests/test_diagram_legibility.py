"""Labels in the docs' pictures stay legible: dark enough over their fill, and no box edge
runs through them (a fill bar's edge once cut through the scheduler diagram's counts)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from docs_tools.diagrams import DIAGRAMS

NS = "{http://www.w3.org/2000/svg}"


def _luminance(color: str) -> float:
    """WCAG relative luminance of ``#rrggbb``."""
    rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two colours: 1 (none) to 21 (black on white)."""
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _problems(svg: str) -> list[str]:
    rects: list[tuple[float, float, float, float, str, str]] = []
    found = []
    for el in ET.fromstring(svg).iter():
        a = el.attrib
        if el.tag == NS + "rect" and "x" in a:
            x, y, w, h = (float(a[k]) for k in ("x", "y", "width", "height"))
            rects.append((x, y, w, h, a["fill"], a.get("stroke", a["fill"])))
        elif el.tag == NS + "text":
            x, y, size, s = float(a["x"]), float(a["y"]), float(a["font-size"]), el.text or ""
            width = len(s) * size * (0.6 if "mono" in a["font-family"] else 0.55)
            x0 = {"start": x, "middle": x - width / 2}.get(a["text-anchor"], x - width)
            under = [r for r in rects if r[0] <= x <= r[0] + r[2] and r[1] <= y <= r[1] + r[3]]
            fills = [r[4] for r in under if r[4] != "none"]
            if fills and contrast(a["fill"], fills[-1]) < 4.5:
                found.append(f"{s!r}: contrast {contrast(a['fill'], fills[-1]):.1f} on {fills[-1]}")
            for rx, ry, rw, rh, fill, stroke in rects:
                edge_shows = stroke not in (fill, "#ffffff") and ry < y < ry + rh
                for ex in (rx, rx + rw):
                    if edge_shows and x0 + 1 < ex < x0 + width - 1:
                        found.append(f"{s!r}: a box edge at x={ex:g} runs through it")
    return found


@pytest.mark.parametrize("name", ["scheduler-loop", "static-loop", "mixed-step", "latent-block"])
def test_labels_are_legible(name: str) -> None:
    assert _problems(DIAGRAMS[name]()) == []


def test_the_check_sees_an_edge_through_a_label_and_a_pale_label() -> None:
    bad = (
        '<svg xmlns="http://www.w3.org/2000/svg">'
        '<rect x="0" y="0" width="30" height="14" fill="#93c5fd" stroke="#2563eb"/>'
        '<text x="30" y="7" font-family="sans" font-size="10" text-anchor="middle" '
        'fill="#111827">5/10</text>'
        '<rect x="80" y="0" width="40" height="14" fill="#ffffff" stroke="#9ca3af"/>'
        '<text x="100" y="7" font-family="sans" font-size="10" text-anchor="middle" '
        'fill="#e5e7eb">pale</text></svg>'
    )
    assert _problems(bad) == [
        "'5/10': a box edge at x=30 runs through it",
        "'pale': contrast 1.2 on #ffffff",
    ]
