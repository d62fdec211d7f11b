"""The templates escape every value they print: hostile strings in each input that reaches the page stay text.

The page is parsed with :class:`html.parser.HTMLParser` (as a browser tokenizes it): whatever the
inputs, it holds only the elements the templates write, no event-handler attribute and no link
with a scheme, and each hostile string is on the page in its escaped form.
"""

from __future__ import annotations

import dataclasses
import html.parser
from pathlib import Path

import markupsafe
import pytest
from jinja2 import UndefinedError

from tasks.batch import Batch
from tasks.config import ModelSpec
from tasks.plan import plan_batch
from tasks.publish import record_decision
from tasks.records.review import ReviewDecision, new_decision
from tasks.report import write_report_index
from tasks.report.gather import AuditFigures, GroupRewards, gather_report
from tasks.report.render import STYLE, environment, render_report

from .batches import BATCH, expectation, report_config, summary_of, write_summary

PAYLOADS = {
    "environment": "<script>document.title='pwned-environment'</script>",
    "options": "<img src=x onerror=alert('options')>",
    "model": '"><img src=x onerror="alert(1)"><b x="',
    "code_version": "</code></footer><script>alert('code')</script>",
    "reason": "</p><svg onload=alert('reason')>",
    "decided_by": "<iframe src=javascript:alert('by')>",
    "example": "r000001-00<script>alert('example')</script>",
    "error": "</span><img src=x onerror=alert('error')>",
    "threshold": "<script>alert('threshold')</script>",
    "report": 'javascript:alert(1)//"><script>alert("report")</script>',
    "reason_key": "</text><script>alert('reason key')</script>",
    "audit_model": "</code><style>*{display:none}</style>",
    "group": "g1</text><foreignObject><script>alert('group')</script></foreignObject>",
}
ELEMENTS = {
    *("html", "head", "meta", "title", "style", "body", "header", "main", "section", "footer", "h1", "h2", "h3"),
    *("p", "div", "span", "b", "br", "code", "a", "table", "thead", "tbody", "tr", "th", "td", "details", "summary"),
    *("figure", "figcaption", "svg", "g", "text", "rect", "line", "circle"),
}


class Tags(html.parser.HTMLParser):
    """The start tags of a page, with their attributes, and the text of its ``<style>`` elements."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.styles: list[str] = []
        self.in_style = False
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self.in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self.in_style = False

    def handle_data(self, data: str) -> None:
        if self.in_style:
            self.styles.append(data)


def assert_inert(page: str, payloads: list[str]) -> None:
    """Only the templates' own elements, no handler attribute, relative links, each payload escaped."""
    tags = Tags(page)
    assert {tag for tag, _ in tags.tags} <= ELEMENTS
    assert not [(tag, name) for tag, attrs in tags.tags for name in attrs if name.startswith("on")]
    hrefs = [attrs["href"] for tag, attrs in tags.tags if "href" in attrs]
    assert not [href for href in hrefs if ":" in href.split("/", 1)[0]], hrefs
    assert tags.styles == [STYLE]
    for payload in payloads:
        assert payload not in page and str(markupsafe.escape(payload)) in page, payload


def hostile_figures(root: Path):
    """The real batch's figures with a payload in every string a person or a file can put there."""
    figures = gather_report(Batch.open(str(root), BATCH))
    config = dataclasses.replace(
        figures.config,
        environment=PAYLOADS["environment"],
        environment_options={PAYLOADS["options"]: PAYLOADS["options"]},
        model=ModelSpec(reference=PAYLOADS["model"]),
        code_version=PAYLOADS["code_version"],
    )
    review = ReviewDecision(
        batch_id=BATCH,
        choice="reject",
        reason=PAYLOADS["reason"],
        decided_by=PAYLOADS["decided_by"],
        decided_at=1764628000.0,
        via="airflow",
    )
    failing = expectation(
        "lengths_equal",
        success=False,
        examples=[PAYLOADS["example"]] * 12,
        error=PAYLOADS["error"],
        threshold=[PAYLOADS["threshold"]],
    )
    summary = dataclasses.replace(summary_of("dataset", [failing]), report=PAYLOADS["report"])
    dataset = dataclasses.replace(figures.suites[1], summary=summary, docs=True, pages=(("rows", PAYLOADS["report"]),))
    metrics = dataclasses.replace(
        figures.metrics,
        invalid_reasons={PAYLOADS["reason_key"]: 3},
        failure_reasons={PAYLOADS["reason_key"]: 2},
        audit=AuditFigures(model_path=PAYLOADS["audit_model"], mean_abs_diff=0.01, clip_low=0.5, clip_high=2.0),
    )
    groups = (GroupRewards(PAYLOADS["group"], (1.0,), (), 0),)
    profile = dataclasses.replace(figures.profile, group_rewards=groups)
    return dataclasses.replace(
        figures,
        config=config,
        review=review,
        suites=(figures.suites[0], dataset),
        metrics=metrics,
        profile=profile,
    )


def test_hostile_strings_in_every_input_are_escaped_text(root):
    page = render_report(hostile_figures(root))
    shown = [p for name, p in PAYLOADS.items() if name != "options"]  # the page does not show environment options
    assert_inert(page, shown)
    assert PAYLOADS["options"] not in page and page.count("<script") == 0 and page.count("<svg") == 6


def test_a_batch_planned_and_decided_with_hostile_strings_writes_an_inert_page(tmp_path):
    config = report_config(model=ModelSpec(reference=PAYLOADS["model"]))
    plan_batch(Batch.open(str(tmp_path), config.batch_id), config)
    write_summary(tmp_path, "lineage", [expectation("call_ids_unique", success=False, examples=[PAYLOADS["example"]])])
    decision = new_decision(BATCH, "reject", PAYLOADS["reason"], decided_by=PAYLOADS["decided_by"], via="airflow")
    record_decision(Batch.open(str(tmp_path), BATCH), decision)
    page = (tmp_path / "batches" / BATCH / write_report_index(Batch.open(str(tmp_path), BATCH))).read_text(
        encoding="utf-8"
    )
    assert_inert(page, [PAYLOADS[name] for name in ("model", "example", "reason", "decided_by")])
    assert "rejected" in page


def test_the_style_sheet_the_page_holds_unescaped_cannot_close_its_element():
    assert STYLE.startswith("*{box-sizing:border-box}") and "</" not in STYLE


def test_a_template_naming_what_it_was_not_given_raises():
    with pytest.raises(UndefinedError):
        environment().from_string("{{ figures.config.nothing }}").render(figures=object())
