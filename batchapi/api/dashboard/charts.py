"""Stacked bar charts as inline SVG, drawn on the server: readable with JavaScript off."""

from __future__ import annotations

from html import escape

from markupsafe import Markup

WIDTH, HEIGHT = 720, 240
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 12, 40
COLORS = ("#2563eb", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#0ea5e9", "#84cc16", "#ec4899")


def color_of(index: int) -> str:
    return COLORS[index % len(COLORS)]


def money(value: float) -> str:
    """An amount with up to 8 decimals and no trailing zeros (``0.00002065``, ``1.5``, ``0``)."""
    return f"{value:,.8f}".rstrip("0").rstrip(".")


def stacked_bars(labels: list[str], series: dict[str, list[float]], title: str, unit: str = "",
                 fmt=lambda v: f"{v:,.0f}") -> Markup:
    """One bar per label, one colored segment per series (legend below). ``title`` names the
    chart for screen readers; every segment has a tooltip with its exact value."""
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    top = max(totals, default=0) or 1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = plot_w / max(len(labels), 1)
    bar = max(step * 0.7, 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
             f'class="chart" aria-label="{escape(title)}"><title>{escape(title)}</title>']
    for fraction in (0, 0.5, 1):  # gridlines with their values
        y = TOP + plot_h * (1 - fraction)
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" class="axis">'
                     f'{escape(fmt(top * fraction))}</text>')
    for i, label in enumerate(labels):
        x, y = LEFT + i * step + (step - bar) / 2, TOP + plot_h
        for index, (name, values) in enumerate(series.items()):
            h = plot_h * values[i] / top
            if h <= 0:
                continue
            y -= h
            tip = f"{label} · {name}: {fmt(values[i])}{unit}"
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                         f'fill="{color_of(index)}"><title>{escape(tip)}</title></rect>')
        if len(labels) <= 16 or i % max(len(labels) // 8, 1) == 0:
            parts.append(f'<text x="{x + bar / 2:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle" '
                         f'class="axis">{escape(label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
