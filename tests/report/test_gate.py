"""The off-policy gate on the overview page (issue 46 item 4): its figures, the token view of the rows it flags,
the links from each flagged figure to those rows, escaping of token text, and fields left absent.

Pages are rendered from hand-made figures following the gate's contract (``audit.off_policy`` in
``dataset/metrics.json``); no batch is built, so these tests take milliseconds.
"""

from __future__ import annotations

import copy
import html.parser
import math
import re
from typing import Any

import pytest

from tasks.report.gather import AuditFigures, BatchMetrics, ReportFigures, SuiteView
from tasks.report.off_policy import GateToken, OffPolicyFigures, token_flags
from tasks.report.render import render_report, token_text

from .batches import report_config
from .test_render import assert_inert

HOSTILE_TOKEN = "</script><img src=x onerror=alert('token')>"
PEERS = ("verl_token_tis_2", "trl_sequence_3", "prime_rl_mask_0.125_8", "areal_token_5", "nemo_rl_seq_mask_tis")


def off_policy() -> dict[str, Any]:
    """A gate output as the contract gives it: two flagged rows (a ratio and stale row, a NaN row)."""
    return {
        "planned_weight_version": 5,
        "tokens": 531,
        "sequences": 8,
        "nan_tokens": 1,
        "missing_mask_tokens": 0,
        "kept_mass_mean": 0.8871,
        "tokens_outside_bound": 3,
        "sequences_outside_bound": 1,
        "ratios": {
            "kept_set": {
                "token_mean": 1.0004,
                "token_p01": 0.9312,
                "token_p50": 1.0001,
                "token_p99": 1.0843,
                "sequence_mean": 1.0123,
                "geometric_mean": 0.9998,
            },
            "full_vocab": {
                "token_mean": 0.8869,
                "token_p01": 0.4125,
                "token_p50": 0.9533,
                "token_p99": 1.0002,
                "sequence_mean": 0.0213,
                "geometric_mean": 0.8612,
            },
        },
        "peers": {name: {"tokens": 0.0125 * (i + 1), "sequences": 0.125 * i} for i, name in enumerate(PEERS)},
        "staleness": {"max": 2, "mean": 0.0414, "tokens_by_versions_behind": {"0": 520, "2": 11}},
        "flagged_rows": [
            {
                "rollout_id": "r000003-01",
                "reasons": ["ratio_outside_bounds", "stale_tokens"],
                "tokens": [
                    {"id": 279, "text": " the", "logprob": -0.2231, "ratio": 1.4, "kept": 12, "version": 3},
                    {"id": 11, "text": "\n", "logprob": -1.1, "ratio": 1.01, "kept": 3, "version": 5},
                ],
            },
            {
                "rollout_id": "r000004-00",
                "reasons": ["nan_logprob"],
                "tokens": [{"id": 7, "text": "7", "logprob": None, "ratio": None, "kept": 40, "version": 5}],
            },
        ],
        "thresholds": {
            "off_policy_max_ratio_deviation": 0.02,
            "off_policy_ratio_bound": 1.25,
            "off_policy_max_outside_rate": 0.01,
            "off_policy_max_staleness": 1,
            "off_policy_min_kept_mass_mean": 0.5,
            "off_policy_peer_share_note": "not a figure",
        },
    }


def figures_with(audit: dict[str, Any] | None, *, staged: bool = True) -> ReportFigures:
    """A staged batch's figures with ``audit`` as its metrics' audit (no dataset parts, no suites run)."""
    return ReportFigures(
        config=report_config(),
        dataset_state="staged" if staged else "not built",
        manifest=None,
        metrics=BatchMetrics.of({"rows": 8, "audit": audit}) if staged else None,
        profile=None,
        suites=(SuiteView("lineage", None), SuiteView("dataset", None)),
    )


def page_of(gate: Any, **audit: Any) -> str:
    return render_report(figures_with({"clip_low": 0.8, "clip_high": 1.25, **audit, "off_policy": gate}))


class Anchors(html.parser.HTMLParser):
    """The ids of a page's elements and the targets of its same-page links."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if named.get("id"):
            self.ids.add(named["id"])
        if tag == "a" and (named.get("href") or "").startswith("#"):
            self.links.append(named["href"][1:])


def element(page: str, tag: str, id_: str) -> str:
    """The markup of ``<tag id="id_">`` up to its closing tag (tables' rows and cards do not nest their own tag)."""
    match = re.search(rf'<{tag} [^>]*id="{id_}"[^>]*>.*?</{tag}>', page, re.S)
    assert match, id_
    return match.group(0)


def test_the_gate_section_shows_both_ratio_bases_kept_mass_peers_staleness_and_counts():
    page = page_of(off_policy())
    gate = element(page, "section", "gate")
    for shown in ("1.0004", "0.9312", "1.0843", "1.0123", "0.8869", "0.4125", "0.0213", "0.8612", "0.8871"):
        assert f">{shown}<" in gate or f"<b>{shown}</b>" in gate, shown
    assert "kept set" in gate and "full vocabulary" in gate and "531 sampled tokens of 8 rows" in gate
    assert all(f"<code>{peer}</code>" in gate for peer in PEERS)
    assert "0.0625" in gate  # the fifth peer's token share
    staleness = element(page, "tr", "gate-staleness")
    assert "2 · 0.0414" in staleness and "0: 520 · 2: 11" in staleness
    assert "fails the batch" in element(page, "tr", "gate-nan") and "fails the batch" not in element(
        page, "tr", "gate-missing-mask"
    )
    assert page.count("<svg") == 3  # failure reasons, the audit's and the gate's ratios (the rest need the parts)


def test_each_threshold_is_judged_by_the_figure_its_name_bounds():
    gate = OffPolicyFigures.of(off_policy())
    judged = {t.name: (t.figure, t.observed, t.breached) for t in gate.thresholds}
    assert judged["off_policy_max_staleness"] == ("staleness_max", 2, True)
    figure, deviation, breached = judged["off_policy_max_ratio_deviation"]  # |mean - 1| and |geometric mean - 1|
    assert figure == "kept_set_mean_deviation" and math.isclose(deviation, 0.0004) and breached is False
    figure, rate, breached = judged["off_policy_max_outside_rate"]
    assert figure == "outside_rate" and math.isclose(rate, 3 / 531) and breached is False
    assert judged["off_policy_ratio_bound"] == ("ratio_bounds", None, None)  # it sets the bounds
    assert judged["off_policy_min_kept_mass_mean"] == ("kept_mass_mean", 0.8871, False)
    assert judged["off_policy_peer_share_note"] == (None, None, None)  # not a figure this page can judge
    assert [t.name for t in gate.breached] == ["off_policy_max_staleness"]
    assert gate.ratio_bounds((0.5, 2.0)) == (0.8, 1.25) and gate.stale_after == 1
    assert OffPolicyFigures.of({}).ratio_bounds((0.5, 2.0)) == (0.5, 2.0) and OffPolicyFigures.of({}).stale_after == 0

    page = page_of(off_policy())
    table = element(page, "section", "gate").split("<h3>Thresholds</h3>")[1].split("</table>")[0]
    assert re.findall(r"<tr(?: class=\"breached\")?><td><code>(.*?)</code>", table) == list(off_policy()["thresholds"])
    assert "1 of 6 threshold(s) breached" in page and "not judged here" in page
    assert "sets the bounds 0.8000 to 1.2500" in page


def test_every_flagged_figure_links_to_its_rows_and_every_link_lands_on_an_anchor():
    page = page_of(off_policy())
    anchors = Anchors(page)
    assert anchors.links and set(anchors.links) <= anchors.ids
    assert {"gate-row-1", "gate-row-2"} <= anchors.ids
    assert '<a href="#gate-row-2">row 2</a>' in element(page, "tr", "gate-nan")
    assert '<a href="#gate-row-1">row 1</a>' in element(page, "tr", "gate-staleness")
    assert '<a href="#gate-row-1">row 1</a>' in element(page, "tr", "gate-outside")
    breached = re.search(r'<tr class="breached">.*?</tr>', page, re.S).group(0)
    assert "off_policy_max_staleness" in breached and 'href="#gate-row-1"' in breached
    # the ratio figures and the peers' shares lead to the row whose ratio is out of bounds
    assert page.count('<a href="#gate-row-1">row 1</a>') >= 2 + len(PEERS)
    assert "#gate-row-2" not in element(page, "tr", "gate-missing-mask")


def test_the_token_view_shows_and_colours_each_sampled_token():
    page = page_of(off_policy())
    first, second = element(page, "div", "gate-row-1"), element(page, "div", "gate-row-2")
    assert "<code>r000003-01</code>" in first and "ratio_outside_bounds" in first and "stale_tokens" in first
    assert (
        '<span class="tok ratio-out stale" title="#1 · id 279 · logprob -0.2231 · ratio 1.4 · kept 12 · version 3">'
        in first
    )
    assert '<span class="tok" title="#2 · id 11 · logprob -1.1 · ratio 1.01 · kept 3 · version 5">⏎</span>' in first
    cells = re.findall(r"<td class=\"([^\"]*)\">([^<]*)</td>", first)
    assert ("num bad", "1.4") in cells and ("num stale", "3") in cells and ("num", "1.01") in cells
    assert '<span class="tok nan no-ratio"' in second and ("num bad", "—") in re.findall(
        r"<td class=\"([^\"]*)\">([^<]*)</td>", second
    )
    assert "<details open>" in first


def test_a_token_that_is_markup_renders_as_inert_text():
    gate = off_policy()
    gate["flagged_rows"][0]["tokens"][0]["text"] = HOSTILE_TOKEN
    gate["flagged_rows"][0]["rollout_id"] = '"><script>alert("rollout")</script>'
    gate["flagged_rows"][1]["reasons"] = ["<svg onload=alert('reason')>"]
    gate["peers"] = {"<b onmouseover=alert('peer')>": {"tokens": 0.5, "sequences": 0.5}}
    gate["thresholds"] = {"max_<i>x</i>": "<script>alert('threshold')</script>"}
    page = page_of(gate)
    assert_inert(page, [HOSTILE_TOKEN, '"><script>alert("rollout")</script>', "<svg onload=alert('reason')>"])
    assert "<script" not in page and "<img" not in page and " style=" not in page
    assert "&lt;/script&gt;&lt;img src=x onerror=alert(&#39;token&#39;)&gt;" in element(page, "div", "gate-row-1")


@pytest.mark.parametrize(
    "change",
    [
        lambda g: g.clear(),
        lambda g: g.update(ratios="none", peers=[1], staleness=3, flagged_rows="x", thresholds=None),
        lambda g: g.update(ratios={"kept_set": None, "full_vocab": {"token_mean": "1"}}, kept_mass_mean=None),
        lambda g: g.update(flagged_rows=[{}, 3, {"reasons": "stale_tokens", "tokens": [{}, "t", {"text": None}]}]),
        lambda g: g.update(staleness={"tokens_by_versions_behind": {"x": 1, "1": "y"}}, nan_tokens=True),
        lambda g: g["ratios"]["kept_set"].update(token_p01=float("nan"), token_p99=None),
        lambda g: [g.pop(key) for key in list(g) if key != "flagged_rows"],
    ],
)
def test_absent_or_malformed_fields_show_nothing_rather_than_fail(change):
    gate = copy.deepcopy(off_policy())
    change(gate)
    page = page_of(gate)
    assert 'id="gate"' in page and set(Anchors(page).links) <= Anchors(page).ids


@pytest.mark.parametrize(
    ("audit", "staged", "note"),
    [
        ({"clip_low": 0.8, "clip_high": 1.25}, True, "this batch&#39;s audit recorded no off-policy figures"),
        ({"clip_low": 0.8, "off_policy": ["not", "an", "object"]}, True, "recorded no off-policy figures"),
        (None, True, "finalize ran without --audit"),
        (None, False, "the dataset has not been staged"),
    ],
)
def test_a_batch_without_the_gate_says_so(audit, staged, note):
    page = render_report(figures_with(audit, staged=staged))
    assert note in element(page, "section", "gate") and 'id="gate-rows"' not in page


def test_token_flags_and_token_text():
    token = GateToken(id=1, text="x", logprob=float("nan"), ratio=0.5, kept=None, version=2)
    assert token_flags(token, bounds=(0.8, 1.25), planned=3, mask_expected=True) == (
        "nan",
        "ratio-out",
        "stale",
        "no-mask",
    )
    assert "stale" not in token_flags(token, bounds=(0.8, 1.25), planned=3, mask_expected=True, stale_after=1)
    assert token_flags(token, bounds=(None, None), planned=None, mask_expected=False) == ("nan",)
    assert token_text("") == "∅" and token_text("a\tb\r\n\x00") == "a⇥b␍⏎\\x00" and token_text(" the") == " the"
    assert token_text(" the", spaces=True) == "␣the"


def test_audit_figures_carry_the_gate_and_only_when_recorded():
    assert AuditFigures.of({"clip_low": 0.5}).off_policy is None
    gate = AuditFigures.of({"off_policy": off_policy()}).off_policy
    assert gate.kept_set.token_mean == 1.0004 and gate.full_vocab.token_mean == 0.8869
    assert [p.name for p in gate.peers] == list(PEERS) and gate.staleness.tokens_by_versions_behind == (
        (0, 520),
        (2, 11),
    )
    assert [(r.number, r.anchor, r.reasons) for r in gate.flagged_rows] == [
        (1, "gate-row-1", ("ratio_outside_bounds", "stale_tokens")),
        (2, "gate-row-2", ("nan_logprob",)),
    ]
    assert gate.reasons == ("ratio_outside_bounds", "stale_tokens", "nan_logprob")
