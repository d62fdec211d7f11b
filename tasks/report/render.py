"""The overview page as HTML: Jinja2 templates (``templates/*.html.j2``) rendered from :class:`ReportFigures`.

:func:`render_report` is pure: figures in, page text out. The environment escapes every value it
prints (``autoescape``; the one exception is the style sheet, which is this package's own file), and
an undefined name in a template raises rather than printing nothing. Numbers are formatted by the
filters below; plots are :mod:`tasks.report.charts` drawn by ``charts.html.j2``.

The page needs nothing from the network and nothing but its own bytes: no script, no external
style sheet, font or image. Its only style is one ``<style>`` element (``templates/report.css``),
allowed by hash in the page's own Content-Security-Policy (:data:`CONTENT_SECURITY_POLICY`, which
a server may send as its header too); plots style themselves with SVG presentation attributes and
there are no ``style`` attributes, so the page renders under ``default-src 'none'``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import time
from collections.abc import Iterable
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from tasks import layout
from tasks.report.charts import page_charts
from tasks.report.gather import ReportFigures, Spread
from tasks.report.off_policy import RATIO_STATS, reason_of_figure, token_flags

TEMPLATES = Path(__file__).parent / "templates"
STYLE = (TEMPLATES / "report.css").read_text(encoding="utf-8").strip()
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; "
    f"style-src 'sha256-{base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()}'; "
    "base-uri 'none'; form-action 'none'"
)
MAX_EXAMPLES_SHOWN = 10
MAX_TOKENS_OPEN = 64  # a flagged row's token table is shown open up to this many tokens, folded beyond
VERDICTS = {
    "failed": "validation failed",
    "unreadable": "validation unreadable",
    "not run": "not validated",
    "warned": "passed with warnings",
    "passed": "validation passed",
}


def render_report(figures: ReportFigures) -> str:
    """The whole page for ``figures``: header, headline, validation, off-policy gate, plots, flagged rows, footer."""
    audit = figures.metrics.audit if figures.metrics is not None else None
    gate = audit.off_policy if audit is not None else None
    return (
        environment()
        .get_template("page.html.j2")
        .render(
            figures=figures,
            charts=page_charts(figures),
            audit=audit,
            gate=gate,
            bounds=gate.ratio_bounds((audit.clip_low, audit.clip_high)) if gate is not None else (None, None),
            ratio_stats=RATIO_STATS,
            max_tokens_open=MAX_TOKENS_OPEN,
            verdicts=VERDICTS,
            policy=CONTENT_SECURITY_POLICY,
            style=STYLE,
            reports_dir=layout.REPORTS_DIR,
            max_examples=MAX_EXAMPLES_SHOWN,
        )
    )


@functools.cache
def environment() -> Environment:
    """The templates' environment (built once per process; templates compile on first use)."""
    env = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(
        num=num,
        fixed=fixed,
        coord=coord,
        spread=spread,
        reason_list=reason_list,
        version_range=version_range,
        docs_link=docs_link,
        json_text=json_text,
        utc_minute=utc_minute,
        token_text=token_text,
        token_flags=lambda token, gate, bounds, mask_expected: token_flags(
            token,
            bounds=bounds,
            planned=gate.planned_weight_version,
            mask_expected=mask_expected,
            stale_after=gate.stale_after,
        ),
        figure_reason=reason_of_figure,
    )
    return env


# --- filters: values to text (the environment escapes what they return) ----------------------------


def num(value: object) -> str:
    """A number for people: ints with separators, floats to 4 significant digits, None as a dash."""
    if value is None or isinstance(value, bool):
        return "—" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:.3e}"
    return str(value)


def fixed(value: object, digits: int = 4) -> str:
    """A ratio to ``digits`` decimals (1.0004, not 1), None as a dash; anything not a float as :func:`num` shows it."""
    return f"{value:.{digits}f}" if isinstance(value, float) else num(value)


def coord(value: float, minimum: float | None = None) -> str:
    """An SVG coordinate or length to a tenth of a unit; at least ``minimum`` when given."""
    return f"{value if minimum is None else max(value, minimum):.1f}"


def spread(summary: Spread, what: str) -> str:
    """``± std · min to max · what``, or ``no what`` when nothing was counted."""
    if not summary.count:
        return f"no {what}"
    return f"± {num(summary.std)} · {num(summary.min)} to {num(summary.max)} · {what}"


def reason_list(reasons: dict[str, int], shown: int = 4) -> str:
    """The most frequent reasons with their counts, then how many more there are."""
    ordered = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{reason} {num(count)}" for reason, count in ordered[:shown])
    return text + (f", +{len(ordered) - shown} more" if len(ordered) > shown else "")


def version_range(versions: Iterable[int | str | None]) -> str:
    """``low–high`` of the versions (None left out), or a dash when there is none."""
    numbers = sorted(int(v) for v in versions if v is not None)
    if not numbers:
        return "—"
    return num(numbers[0]) if numbers[0] == numbers[-1] else f"{num(numbers[0])}–{num(numbers[-1])}"


def docs_link(report: str) -> str:
    """The href of a batch-relative Data Docs path from ``reports/index.html`` (never a URL with a scheme)."""
    prefix = f"{layout.REPORTS_DIR}/"
    return report[len(prefix) :] if report.startswith(prefix) else f"../{report}"


def json_text(value: object, limit: int = 160) -> str:
    """A string as it is, anything else as JSON; cut to ``limit`` characters with an ellipsis."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def utc_minute(seconds: float) -> str:
    """Seconds since the epoch as ``2026-05-01 10:00 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))


def token_text(text: str, spaces: bool = False) -> str:
    """A sampled token's text with its invisible characters shown: newline ⏎, tab ⇥, other controls as ``\\xNN``,
    a space as ␣ when ``spaces``, the empty string as ∅ (the environment escapes the result like any other value)."""
    if not text:
        return "∅"
    shown = text.replace("\r", "␍").replace("\n", "⏎").replace("\t", "⇥")
    shown = shown.replace(" ", "␣") if spaces else shown
    return "".join(c if c.isprintable() or c == " " else f"\\x{ord(c):02x}" for c in shown)
