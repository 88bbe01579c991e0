"""A line plot as a standalone SVG document, written by hand (the project has no plotting dependency on the
Python side; the web app plots with ECharts in the browser). Used by benchmarks to save a figure."""

from __future__ import annotations

import math
from html import escape

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
WIDTH, HEIGHT = 720, 440
LEFT, RIGHT, TOP, BOTTOM = 70, 190, 50, 60


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = min((m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw), default=raw)
    first = math.ceil(low / step) * step
    return [round(first + i * step, 10) for i in range(int((high - first) / step + 1e-9) + 1)]


def line_plot_svg(
    series: dict[str, list[list[float | None]]], *, title: str, x_label: str, y_label: str
) -> str:
    """Series of [x, y] points (points with a None coordinate are skipped) on shared axes, with a legend."""
    points = [(x, y) for data in series.values() for x, y in data if x is not None and y is not None]
    if any(not (math.isfinite(x) and math.isfinite(y)) for x, y in points):
        raise ValueError("plot coordinates must be finite numbers")
    xs, ys = [x for x, _ in points] or [0.0, 1.0], [y for _, y in points] or [0.0, 1.0]
    x_low, x_high = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y_low, y_high = min(0.0, min(ys)), max(1.0, max(ys)) if max(ys) <= 1 else max(ys)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x_low) / (x_high - x_low) * plot_w

    def py(y: float) -> float:
        return TOP + plot_h - (y - y_low) / (y_high - y_low) * plot_h

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>',
    ]
    for tick in _ticks(x_low, x_high):
        parts.append(f'<line x1="{px(tick):.1f}" y1="{TOP}" x2="{px(tick):.1f}" y2="{TOP + plot_h}" stroke="#ddd"/>')
        parts.append(f'<text x="{px(tick):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{tick:g}</text>')
    for tick in _ticks(y_low, y_high):
        parts.append(f'<line x1="{LEFT}" y1="{py(tick):.1f}" x2="{LEFT + plot_w}" y2="{py(tick):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{py(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 18}" text-anchor="middle">{escape(x_label)}</text>')
    parts.append(f'<text x="18" y="{TOP + plot_h / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 18 {TOP + plot_h / 2})">{escape(y_label)}</text>')
    for index, (name, data) in enumerate(series.items()):
        colour = COLOURS[index % len(COLOURS)]
        kept = [(x, y) for x, y in data if x is not None and y is not None]
        if kept:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in kept)
            parts.append(f'<polyline class="series" data-name="{escape(name)}" points="{path}" fill="none" '
                         f'stroke="{colour}" stroke-width="2"/>')
            parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for x, y in kept]
        legend_y = TOP + 10 + 18 * index
        parts.append(f'<line x1="{WIDTH - RIGHT + 12}" y1="{legend_y}" x2="{WIDTH - RIGHT + 32}" y2="{legend_y}" '
                     f'stroke="{colour}" stroke-width="3"/>')
        parts.append(f'<text x="{WIDTH - RIGHT + 38}" y="{legend_y + 4}">{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
