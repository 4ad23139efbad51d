"""Hand-drawn SVG charts and value formatting for the HTML scorecard (`report_html.py`).

The report must open with no network, so there is no chart library: each chart is a small
SVG string built here. Every text that reaches the SVG goes through `markupsafe.escape`
(category names and model labels come from user files). Each drawn value carries
`class="bar"` (or `pt` for a latency point), `data-*` attributes and a `<title>` tooltip, so
the browser test can count one mark per value and a reader can hover for the exact figure.

Models are coloured by their index in `scorecard["models"]` through CSS classes `m0`..`m3`
(base first); the stylesheet in `report_html.css` defines the colours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from markupsafe import Markup, escape

_FONT_PX = 11
_BAR_W = 28          # wide enough for a "100%" label above the bar
_BAR_GAP = 5
_GROUP_PAD = 22
_PLOT_H = 150
_LEFT, _RIGHT, _TOP, _BOTTOM = 46, 10, 18, 34
_MIN_BAR_PX = 1.5    # a zero is drawn as a visible stub on the axis, not as nothing


def fmt_value(value: float | None, unit: str | None, *, compact: bool = False) -> str:
    """A metric value for a reader: ratios as percentages, seconds with `s`, None as `—`."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if unit == "ratio":
        return f"{value * 100:.0f}%" if compact else f"{value * 100:.1f}%"
    if unit == "count":
        return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"
    if unit == "seconds":
        return f"{value:.2f}s" if compact else f"{value:.3f} s"
    if unit == "tokens_per_s":
        return _short(value) if compact else f"{value:,.1f} tok/s"
    if unit == "gib":
        return f"{value:.2f}" if compact else f"{value:.2f} GiB"
    if unit == "nats_per_token":
        return f"{value:.2f}" if compact else f"{value:.3f}"
    return _short(value) if compact else f"{value:.4g}"


def fmt_delta(delta: float | None, unit: str | None) -> str:
    """A signed difference; ratio deltas in percentage points."""
    if delta is None or (isinstance(delta, float) and math.isnan(delta)):
        return "—"
    sign = "+" if delta > 0 else "−" if delta < 0 else "±"
    if unit == "ratio":
        return f"{sign}{abs(delta) * 100:.1f} pp"
    return sign + fmt_value(abs(delta), unit)


def delta_class(delta: float | None, higher_is_better: bool | None) -> str:
    """CSS class of a delta: `good`, `bad` or `same` (direction unknown or no change)."""
    if delta is None or higher_is_better is None or delta == 0:
        return "same"
    return "good" if (delta > 0) == bool(higher_is_better) else "bad"


def _short(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 1e6:
        return f"{value / 1e6:.1f}M"
    if magnitude >= 1e4:
        return f"{value / 1e3:.0f}k"
    if magnitude >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def _ticks(lo: float, hi: float, unit: str | None, intervals: int = 4) -> tuple[float, float, float]:
    """(bottom, top, step) of an axis that holds [lo, hi] in about `intervals` 1/2/2.5/5 x 10^k
    steps (whole steps for counts); ratios in [0, 1] get the full 0..100% axis."""
    if unit == "ratio" and 0 <= lo and hi <= 1:
        return 0.0, 1.0, 0.25
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / intervals
    base = 10 ** math.floor(math.log10(raw))
    multiples = (1, 2, 5, 10) if unit == "count" else (1, 2, 2.5, 5, 10)
    step = next(m * base for m in multiples if m * base >= raw * (1 - 1e-9))
    if unit == "count":
        step = max(step, 1.0)
    bottom, top = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    return bottom, max(top, bottom + step), step


def _truncate(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"


def grouped_bars(*, chart_id: str, title: str, groups: Sequence[tuple[str, int | None, dict]],
                 models: Sequence[str], unit: str | None, filter_set: str | None = None) -> Markup:
    """Vertical grouped bars: one group per category (or field), one bar per model.

    Args:
        groups: (label, n, {model label: value or None}) in drawing order.
        models: every model label, base first; a model absent from a group's values is n/a.
        filter_set: when given, group labels carry data-set/data-category so that a click
            filters the failure browser to that set and category.
    """
    values = [v for _, _, vals in groups for v in vals.values() if v is not None]
    bottom, top, step = _ticks(min([0.0, *values]), max([0.0, *values]), unit)
    span = top - bottom
    group_w = len(models) * (_BAR_W + _BAR_GAP) - _BAR_GAP + _GROUP_PAD
    width = _LEFT + max(1, len(groups)) * group_w + _RIGHT
    height = _TOP + _PLOT_H + _BOTTOM

    def y_of(v: float) -> float:
        return _TOP + _PLOT_H * (top - v) / span

    parts = [f'<svg class="chart" id="{escape(chart_id)}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-labelledby="{escape(chart_id)}-t">',
             f'<title id="{escape(chart_id)}-t">{escape(title)}</title>']
    for i in range(round(span / step) + 1):  # gridlines and y labels
        v = bottom + step * i
        y = y_of(v)
        parts.append(f'<line class="grid" x1="{_LEFT}" x2="{width - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="ylab" x="{_LEFT - 6}" y="{y + 3.5:.1f}">{escape(fmt_value(v, unit, compact=True))}</text>')
    zero_y = y_of(0.0)
    for g, (label, n, vals) in enumerate(groups):
        x0 = _LEFT + g * group_w + _GROUP_PAD / 2
        for m, model in enumerate(models):
            x = x0 + m * (_BAR_W + _BAR_GAP)
            v = vals.get(model)
            tip = f"{label} · {model}: {fmt_value(v, unit)}" + (f" (n={n})" if n is not None else "")
            if v is None:
                parts.append(f'<text class="na" x="{x + _BAR_W / 2:.1f}" y="{zero_y - 4:.1f}">'
                             f'<title>{escape(tip)}</title>n/a</text>')
                continue
            y_top, y_bot = sorted((y_of(v), zero_y))
            h = max(y_bot - y_top, _MIN_BAR_PX)
            if v >= 0:
                y_top = zero_y - h
            parts.append(f'<rect class="bar m{m}" x="{x:.1f}" y="{y_top:.1f}" width="{_BAR_W}" height="{h:.1f}" '
                         f'data-model="{escape(model)}" data-category="{escape(label)}" data-value="{v!r}">'
                         f'<title>{escape(tip)}</title></rect>')
            parts.append(f'<text class="vlab" x="{x + _BAR_W / 2:.1f}" y="{y_top - 3:.1f}">'
                         f'{escape(fmt_value(v, unit, compact=True))}</text>')
        attrs = ""
        if filter_set is not None:
            attrs = f' data-set="{escape(filter_set)}" data-category="{escape(label)}" tabindex="0"'
        caption = _truncate(label, max(6, int(group_w / (_FONT_PX * 0.6))))
        parts.append(f'<text class="xlab{" link" if attrs else ""}" x="{x0 + (group_w - _GROUP_PAD) / 2:.1f}" '
                     f'y="{_TOP + _PLOT_H + 15}"{attrs}><title>{escape(label)}</title>{escape(caption)}</text>')
        if n is not None:
            parts.append(f'<text class="nlab" x="{x0 + (group_w - _GROUP_PAD) / 2:.1f}" '
                         f'y="{_TOP + _PLOT_H + 28}">n={n}</text>')
    parts.append(f'<line class="axis" x1="{_LEFT}" x2="{width - _RIGHT}" y1="{zero_y:.1f}" y2="{zero_y:.1f}"/>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def latency_boxes(*, chart_id: str, rows: Sequence[tuple[str, int, Sequence[float], float | None, float | None]]) -> Markup:
    """One horizontal row per model: every request as a dot, the box (p25..p75, whiskers
    min..max), and p50 / p95 marked and labelled.

    Args:
        rows: (model label, colour index, latencies in seconds, p50, p95); p50/p95 None are
            computed from the latencies.
    """
    row_h, label_w, plot_w, axis_h, top = 46, 120, 640, 30, 8
    width, height = label_w + plot_w + 20, top + max(1, len(rows)) * row_h + axis_h
    all_xs = [x for _, _, xs, _, _ in rows for x in xs if x is not None]
    _, x_max, x_step = _ticks(0.0, max(all_xs, default=0.0), "seconds", intervals=6)

    def x_of(v: float) -> float:
        return label_w + plot_w * v / x_max

    parts = [f'<svg class="chart" id="{escape(chart_id)}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-labelledby="{escape(chart_id)}-t">',
             f'<title id="{escape(chart_id)}-t">Latency per request, by model (seconds)</title>']
    for i in range(round(x_max / x_step) + 1):
        v = x_step * i
        x = x_of(v)
        parts.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{height - axis_h}"/>')
        parts.append(f'<text class="xtick" x="{x:.1f}" y="{height - axis_h + 14}">{escape(fmt_value(v, "seconds", compact=True))}</text>')
    for r, (model, color, latencies, p50, p95) in enumerate(rows):
        mid = top + r * row_h + row_h / 2
        parts.append(f'<text class="rowlab" x="{label_w - 8}" y="{mid + 4:.1f}">{escape(_truncate(model, 18))}'
                     f'<title>{escape(model)}</title></text>')
        xs = sorted(x for x in latencies if x is not None)
        if not xs:
            parts.append(f'<text class="na" x="{label_w + 8}" y="{mid + 4:.1f}" text-anchor="start">no latency recorded</text>')
            continue
        p50 = _quantile(xs, 0.5) if p50 is None else p50
        p95 = _quantile(xs, 0.95) if p95 is None else p95
        q1, q3 = _quantile(xs, 0.25), _quantile(xs, 0.75)
        parts.append(f'<line class="whisker" x1="{x_of(xs[0]):.1f}" x2="{x_of(xs[-1]):.1f}" y1="{mid:.1f}" y2="{mid:.1f}"/>')
        parts.append(f'<rect class="box m{color}" x="{x_of(q1):.1f}" y="{mid - 9:.1f}" '
                     f'width="{max(x_of(q3) - x_of(q1), _MIN_BAR_PX):.1f}" height="18">'
                     f'<title>{escape(model)}: p25 {q1:.3f} s, p75 {q3:.3f} s, min {xs[0]:.3f} s, max {xs[-1]:.3f} s</title></rect>')
        for i, x in enumerate(latencies):
            if x is None:
                continue
            jitter = ((i * 7919) % 13 - 6) * 1.1  # deterministic spread so equal latencies stay visible
            parts.append(f'<circle class="pt m{color}" cx="{x_of(x):.1f}" cy="{mid + jitter:.1f}" r="2.4">'
                         f'<title>{escape(model)}: request {i + 1}, {x:.3f} s</title></circle>')
        for name, v, dy in (("p50", p50, -14), ("p95", p95, 22)):
            parts.append(f'<line class="{name}" x1="{x_of(v):.1f}" x2="{x_of(v):.1f}" y1="{mid - 13:.1f}" y2="{mid + 13:.1f}">'
                         f'<title>{escape(model)}: {name} {v:.3f} s</title></line>')
            parts.append(f'<text class="qlab {name}-lab" x="{x_of(v):.1f}" y="{mid + dy:.1f}">{name} {v:.2f}s</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
