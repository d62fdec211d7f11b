"""The page's plots as data: positioned marks in a fixed viewBox, computed here and drawn as SVG by templates.

Each plot function takes figures (numbers, no storage) and returns a :class:`Chart`: its size, its
accessible label and its marks (:class:`Text`, :class:`Rect`, :class:`Line`, :class:`Dot`,
:class:`Group`) in drawing order, coordinates in SVG user units. Nothing here writes markup: the
template ``charts.html.j2`` draws every mark (its text escaped), so a chart carries no HTML. Styling is
by presentation attributes (fill, stroke), which the page's Content-Security-Policy allows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tasks.report.gather import AuditFigures, GroupRewards, ReportFigures
from tasks.report.off_policy import OffPolicyFigures

MAX_REASONS_SHOWN = 12  # per section of the failure-reasons plot; the rest are summed as "other"
MAX_VERSION_BARS = 40  # weight versions beyond this are bucketed into ranges

BLUE, RED, GREY, TEAL, PURPLE, GREEN = "#2563eb", "#dc2626", "#6b7280", "#0891b2", "#7c3aed", "#16a34a"
INK, GRID, STRIPE, CLIP_BAND = "#111827", "#e5e7eb", "#f9fafb", "#dcfce7"
FONT = "system-ui,-apple-system,Segoe UI,Roboto,sans-serif"


@dataclass(frozen=True)
class Text:
    """A label at (x, y); ``rotate`` turns it by that many degrees around (x, y)."""

    kind: ClassVar[str] = "text"
    x: float
    y: float
    text: str
    anchor: str = "middle"
    size: int = 11
    fill: str = INK
    bold: bool = False
    rotate: int | None = None


@dataclass(frozen=True)
class Rect:
    """A filled rectangle; ``title`` is its tooltip. A negative size is drawn as 0."""

    kind: ClassVar[str] = "rect"
    x: float
    y: float
    width: float
    height: float
    fill: str
    title: str | None = None


@dataclass(frozen=True)
class Line:
    kind: ClassVar[str] = "line"
    x1: float
    y1: float
    x2: float
    y2: float
    stroke: str
    width: float = 1.0
    dash: str | None = None


@dataclass(frozen=True)
class Dot:
    kind: ClassVar[str] = "dot"
    x: float
    y: float
    r: float
    fill: str
    opacity: float | None = None
    title: str | None = None


@dataclass(frozen=True)
class Group:
    """Marks drawn shifted right by ``dx``."""

    kind: ClassVar[str] = "group"
    dx: float
    marks: tuple[Mark, ...]


Mark = Text | Rect | Line | Dot | Group


@dataclass(frozen=True)
class Chart:
    """One plot: a ``width`` × ``height`` viewBox, its label (title and aria-label) and its marks."""

    width: int
    height: int
    label: str
    marks: tuple[Mark, ...]
    font: str = FONT
    fill: str = INK  # of text that names no colour


@dataclass(frozen=True)
class Frame:
    """A plot area inside a ``width`` × ``height`` chart: the margins are left for axes and labels."""

    width: int
    height: int
    left: int = 52
    right: int = 16
    top: int = 26
    bottom: int = 40

    @property
    def x0(self) -> float:
        return float(self.left)

    @property
    def x1(self) -> float:
        return float(self.width - self.right)

    @property
    def y0(self) -> float:  # the baseline (bottom of the plot area)
        return float(self.height - self.bottom)

    @property
    def y1(self) -> float:
        return float(self.top)


@dataclass(frozen=True)
class PageCharts:
    """The page's plots; each is None when its input is absent (no dataset staged, or no audit)."""

    rewards: Chart | None = None
    turns: Chart | None = None
    lengths: Chart | None = None
    reasons: Chart | None = None
    versions: Chart | None = None
    audit: Chart | None = None
    gate: Chart | None = None


def page_charts(figures: ReportFigures) -> PageCharts:
    """Every plot the page shows that its figures allow."""
    profile, metrics = figures.profile, figures.metrics
    charts = PageCharts()
    if profile is not None:
        charts = PageCharts(
            rewards=reward_strip(profile.group_rewards, profile.groups),
            turns=histogram(profile.num_turns, profile.trainable, "turns"),
            lengths=histogram(profile.lengths, profile.trainable, "tokens per row (input_ids)"),
            versions=weight_versions(profile.version_min, profile.version_max),
        )
    if metrics is not None:
        gate = metrics.audit.off_policy if metrics.audit is not None else None
        charts = dataclasses.replace(
            charts,
            reasons=reasons(metrics.invalid_reasons, metrics.failure_reasons),
            audit=audit(metrics.audit) if metrics.audit is not None else None,
            gate=gate_ratios(gate, gate.ratio_bounds((metrics.audit.clip_low, metrics.audit.clip_high)))
            if gate is not None
            else None,
        )
    return charts


# --- the plots ----------------------------------------------------------------------------------


def histogram(values: np.ndarray, trainable: np.ndarray, axis_title: str, *, width: int = 560) -> Chart:
    """Stacked histogram of integer ``values``: trainable rows (blue) under masked rows (red)."""
    label = f"histogram of {axis_title}"
    height = 250
    if not values.size:
        return message(width, height, label, "no rows")
    low, high = int(values.min()), int(values.max())
    bin_width = 1 if high - low < 30 else math.ceil(nice_ticks(0, (high - low + 1) / 30, 1)[-1])
    first = low - low % bin_width
    edges = np.arange(first, high + bin_width + 1, bin_width)
    counts_trainable = np.histogram(values[trainable], edges)[0]
    counts_masked = np.histogram(values[~trainable], edges)[0]
    frame = Frame(width, height, top=30)
    y_ticks = nice_ticks(0, max(1, int((counts_trainable + counts_masked).max())))
    x = scale((float(edges[0]), float(edges[-1])), (frame.x0, frame.x1))
    y = scale((0.0, y_ticks[-1]), (frame.y0, frame.y1))
    marks = y_axis(frame, y_ticks, y, "rows")
    for i, (n_train, n_mask) in enumerate(zip(counts_trainable.tolist(), counts_masked.tolist(), strict=True)):
        left, right = x(edges[i]) + 1, x(edges[i + 1]) - 1
        span = f"{edges[i]}" if bin_width == 1 else f"{edges[i]}–{edges[i + 1] - 1}"
        marks.append(Rect(left, y(n_train), right - left, frame.y0 - y(n_train), BLUE, f"{span}: {n_train} trainable"))
        top = y(n_train + n_mask)
        marks.append(Rect(left, top, right - left, y(n_train) - top, RED, f"{span}: {n_mask} masked"))
    if bin_width == 1:
        step = label_step([str(e) for e in edges[:-1].tolist()], frame.x1 - frame.x0)
        x_ticks = [(e + 0.5, str(e)) for e in edges[:-1:step].tolist()]
    else:
        x_ticks = [(t, tick_label(t)) for t in nice_ticks(float(edges[0]), float(edges[-1]), 6) if t <= edges[-1]]
    for position, text in x_ticks:
        marks.append(Line(x(position), frame.y0, x(position), frame.y0 + 4, GREY))
        marks.append(Text(x(position), frame.y0 + 16, text, fill=GREY))
    marks.append(Line(frame.x0, frame.y0, frame.x1, frame.y0, INK))
    marks.append(Text((frame.x0 + frame.x1) / 2, height - 6, axis_title, fill=GREY))
    marks += legend(frame.x0, 16, [(BLUE, f"trainable ({int(trainable.sum()):,})"), (RED, "masked")])
    return Chart(width, height, label, tuple(marks))


def reward_strip(groups: Sequence[GroupRewards], total_groups: int, *, width: int = 1180) -> Chart:
    """Per group: dots (trainable rows' rewards), crosses (masked rows) and the trainable mean.

    Masked rows without a reward are crosses in a lane under the axis.
    """
    label = "reward per group"
    height = 320
    every = [r for g in groups for r in (*g.trainable, *g.masked) if math.isfinite(r)]
    if not groups:
        return message(width, height, label, "no groups")
    frame = Frame(width, height, bottom=84, top=30)
    y_ticks = nice_ticks(min(every, default=0.0), max(every, default=1.0))
    y = scale((y_ticks[0], y_ticks[-1]), (frame.y0, frame.y1))
    band = (frame.x1 - frame.x0) / len(groups)
    lane = frame.y0 + 14
    marks = y_axis(frame, y_ticks, y, "reward")
    marks.append(Text(frame.x0 - 6, lane + 4, "masked", anchor="end", size=10, fill=RED))
    for i, group in enumerate(groups):
        center = frame.x0 + band * (i + 0.5)
        if i % 2:
            marks.append(Rect(frame.x0 + band * i, frame.y1, band, frame.y0 - frame.y1 + 24, STRIPE))
        finite = [r for r in group.trainable if math.isfinite(r)]
        points = [(y(r), False) for r in finite] + [(y(r), True) for r in group.masked]
        points += [(lane, True)] * group.unrewarded
        for (px, py), masked in swarm(center, band, points):
            marks += cross(px, py) if masked else [Dot(px, py, 3.2, BLUE, opacity=0.75)]
        if finite:
            mean = sum(finite) / len(finite)
            marks.append(Line(center - band * 0.35, y(mean), center + band * 0.35, y(mean), INK, 2.0))
        tick_y = frame.y0 + 34
        marks.append(Text(center, tick_y, group.group_id, anchor="end", fill=GREY, rotate=-45))
    marks.append(Line(frame.x0, frame.y0, frame.x1, frame.y0, INK))
    shown = f"{len(groups)} of {total_groups} groups" if len(groups) < total_groups else f"{total_groups} groups"
    marks.append(Text(frame.x1, 16, shown, anchor="end", fill=GREY))
    marks += legend(frame.x0, 16, [(BLUE, "trainable row"), (RED, "masked row"), (INK, "mean (trainable)")])
    return Chart(width, height, label, tuple(marks))


def reasons(masked: Mapping[str, int], failures: Mapping[str, int], *, width: int = 560) -> Chart:
    """Horizontal bars: masked rollouts by reason, then ledger failure rows by reason."""
    label = "failure reasons"
    sections = [
        (title, color, top_reasons(counts))
        for title, color, counts in (
            ("masked rollouts", RED, masked),
            ("ledger failure rows", PURPLE, failures),
        )
    ]
    if not any(rows for _, _, rows in sections):
        return message(width, 120, label, "no masked rollouts and no failure rows")
    row_height, left = 22, 220
    lines = sum(1 + max(len(rows), 1) for _, _, rows in sections)
    height = 30 + lines * row_height + 28
    largest = max(count for _, _, rows in sections for _, count in rows)
    frame = Frame(width, height, left=left, right=40, top=30, bottom=28)
    x_ticks = nice_ticks(0, largest, 4)
    x = scale((0.0, x_ticks[-1]), (frame.x0, frame.x1))
    marks: list[Mark] = []
    for tick in x_ticks:
        marks.append(Line(x(tick), frame.y1, x(tick), frame.y0, GRID))
        marks.append(Text(x(tick), frame.y0 + 16, tick_label(tick), fill=GREY))
    top = frame.y1
    for title, color, rows in sections:
        marks.append(Text(8, top + 14, title, anchor="start", bold=True))
        top += row_height
        if not rows:
            marks.append(Text(left - 8, top + 14, "none", anchor="end", fill=GREY))
            top += row_height
        for reason, count in rows:
            shown = reason if len(reason) <= 32 else reason[:31] + "…"
            marks.append(Text(left - 8, top + 14, shown, anchor="end"))
            marks.append(Rect(x(0), top + 4, x(count) - x(0), row_height - 8, color, f"{reason}: {count}"))
            marks.append(Text(x(count) + 4, top + 15, f"{count:,}", anchor="start", fill=GREY))
            top += row_height
    marks.append(Line(frame.x0, frame.y1, frame.x0, frame.y0, INK))
    return Chart(width, height, label, tuple(marks))


def weight_versions(
    version_min: Mapping[int | None, int], version_max: Mapping[int | None, int], *, width: int = 560
) -> Chart:
    """Grouped bars per weight version: rows whose min (teal) and max (purple) version it is."""
    label = "rows per weight version"
    height = 250
    if not version_min and not version_max:
        return message(width, height, label, "no rows")
    bars = [
        (name, _rows_between(version_min, low, high), _rows_between(version_max, low, high))
        for name, low, high in version_categories([v for v in (*version_min, *version_max) if v is not None])
    ]
    if None in version_min or None in version_max:
        bars.append(("none", version_min.get(None, 0), version_max.get(None, 0)))
    frame = Frame(width, height, top=30)
    y_ticks = nice_ticks(0, max(1, *(max(b[1], b[2]) for b in bars)))
    y = scale((0.0, y_ticks[-1]), (frame.y0, frame.y1))
    band = (frame.x1 - frame.x0) / len(bars)
    bar = min(28.0, band * 0.38)
    step = label_step([name for name, _, _ in bars], frame.x1 - frame.x0)
    marks = y_axis(frame, y_ticks, y, "rows")
    for i, (name, n_min, n_max) in enumerate(bars):
        center = frame.x0 + band * (i + 0.5)
        marks.append(
            Rect(center - bar - 1, y(n_min), bar, frame.y0 - y(n_min), TEAL, f"version {name}: min of {n_min} rows")
        )
        marks.append(
            Rect(center + 1, y(n_max), bar, frame.y0 - y(n_max), PURPLE, f"version {name}: max of {n_max} rows")
        )
        if i % step == 0:
            marks.append(Text(center, frame.y0 + 16, name, fill=GREY))
    marks.append(Line(frame.x0, frame.y0, frame.x1, frame.y0, INK))
    marks.append(Text((frame.x0 + frame.x1) / 2, height - 6, "weight version", fill=GREY))
    marks += legend(frame.x0, 16, [(TEAL, "weight_version_min"), (PURPLE, "weight_version_max")])
    return Chart(width, height, label, tuple(marks))


def audit(figures: AuditFigures, *, width: int = 1180) -> Chart:
    """Two panels from the audit's statistics: logprob differences (log scale), importance ratios vs the clip."""
    height = 190
    half = width // 2
    differences = _audit_differences(figures, Frame(half - 10, height, left=150, right=24, top=30, bottom=34))
    ratios = _audit_ratios(figures, Frame(half - 10, height, left=120, right=24, top=30, bottom=34))
    return Chart(width, height, "logprob audit", (*differences, Group(half + 10, tuple(ratios))))


def _audit_differences(audit: AuditFigures, frame: Frame) -> list[Mark]:
    rows = [
        ("mean |diff|", audit.mean_abs_diff),
        ("p99 |diff|", audit.p99_abs_diff),
        ("max |diff|", audit.max_abs_diff),
        ("raw mean |diff|", audit.raw_mean_abs_diff),
    ]
    marks: list[Mark] = [Text(frame.x0, 16, "|stored − recomputed| logprob (nats)", anchor="start", bold=True)]
    values = [v for _, v in rows if _is_number(v) and v > 0]
    if not values:
        marks.append(Text((frame.x0 + frame.x1) / 2, frame.height / 2, "no token compared", fill=GREY))
        return marks
    low_exp = max(-12, min(-6, math.floor(math.log10(min(values)))))
    high_exp = max(0, math.ceil(math.log10(max(values))))
    x = scale((float(low_exp), float(high_exp)), (frame.x0, frame.x1))
    for tick in log_ticks(low_exp, high_exp):
        marks.append(Line(x(math.log10(tick)), frame.y1, x(math.log10(tick)), frame.y0, GRID))
        if math.log10(tick).is_integer():
            marks.append(Text(x(math.log10(tick)), frame.y0 + 14, f"{tick:g}", fill=GREY))
    row = (frame.y0 - frame.y1) / len(rows)
    for i, (name, value) in enumerate(rows):
        top = frame.y1 + i * row
        marks.append(Text(frame.x0 - 8, top + row / 2 + 4, name, anchor="end"))
        if _is_number(value):
            end = x(math.log10(value)) if value > 0 else frame.x0
            color = GREY if name.startswith("raw") else BLUE
            marks.append(Rect(frame.x0, top + 5, end - frame.x0, row - 10, color, f"{name}: {value:.3g}"))
            marks.append(Text(end + 4, top + row / 2 + 4, f"{value:.3g}", anchor="start", fill=GREY))
        else:
            marks.append(Text(frame.x0 + 4, top + row / 2 + 4, "—", anchor="start", fill=GREY))
    marks.append(Line(frame.x0, frame.y1, frame.x0, frame.y0, INK))
    return marks


def _audit_ratios(audit: AuditFigures, frame: Frame) -> list[Mark]:
    clip = (audit.clip_low, audit.clip_high)
    rows = [
        ("token ratio", audit.token_ratio_min, audit.token_ratio_mean, audit.token_ratio_max),
        ("sequence ratio", audit.seq_ratio_min, audit.seq_ratio_mean, audit.seq_ratio_max),
    ]
    marks: list[Mark] = [Text(frame.x0, 16, "importance ratio exp(recomputed − stored)", anchor="start", bold=True)]
    values = [v for v in (*clip, *(v for r in rows for v in r[1:])) if _is_number(v) and v > 0]
    if not values:
        marks.append(Text((frame.x0 + frame.x1) / 2, frame.height / 2, "no ratio computed", fill=GREY))
        return marks
    low_exp, high_exp = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    if high_exp == low_exp:
        low_exp, high_exp = low_exp - 1, high_exp + 1
    x = scale((float(low_exp), float(high_exp)), (frame.x0, frame.x1))
    low, high = clip
    if _is_number(low) and _is_number(high) and low > 0 and high > 0:
        left, right = x(math.log10(low)), x(math.log10(high))
        marks.append(Rect(left, frame.y1, right - left, frame.y0 - frame.y1, CLIP_BAND))
        marks.append(Text(left, frame.y0 + 26, f"clip {low:g}", fill=GREEN))
        marks.append(Text(right, frame.y0 + 26, f"clip {high:g}", fill=GREEN))
    for tick in log_ticks(low_exp, high_exp):
        marks.append(Line(x(math.log10(tick)), frame.y1, x(math.log10(tick)), frame.y0, GRID))
        marks.append(Text(x(math.log10(tick)), frame.y0 + 14, f"{tick:g}", fill=GREY))
    marks.append(Line(x(0.0), frame.y1, x(0.0), frame.y0, INK, dash="3 3"))
    row = (frame.y0 - frame.y1) / len(rows)
    for i, (name, low_ratio, mean, high_ratio) in enumerate(rows):
        middle = frame.y1 + (i + 0.5) * row
        marks.append(Text(frame.x0 - 8, middle + 2, name, anchor="end"))
        if not all(_is_number(v) and v > 0 for v in (low_ratio, mean, high_ratio)):
            marks.append(Text(frame.x0 + 4, middle + 4, "—", anchor="start", fill=GREY))
            continue
        a, m, b = (x(math.log10(v)) for v in (low_ratio, mean, high_ratio))
        marks.append(Line(a, middle, b, middle, BLUE, 2.0))
        marks.append(Line(a, middle - 6, a, middle + 6, BLUE, 2.0))
        marks.append(Line(b, middle - 6, b, middle + 6, BLUE, 2.0))
        marks.append(Dot(m, middle, 5, BLUE, title=f"mean {mean:.4g}"))
        spread = f"{low_ratio:.3g} · {mean:.3g} · {high_ratio:.3g}"
        marks.append(Text(frame.x0 - 8, middle + 16, spread, anchor="end", fill=GREY))
    return marks


def gate_ratios(gate: OffPolicyFigures, bounds: tuple[float | None, float | None], *, width: int = 1180) -> Chart:
    """The gate's token ratios on both bases (log scale): p01 to p99, the median (tick) and the mean (dot), against
    ``bounds`` (shaded) and 1 (dashed)."""
    label = "off-policy gate: token ratios, kept set and full vocabulary"
    rows = [("kept set", gate.kept_set, BLUE), ("full vocabulary", gate.full_vocab, PURPLE)]
    height = 150
    frame = Frame(width, height, left=190, right=24, top=30, bottom=34)
    stats = [s for _, s, _ in rows if s is not None]
    values = [
        v
        for v in (
            *bounds,
            *(getattr(s, k) for s in stats for k in ("token_p01", "token_p50", "token_p99", "token_mean")),
        )
        if _is_number(v) and math.isfinite(v) and v > 0
    ]
    if not values:
        return message(width, height, label, "no ratio recorded")
    low_exp, high_exp = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    if high_exp == low_exp:
        low_exp, high_exp = low_exp - 1, high_exp + 1
    x = scale((float(low_exp), float(high_exp)), (frame.x0, frame.x1))

    def at(v: float) -> float:
        return x(math.log10(v))

    marks: list[Mark] = [Text(frame.x0, 16, "trainer ÷ sampler, per token", anchor="start", bold=True)]
    low, high = bounds
    if _is_number(low) and _is_number(high) and 0 < low < high:
        marks.append(Rect(at(low), frame.y1, at(high) - at(low), frame.y0 - frame.y1, CLIP_BAND))
        marks.append(Text(at(low) - 2, frame.y0 + 26, f"bound {low:g}", anchor="end", fill=GREEN))
        marks.append(Text(at(high) + 2, frame.y0 + 26, f"bound {high:g}", anchor="start", fill=GREEN))
    for tick in log_ticks(low_exp, high_exp):
        marks.append(Line(at(tick), frame.y1, at(tick), frame.y0, GRID))
        marks.append(Text(at(tick), frame.y0 + 14, f"{tick:g}", fill=GREY))
    marks.append(Line(x(0.0), frame.y1, x(0.0), frame.y0, INK, dash="3 3"))
    row = (frame.y0 - frame.y1) / len(rows)
    for i, (name, ratios, color) in enumerate(rows):
        middle = frame.y1 + (i + 0.5) * row
        marks.append(Text(frame.x0 - 8, middle + 2, name, anchor="end"))
        points = [getattr(ratios, k, None) for k in ("token_p01", "token_p50", "token_p99", "token_mean")]
        if not all(_is_number(v) and math.isfinite(v) and v > 0 for v in points):
            marks.append(Text(frame.x0 + 4, middle + 4, "—", anchor="start", fill=GREY))
            continue
        p01, p50, p99, mean = points
        marks.append(Line(at(p01), middle, at(p99), middle, color, 2.0))
        marks.append(Line(at(p50), middle - 7, at(p50), middle + 7, color, 2.0))
        marks.append(Dot(at(mean), middle, 5, color, title=f"{name}: mean {mean:.4f}"))
        marks.append(Text(frame.x0 - 8, middle + 16, f"mean {mean:.4f} · p50 {p50:.4f}", anchor="end", fill=GREY))
    return Chart(width, height, label, tuple(marks))


# --- pieces -------------------------------------------------------------------------------------


def message(width: int, height: int, label: str, text: str) -> Chart:
    """A chart that only says ``text`` (a plot with nothing to draw)."""
    return Chart(width, height, label, (Text(width / 2, height / 2, text, size=13, fill=GREY),))


def legend(x: float, y: float, items: Sequence[tuple[str, str]]) -> list[Mark]:
    """A colour swatch and its label per item, left to right from (x, y)."""
    marks: list[Mark] = []
    for color, label in items:
        marks.append(Rect(x, y - 9, 10, 10, color))
        marks.append(Text(x + 14, y, label, anchor="start"))
        x += 24 + 6.5 * len(label)
    return marks


def cross(x: float, y: float) -> list[Mark]:
    """A masked row: a red × centred on (x, y)."""
    return [Line(x - 3, y - 3, x + 3, y + 3, RED, 1.5), Line(x - 3, y + 3, x + 3, y - 3, RED, 1.5)]


def y_axis(frame: Frame, ticks: Sequence[float], y: Callable[[float], float], title: str) -> list[Mark]:
    """Grid lines and labels of ``ticks`` and the axis title, turned upright along the left edge."""
    marks: list[Mark] = []
    for tick in ticks:
        marks.append(Line(frame.x0, y(tick), frame.x1, y(tick), GRID))
        marks.append(Text(frame.x0 - 6, y(tick) + 4, tick_label(tick), anchor="end", fill=GREY))
    marks.append(Text(13, (frame.y0 + frame.y1) / 2, title, fill=GREY, rotate=-90))
    return marks


def swarm(center: float, band: float, points: Sequence[tuple[float, bool]]) -> list[tuple[tuple[float, float], bool]]:
    """Points of one column spread sideways where they would overlap (same pixel row, within 3 px)."""
    rows: dict[int, list[tuple[float, bool]]] = {}
    for py, masked in points:
        rows.setdefault(round(py / 3), []).append((py, masked))
    placed = []
    for members in rows.values():
        gap = min(7.0, band * 0.8 / max(len(members), 1))
        for j, (py, masked) in enumerate(members):
            placed.append(((center + (j - (len(members) - 1) / 2) * gap, py), masked))
    return placed


def top_reasons(counts: Mapping[str, int]) -> list[tuple[str, int]]:
    """Reasons by count (most first); beyond :data:`MAX_REASONS_SHOWN` the rest are one "other" bar."""
    ordered = sorted(((str(k), int(v)) for k, v in counts.items() if v), key=lambda kv: (-kv[1], kv[0]))
    if len(ordered) <= MAX_REASONS_SHOWN:
        return ordered
    rest = ordered[MAX_REASONS_SHOWN - 1 :]
    return [*ordered[: MAX_REASONS_SHOWN - 1], (f"other ({len(rest)} reasons)", sum(c for _, c in rest))]


def version_categories(versions: Sequence[int]) -> list[tuple[str, int, int]]:
    """(label, low, high) per distinct version, or ranges of equal width when there are too many."""
    distinct = sorted(set(versions))
    if len(distinct) <= MAX_VERSION_BARS:
        return [(str(v), v, v) for v in distinct]
    low, high = distinct[0], distinct[-1]
    step = math.ceil((high - low + 1) / MAX_VERSION_BARS)
    starts = sorted({low + (v - low) // step * step for v in distinct})
    return [(f"{s}–{s + step - 1}", s, s + step - 1) for s in starts]


def _rows_between(counts: Mapping[int | None, int], low: int, high: int) -> int:
    return sum(n for v, n in counts.items() if v is not None and low <= v <= high)


def label_step(labels: Sequence[str], width: float) -> int:
    """Label every n-th of ``labels`` spread over ``width`` units so that no two overlap (11 px text)."""
    needed = max((len(label) for label in labels), default=1) * 6.5 + 10
    return max(1, math.ceil(len(labels) * needed / width))


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering ``[low, high]``: about ``count`` steps of 1, 2, 2.5 or 5 × 10^k."""
    if not high > low:
        high = low + 1.0
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def log_ticks(low_exp: int, high_exp: int) -> list[float]:
    """Powers of ten from 10^low_exp to 10^high_exp, with 2 and 5 × 10^k in between when the span is short."""
    ticks = [10.0**k * m for k in range(low_exp, high_exp + 1) for m in (1, 2, 5)]
    ticks = [t for t in ticks if t <= 10.0**high_exp]
    if len(ticks) <= 10:
        return ticks
    return [10.0**k for k in range(low_exp, high_exp + 1, max(1, (high_exp - low_exp) // 8))]


def tick_label(value: float) -> str:
    """A tick value, short: ``2.5``, ``40k``, ``1.2M``."""
    if abs(value) >= 1e6:
        return f"{value / 1e6:g}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


def scale(domain: tuple[float, float], pixels: tuple[float, float]) -> Callable[[float], float]:
    """The linear map from ``domain`` onto ``pixels`` (a zero-width domain maps as if it were 1 wide)."""
    (d0, d1), (p0, p1) = domain, pixels
    span = d1 - d0 or 1.0
    return lambda v: p0 + (v - d0) / span * (p1 - p0)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
