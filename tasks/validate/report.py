"""The batch's overview page, ``reports/index.html`` (ARCHITECTURE section 2; issue 10, item 4).

One self-contained HTML page that people look at before a dataset goes to training: the batch's
headline numbers, pass / warn / fail of each validation suite's current run with a link to
its Data Docs (``lineage/run-NNN/index.html``, relative to the page) and the expectations
that failed or warned with their examples, and plots drawn here as inline SVG: rewards per
group, turns and sequence lengths, failure reasons, weight-version spread and the logprob
audit's differences. A suite that has not run, or a dataset not built yet, shows as "not run".

Reading and rendering are split. :func:`read_report_inputs` reads the batch config, the dataset
manifest (``dataset/_COMMITTED.json`` once published, else finalize's ``dataset/_STAGED.json``),
``dataset/metrics.json``, a per-row profile of the parts (scalar columns and list lengths from
Arrow; token lists never become Python objects; one part in memory at a time), each suite's
current summary (:func:`tasks.validate.read_suite_summary`: ``reports/{suite}/run-NNN/summary.json``)
and the review decision (``reports/review.json``), which the header states.
:func:`render_report` and the ``*_svg`` functions are pure: data in, HTML or SVG text out.
Every interpolated string goes through :func:`html.escape`.

The page needs nothing from the network and nothing but its own bytes: no script, no external
style sheet, font or image. Its only style is one ``<style>`` element, allowed by hash in the
page's own Content-Security-Policy (:data:`CONTENT_SECURITY_POLICY`, which a server may send as
its header); plots style themselves with SVG presentation attributes and there are no
``style`` attributes, so the page renders under ``default-src 'none'``.

Re-runs. The page changes after each validation run, but objects on the batch's storage are
created once. :func:`write_report_index` therefore writes the page twice: create-once under its
content address, ``reports/index-<sha256[:16]>.html`` (an immutable record of every distinct page
shown; a re-run that renders the same bytes is a no-op, since the page holds no clock time),
then the same bytes to ``reports/index.html``, the one object of the batch that is replaced:
atomically (:meth:`ObjectStore.replace`: a temp file, fsync and a rename on local disk; a single
whole-object PUT on S3), so a reader sees the old page or the new one, never a torn one. No stage
reads the page. Two runs racing leave the page of whichever replaced last; both versions stay.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks import layout
from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.errors import MalformedReviewError
from tasks.layout import REVIEW_RECORD
from tasks.records.review import ReviewDecision
from tasks.records.suite_summary import LINEAGE, SUITES, ExpectationOutcome, SuiteSummary
from tasks.storage.dataset_manifest import DatasetMarker, read_dataset_part
from tasks.storage.marker import read_marked_bytes
from tasks.storage.objects import ObjectStore, sha256_hex
from tasks.strict_json import parse_json
from tasks.validate.suites import DATASET_TABLES, LINEAGE_TABLES

INDEX = layout.REPORTS_INDEX
MAX_GROUPS_SHOWN = 48  # the reward plot draws an evenly spaced sample of groups beyond this
MAX_REASONS_SHOWN = 12  # per section of the failure-reasons plot; the rest are summed as "other"
MAX_VERSION_BARS = 40  # weight versions beyond this are bucketed into ranges
MAX_EXAMPLES_SHOWN = 10

# Colours (SVG presentation attributes and the style sheet).
BLUE, RED, GREY, TEAL, PURPLE, GREEN = "#2563eb", "#dc2626", "#6b7280", "#0891b2", "#7c3aed", "#16a34a"
INK, GRID = "#111827", "#e5e7eb"

_STYLE = """
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#111827;background:#f3f4f6}
header{background:#111827;color:#f9fafb;padding:18px 32px}
header h1{margin:0 0 6px;font-size:22px;overflow-wrap:anywhere}
header p{margin:4px 0 0;color:#d1d5db}
header code{background:#374151;color:#f9fafb}
main,footer{max-width:1280px;margin:0 auto;padding:4px 24px 16px}
h2{font-size:17px;margin:22px 0 10px}
h3{font-size:15px;margin:0 0 6px}
a{color:#1d4ed8}
.badge{display:inline-block;padding:1px 10px;border-radius:999px;font-size:12px;font-weight:600;color:#fff;
background:#6b7280;vertical-align:2px}
.passed,.published,.approved{background:#15803d}.warned,.staged,.partial,.awaiting-review{background:#b45309}
.failed,.unreadable,.rejected{background:#b91c1c}
.tiles{display:grid;grid-template-columns:repeat(4,minmax(0,1fr));gap:10px}
.tile,.card,figure{background:#fff;border:1px solid #e5e7eb;border-radius:8px}
.tile{padding:10px 12px}
.label{font-size:11px;color:#6b7280;text-transform:uppercase;letter-spacing:.04em}
.value{font-size:21px;font-weight:600;overflow-wrap:anywhere}
.note{font-size:12px;color:#4b5563;overflow-wrap:anywhere}
.suites{display:grid;grid-template-columns:1fr 1fr;gap:12px;margin-bottom:12px}
.card{padding:12px 16px}
.card p{margin:4px 0}
table{border-collapse:collapse;width:100%;background:#fff;font-size:13px}
th,td{border-bottom:1px solid #e5e7eb;padding:5px 8px;text-align:left;vertical-align:top}
th{background:#f9fafb;font-weight:600}
table.facts th{white-space:nowrap}
td.num{text-align:right;font-variant-numeric:tabular-nums}
code{font:12px ui-monospace,Menlo,Consolas,monospace;background:#f3f4f6;padding:1px 4px;border-radius:4px;
overflow-wrap:anywhere}
details{margin:8px 0}
summary{cursor:pointer;color:#1d4ed8}
.plots{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:12px}
figure{margin:0;padding:12px}
figure.wide{grid-column:1/-1}
figcaption{font-weight:600;margin-bottom:6px}
svg{display:block;width:100%;height:auto}
.muted{color:#6b7280}
.notrun{color:#6b7280;font-style:italic;padding:28px 0;text-align:center}
""".strip()

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; "
    f"style-src 'sha256-{base64.b64encode(hashlib.sha256(_STYLE.encode()).digest()).decode()}'; "
    "base-uri 'none'; form-action 'none'"
)


# --- what the page is rendered from --------------------------------------------------------


@dataclass(frozen=True)
class GroupRewards:
    """The rewards of one group's rows: trainable ones, masked ones that have a reward, masked ones without."""

    group_id: str
    trainable: tuple[float, ...]
    masked: tuple[float, ...]
    unrewarded: int

    @classmethod
    def of(cls, group_id: str, rows: Sequence[tuple[float, bool]]) -> GroupRewards:
        """From ``(reward, trainable)`` per row; a missing reward is NaN."""
        masked = [reward for reward, trainable in rows if not trainable]
        return cls(
            group_id=group_id,
            trainable=tuple(reward for reward, trainable in rows if trainable),
            masked=tuple(reward for reward in masked if math.isfinite(reward)),
            unrewarded=sum(not math.isfinite(reward) for reward in masked),
        )


@dataclass(frozen=True)
class DatasetProfile:
    """Per-row scalars of the dataset's parts (no tokens), in row order, plus counts.

    ``group_rewards`` holds every group, or an evenly spaced sample of :data:`MAX_GROUPS_SHOWN`
    of the ``groups``. ``version_min``/``version_max`` count rows per weight version (None: a
    masked row without linearized calls); ``spanning_rows`` have min != max.
    """

    rows: int
    groups: int
    trainable: np.ndarray  # bool
    num_turns: np.ndarray  # int
    lengths: np.ndarray  # int: len(input_ids)
    group_rewards: tuple[GroupRewards, ...]
    version_min: Mapping[int | None, int]
    version_max: Mapping[int | None, int]
    spanning_rows: int


@dataclass(frozen=True)
class SuiteView:
    """A suite's current summary (None: not run), why it could not be read, and whether its Data Docs exist.

    ``pages``: (table, batch-relative path) of the run's validation result pages, in the suite's
    table order. Linked from the card as well as from the Data Docs index, whose list of them is
    drawn by scripts from public CDNs and stays empty offline.
    """

    suite: str
    summary: SuiteSummary | None
    error: str | None = None
    docs: bool = False
    pages: tuple[tuple[str, str], ...] = ()

    @property
    def status(self) -> str:
        """``passed``, ``warned``, ``failed``, ``not run`` or ``unreadable``."""
        if self.error is not None:
            return "unreadable"
        return "not run" if self.summary is None else self.summary.status


@dataclass(frozen=True)
class ReportInputs:
    """Everything the page shows; ``dataset_state`` is one of :data:`DATASET_STATES`.

    ``review`` is the decision, or the error that makes its record unreadable, or None.
    """

    config: BatchConfig
    dataset_state: str
    manifest: DatasetMarker | None
    metrics: Mapping[str, Any] | None
    profile: DatasetProfile | None
    suites: tuple[SuiteView, ...]
    review: ReviewDecision | str | None = None


DATASET_STATES = ("published", "rejected", "approved", "awaiting review", "staged", "not built")


# --- reading and writing ----------------------------------------------------------------------


def write_report_index(batch: Batch) -> str:
    """Render the batch's overview page and write it (see the module docstring); returns ``reports/index.html``."""
    store = batch.store
    page = render_report(read_report_inputs(batch)).encode("utf-8")
    store.write_once(f"{layout.REPORTS_DIR}/index-{sha256_hex(page)[:16]}.html", page)
    store.replace(INDEX, page)
    return INDEX


def read_report_inputs(batch: Batch) -> ReportInputs:
    """What the page shows, read from ``batch``; absent inputs are None."""
    store, config = batch.store, batch.config
    published = batch.published_dataset()
    manifest = published if published is not None else batch.staged_dataset()
    suites = tuple(read_suite_view(batch, suite) for suite in SUITES)
    review: ReviewDecision | str | None
    try:
        review = batch.review()
    except MalformedReviewError as exc:
        review = str(exc)
    return ReportInputs(
        config=config,
        dataset_state=dataset_state(published is not None, manifest is not None, review, suites),
        manifest=manifest,
        metrics=read_metrics(store, manifest) if manifest is not None else None,
        profile=read_dataset_profile(store, manifest) if manifest is not None else None,
        suites=suites,
        review=review,
    )


def dataset_state(
    published: bool, staged: bool, review: ReviewDecision | str | None, suites: Sequence[SuiteView]
) -> str:
    """Published; else rejected or approved by the decision; else awaiting review (a suite warned, none failed)."""
    if published:
        return "published"
    if isinstance(review, ReviewDecision):
        return "approved" if review.approved else "rejected"
    if not staged:
        return "not built"
    statuses = {view.status for view in suites}
    return "awaiting review" if statuses <= {"passed", "warned"} and "warned" in statuses else "staged"


def read_metrics(store: ObjectStore, manifest: DatasetMarker) -> dict[str, Any]:
    """``dataset/metrics.json`` as the manifest names it (size and sha256 checked)."""
    data = read_marked_bytes(store, manifest.metrics, marker="the dataset marker")
    return parse_json(data, source=f"{store.url}/{manifest.metrics.path}")


def read_dataset_profile(store: ObjectStore, manifest: DatasetMarker) -> DatasetProfile:
    """The per-row scalars of every part the manifest names, one part at a time."""
    stride = max(1, math.ceil(manifest.groups / MAX_GROUPS_SHOWN))
    trainable, turns, lengths = [], [], []
    rewards: dict[str, list[tuple[float, bool]]] = {}
    version_min: Counter[int | None] = Counter()
    version_max: Counter[int | None] = Counter()
    spanning, groups_seen, last_group = 0, 0, None
    for part in manifest.parts:
        table = read_dataset_part(store, part)
        if not table.num_rows:
            continue
        group_ids = table.column("group_id").to_numpy(zero_copy_only=False)
        starts = np.ones(table.num_rows, bool)
        starts[1:] = group_ids[1:] != group_ids[:-1]
        starts[0] = group_ids[0] != last_group
        group_index = groups_seen - 1 + np.cumsum(starts)
        groups_seen, last_group = int(group_index[-1]) + 1, group_ids[-1]
        is_trainable = table.column("sample_mask").to_numpy() == 1
        reward = table.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)
        for row in np.flatnonzero(group_index % stride == 0).tolist():
            rewards.setdefault(str(group_ids[row]), []).append((float(reward[row]), bool(is_trainable[row])))
        trainable.append(is_trainable)
        turns.append(table.column("num_turns").to_numpy())
        lengths.append(pc.list_value_length(table.column("input_ids")).to_numpy())
        low, high = table.column("weight_version_min"), table.column("weight_version_max")
        version_min.update(_value_counts(low))
        version_max.update(_value_counts(high))
        spanning += pc.sum(pc.not_equal(low, high), min_count=0).as_py()
    return DatasetProfile(
        rows=manifest.rows,
        groups=manifest.groups,
        trainable=np.concatenate(trainable) if trainable else np.zeros(0, bool),
        num_turns=np.concatenate(turns) if turns else np.zeros(0, np.int64),
        lengths=np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
        group_rewards=tuple(GroupRewards.of(group_id, rows) for group_id, rows in rewards.items()),
        version_min=dict(version_min),
        version_max=dict(version_max),
        spanning_rows=spanning,
    )


def read_suite_view(batch: Batch, suite: str) -> SuiteView:
    """The summary of ``suite``'s current run (None when none completed), or why it cannot be read."""
    store = batch.store
    try:
        summary = batch.suite_summary(suite)
    except ValueError as exc:  # MalformedSummaryError, or JSON that does not parse
        return SuiteView(suite, None, error=str(exc))
    if summary is None:
        return SuiteView(suite, None)
    try:
        docs = store.exists(summary.report)
    except ValueError:  # not a batch-relative path
        return SuiteView(suite, summary)
    return SuiteView(suite, summary, docs=docs, pages=_validation_pages(store, suite, summary.report) if docs else ())


def _validation_pages(store: ObjectStore, suite: str, report: str) -> tuple[tuple[str, str], ...]:
    """The validation result pages beside the Data Docs index ``report``: ``validations/.../{suite}-{table}.html``."""
    found = {}
    for path in store.list_files(f"{report.rsplit('/', 1)[0]}/validations"):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(f"{suite}-") and name.endswith(".html"):
            found[name.removeprefix(f"{suite}-").removesuffix(".html")] = path
    tables = LINEAGE_TABLES if suite == LINEAGE else DATASET_TABLES
    return tuple((table.name, found[table.name]) for table in tables if table.name in found)


def _value_counts(column: pa.ChunkedArray) -> dict[int | None, int]:
    counts = pc.value_counts(column).to_pylist()
    return {c["values"]: c["counts"] for c in counts}


# --- the page ---------------------------------------------------------------------------------


def render_report(inputs: ReportInputs) -> str:
    """The whole page for ``inputs``: headline, validation, plots."""
    config = inputs.config
    title = f"Batch {config.batch_id}"
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{_e(CONTENT_SECURITY_POLICY)}">',
            '<meta name="referrer" content="no-referrer">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{_e(title)} · rollout-ledger</title>",
            f"<style>{_STYLE}</style>",
            "</head>",
            "<body>",
            render_header(inputs),
            "<main>",
            render_headline(inputs),
            render_validation(inputs.suites),
            render_plots(inputs),
            "</main>",
            render_footer(inputs),
            "</body>",
            "</html>",
            "",
        ]
    )


VERDICTS = {
    "failed": "validation failed",
    "unreadable": "validation unreadable",
    "not run": "not validated",
    "warned": "passed with warnings",
    "passed": "validation passed",
}


def overall_status(suites: Sequence[SuiteView]) -> str:
    """The worst suite status: failed, unreadable, not run, warned, passed (in that order)."""
    statuses = {s.status for s in suites}
    return next(status for status in VERDICTS if status in statuses or status == "passed")


def render_header(inputs: ReportInputs) -> str:
    """Batch id, the overall verdict, the dataset's state and what the batch ran."""
    config, manifest = inputs.config, inputs.manifest
    verdict = overall_status(inputs.suites)
    badges = [_badge(verdict, VERDICTS[verdict]), _badge(inputs.dataset_state.replace(" ", "-"), inputs.dataset_state)]
    if manifest is not None and manifest.partial:
        badges.append(_badge("partial", f"partial: missing shard(s) {', '.join(map(str, manifest.missing_shards))}"))
    sampling = config.sampling
    facts = [
        f"environment <code>{_e(config.environment)}</code>",
        f"model <code>{_e(config.model.reference)}</code>",
        f"{_num(config.num_tasks)} tasks × {_num(config.group_size)} in {_num(config.shards)} shard(s)",
        f"advantage {_e(config.advantage)}, on_invalid {_e(config.on_invalid)}",
        f"temperature {_num(sampling.temperature)}, top_p {_num(sampling.top_p)}, "
        f"max_tokens {_num(sampling.max_tokens)}",
    ]
    review = inputs.review
    decision = ""
    if isinstance(review, ReviewDecision):
        decision = f"<p>Review: {_e(review.describe())}</p>"
    elif review is not None:
        decision = f"<p>Review: the record is unreadable: {_e(review)}</p>"
    return (
        f"<header><h1>{_e('Batch ' + config.batch_id)} {' '.join(badges)}</h1><p>{' · '.join(facts)}</p>"
        f"{decision}</header>"
    )


def render_headline(inputs: ReportInputs) -> str:
    """Tiles of the batch's headline numbers; those the dataset gives say "not run" before it is built."""
    config, metrics = inputs.config, inputs.metrics
    planned = config.num_rollouts
    tiles = [_tile("Rollouts planned", _num(planned), f"{_num(config.num_tasks)} tasks × {_num(config.group_size)}")]
    if metrics is None:
        tiles += [
            _tile(label, "not run", "no staged dataset yet") for label in ("Receipted", "Trainable rows", "Masked rows")
        ]
    else:
        m = metrics
        tiles += [
            _tile("Receipted", _num(m.get("receipts")), f"{_num(m.get('missing_receipts'))} missing receipts"),
            _tile(
                "Trainable rows",
                _num(m.get("trainable_rows")),
                f"of {_num(m.get('rows'))} rows · {_num(m.get('groups'))} groups",
            ),
            _tile(
                "Masked rows",
                _num(m.get("masked_rows")),
                _reason_list(m.get("invalid_reasons")) or "none masked",
            ),
            _tile("Mean reward", _num(_get(m, "reward", "mean")), _spread(m.get("reward"), "trainable rows")),
            _tile(
                "Tokens",
                _num(m.get("tokens")),
                f"{_num(m.get('sampled_tokens'))} sampled (trainable) · mean row {_num(_get(m, 'row_length', 'mean'))}",
            ),
            _tile("Turns per rollout", _num(_get(m, "turns", "mean")), _spread(m.get("turns"), "trainable rows")),
            _tile(
                "Weight versions",
                _version_range([*inputs.profile.version_min, *inputs.profile.version_max] if inputs.profile else []),
                f"of the rows · groups {_version_range(m.get('group_weight_versions') or {})} · planned start "
                f"{_num(config.weight_version)} · {_num(m.get('epoch_span_count'))} calls spanned a refit",
            ),
            _tile(
                "Groups",
                _num(m.get("groups")),
                f"{_num(m.get('groups_zero_variance'))} zero variance · {_num(m.get('groups_single_valid'))} "
                f"single valid · {_num(m.get('groups_dropped'))} dropped",
            ),
            _tile(
                "Calls per rollout",
                _num(m.get("calls_per_rollout")),
                f"{_num(m.get('ledger_calls'))} calls · token-in rate {_num(m.get('token_in_rate'))} · "
                f"truncated rate {_num(m.get('truncated_rate'))}",
            ),
        ]
    manifest = inputs.manifest
    if manifest is None:
        tiles.append(_tile("Dataset", "not run", "finalize has not staged it"))
    else:
        shards = config.shards - len(manifest.missing_shards)
        tiles.append(
            _tile(
                "Dataset",
                "partial" if manifest.partial else "complete",
                f"{_e(inputs.dataset_state)} · {_num(shards)} of {_num(config.shards)} shard(s) · "
                f"{_num(manifest.rows)} rows",
            )
        )
    tiles.append(_tile("Model", _e(config.model.reference), _model_note(config)))
    return f'<section><h2>Headline</h2><div class="tiles">{"".join(tiles)}</div></section>'


def render_validation(suites: Sequence[SuiteView]) -> str:
    """A card per suite (status, counts, link to its Data Docs), then the expectations that failed or warned."""
    cards = "".join(_suite_card(view) for view in suites)
    problems = [
        (view.suite, outcome)
        for view in suites
        if view.summary is not None
        for outcome in view.summary.expectations
        if not outcome.success
    ]
    problems.sort(key=lambda p: (p[1].severity != "fail", p[0], p[1].name))
    if problems:
        rows = "".join(_problem_row(suite, outcome) for suite, outcome in problems)
        table = (
            "<h3>Expectations that failed or warned</h3><table><thead><tr><th>Suite</th><th>Expectation</th>"
            "<th>Severity</th><th>Observed</th><th>Threshold</th><th>Unexpected</th><th>Examples</th></tr>"
            f"</thead><tbody>{rows}</tbody></table>"
        )
    elif any(view.summary is not None for view in suites):
        table = '<p class="muted">No expectation failed or warned.</p>'
    else:
        table = ""
    listings = "".join(_all_expectations(view.suite, view.summary) for view in suites if view.summary is not None)
    return f'<section><h2>Validation</h2><div class="suites">{cards}</div>{table}{listings}</section>'


def render_plots(inputs: ReportInputs) -> str:
    """The plot grid; each plot is one inline ``<svg>``, or "not run" when its input is absent."""
    profile, metrics = inputs.profile, inputs.metrics
    no_dataset = "not run: the dataset has not been staged"
    figures = [
        _figure(
            "Reward per group",
            reward_strip_svg(profile.group_rewards, profile.groups) if profile else None,
            _reward_note(profile) if profile else no_dataset,
            wide=True,
        ),
        _figure(
            "Turns per rollout",
            histogram_svg(profile.num_turns, profile.trainable, "turns") if profile else None,
            "rows by number of model calls (assistant turns)" if profile else no_dataset,
        ),
        _figure(
            "Sequence length",
            histogram_svg(profile.lengths, profile.trainable, "tokens per row (input_ids)") if profile else None,
            "masked rows that could not be linearized have length 0" if profile else no_dataset,
        ),
        _figure(
            "Failure reasons",
            reasons_svg(metrics.get("invalid_reasons") or {}, metrics.get("failure_reasons") or {})
            if metrics
            else None,
            "masked rollouts by reason (finalize) and ledger failure rows by reason (generate)"
            if metrics
            else no_dataset,
        ),
        _figure(
            "Weight-version spread",
            weight_versions_svg(profile.version_min, profile.version_max) if profile else None,
            f"rows per min and max weight version; {_num(profile.spanning_rows)} row(s) span more than one version"
            if profile
            else no_dataset,
        ),
        _audit_figure(metrics),
    ]
    return f'<section><h2>Plots</h2><div class="plots">{"".join(figures)}</div></section>'


def render_footer(inputs: ReportInputs) -> str:
    """Where the inputs came from, batch-relative."""
    manifest = None
    if inputs.manifest is not None:
        manifest = layout.DATASET_MARKER if inputs.dataset_state == "published" else layout.DATASET_STAGED
    read = [layout.plan_config(), *([manifest, layout.DATASET_METRICS] if manifest else [])]
    read += [REVIEW_RECORD] if inputs.review is not None else []
    read += [f"{layout.REPORTS_DIR}/{s.suite}/{s.summary.run}/summary.json" for s in inputs.suites if s.summary]
    code = inputs.config.code_version or "unknown"
    return (
        f"<footer><p>Rendered by rollout-ledger (batch code version {_e(code)}) from "
        f"{', '.join(f'<code>{_e(p)}</code>' for p in read)}. Paths are relative to the batch directory.</p></footer>"
    )


# --- page pieces ----------------------------------------------------------------------------


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _num(value: object) -> str:
    """A number for people: ints with separators, floats to 4 significant digits, None as a dash."""
    if value is None or isinstance(value, bool):
        return "—" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:.3e}"
    return _e(value)


def _get(mapping: Mapping[str, Any], key: str, inner: str) -> Any:
    value = mapping.get(key)
    return value.get(inner) if isinstance(value, Mapping) else None


def _spread(summary: object, what: str) -> str:
    if not isinstance(summary, Mapping) or not summary.get("count"):
        return f"no {what}"
    return f"± {_num(summary.get('std'))} · {_num(summary.get('min'))} to {_num(summary.get('max'))} · {what}"


def _reason_list(reasons: object, shown: int = 4) -> str:
    if not isinstance(reasons, Mapping) or not reasons:
        return ""
    ordered = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{_e(reason)} {_num(count)}" for reason, count in ordered[:shown])
    return text + (f", +{len(ordered) - shown} more" if len(ordered) > shown else "")


def _version_range(versions: Iterable[int | str | None]) -> str:
    """``low–high`` of the versions (None left out), or a dash when there is none."""
    numbers = sorted(int(v) for v in versions if v is not None)
    if not numbers:
        return "—"
    return _num(numbers[0]) if numbers[0] == numbers[-1] else f"{_num(numbers[0])}–{_num(numbers[-1])}"


def _model_note(config: BatchConfig) -> str:
    digest = config.model.weights_sha256
    return f"weights sha256 {_e(digest[:12])}…" if digest else "weights sha256 not recorded"


def _tile(label: str, value: str, note: str) -> str:
    """A headline tile; ``value`` and ``note`` are already HTML (numbers from :func:`_num`, escaped text)."""
    return (
        f'<div class="tile"><div class="label">{_e(label)}</div><div class="value">{value}</div>'
        f'<div class="note">{note}</div></div>'
    )


def _badge(css: str, text: str) -> str:
    return f'<span class="badge {_e(css)}">{_e(text)}</span>'


def docs_link(report: str) -> str:
    """The href of a batch-relative Data Docs path from ``reports/index.html`` (never a URL with a scheme)."""
    prefix = f"{layout.REPORTS_DIR}/"
    return report[len(prefix) :] if report.startswith(prefix) else f"../{report}"


def _suite_card(view: SuiteView) -> str:
    status = view.status
    heading = f"<h3>{_e(view.suite.capitalize())} {_badge(status.replace(' ', '-'), status)}</h3>"
    summary = view.summary
    if summary is None:
        why = (
            f"unreadable: {_e(view.error)}"
            if view.error
            else f"not run: no completed run under <code>{_e(layout.REPORTS_DIR)}/{_e(view.suite)}/</code>; run "
            f"<code>rollout-ledger validate --suite {_e(view.suite)}</code>"
        )
        return f'<div class="card">{heading}<p>{why}</p></div>'
    docs = (
        f'<a href="{_e(docs_link(summary.report))}">Data Docs: {_e(summary.report)}</a>'
        if view.docs
        else f'<span class="muted">no Data Docs at {_e(summary.report)}</span>'
    )
    if view.pages:
        links = " · ".join(f'<a href="{_e(docs_link(path))}">{_e(table)}</a>' for table, path in view.pages)
        docs += f"<br>results by table: {links}"
    counts = summary.counts
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(summary.created_at))
    return (
        f'<div class="card">{heading}'
        f"<p>{_num(counts.expectations)} expectations · {_num(counts.failed)} failed · "
        f"{_num(counts.warned)} warned · {_num(counts.rows)} rows</p><p>{docs}</p>"
        f'<p class="muted">{_e(summary.run)} · validated {_e(when)} · Great Expectations {_e(summary.gx_version)}</p>'
        "</div>"
    )


def _json_text(value: object, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return _e(text if len(text) <= limit else text[: limit - 1] + "…")


def _problem_row(suite: str, outcome: ExpectationOutcome) -> str:
    shown = " ".join(f"<code>{_json_text(x, 80)}</code>" for x in outcome.examples[:MAX_EXAMPLES_SHOWN])
    if len(outcome.examples) > MAX_EXAMPLES_SHOWN:
        shown += f' <span class="muted">+{len(outcome.examples) - MAX_EXAMPLES_SHOWN} more</span>'
    observed = _num(outcome.observed)
    if outcome.error:
        observed += f'<br><span class="muted">error: {_json_text(outcome.error)}</span>'
    threshold = "—" if outcome.threshold is None else _json_text(outcome.threshold)
    return (
        f"<tr><td>{_e(suite)}</td><td><b>{_e(outcome.name)}</b><br>"
        f'<span class="muted">{_e(outcome.expectation)}</span></td>'
        f"<td>{_badge('failed' if outcome.severity == 'fail' else 'warned', outcome.severity)}</td>"
        f"<td>{observed}</td><td>{threshold}</td>"
        f'<td class="num">{_num(outcome.unexpected_count)}</td><td>{shown or "—"}</td></tr>'
    )


def _all_expectations(suite: str, summary: SuiteSummary) -> str:
    rows = "".join(
        f"<tr><td>{'✓' if e.success else '✗'}</td><td>{_e(e.name)}</td><td>{_e(e.expectation)}</td>"
        f"<td>{_e(e.severity)}</td><td>{_num(e.observed)}</td></tr>"
        for e in summary.expectations
    )
    return (
        f"<details><summary>All {len(summary.expectations)} expectations of the {_e(suite)} suite</summary>"
        "<table><thead><tr><th></th><th>Name</th><th>Expectation</th><th>Severity</th><th>Observed</th></tr>"
        f"</thead><tbody>{rows}</tbody></table></details>"
    )


def _figure(title: str, svg: str | None, note: str, *, wide: bool = False) -> str:
    body = svg if svg is not None else f'<div class="notrun">{_e(note)}</div>'
    caption = f'<div class="note">{_e(note)}</div>' if svg is not None else ""
    opening = '<figure class="wide">' if wide else "<figure>"
    return f"{opening}<figcaption>{_e(title)}</figcaption>{body}{caption}</figure>"


def _reward_note(profile: DatasetProfile) -> str:
    shown = len(profile.group_rewards)
    sample = "" if shown == profile.groups else f" (one group in {math.ceil(profile.groups / MAX_GROUPS_SHOWN)})"
    return (
        f"{shown} of {profile.groups} groups{sample}: dots are trainable rows, crosses masked rows with a reward, "
        "the dark bar is the mean of the trainable rows; masked rows without a reward sit under the axis"
    )


def _audit_figure(metrics: Mapping[str, Any] | None) -> str:
    audit = metrics.get("audit") if metrics is not None else None
    if not isinstance(audit, Mapping):
        why = "the dataset has not been staged" if metrics is None else "finalize ran without --audit"
        return _figure("Logprob audit", None, f"not run: {why}", wide=True)
    facts = [
        ("model", f"<code>{_e(audit.get('model_path'))}</code>"),
        (
            "sampling",
            f"temperature {_num(audit.get('temperature'))}, top_p {_num(audit.get('top_p'))}, "
            f"top_k {_num(audit.get('top_k'))}",
        ),
        ("rows audited", f"{_num(audit.get('rows_audited'))} of {_num(audit.get('rows_eligible'))} eligible"),
        (
            "tokens audited",
            f"{_num(audit.get('tokens_audited'))} ({_num(audit.get('filtered_out_tokens'))} filtered out)",
        ),
        (
            "tokens outside clip",
            f"{_num(audit.get('tokens_outside_clip'))} ({_num(audit.get('token_outside_clip_fraction'))})",
        ),
        (
            "sequences outside clip",
            f"{_num(audit.get('sequences_outside_clip'))} ({_num(audit.get('seq_outside_clip_fraction'))})",
        ),
    ]
    rows = ["".join(f"<th>{_e(k)}</th><td>{v}</td>" for k, v in facts[i : i + 3]) for i in range(0, len(facts), 3)]
    table = f'<table class="facts"><tbody>{"".join(f"<tr>{row}</tr>" for row in rows)}</tbody></table>'
    note = (
        "left: |stored − recomputed| logprob of the sampled tokens (log scale); right: importance ratios "
        "exp(recomputed − stored), min · mean · max, against the clip range (shaded)"
    )
    return _figure("Logprob audit", audit_svg(audit) + table, note, wide=True)


# --- SVG ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Frame:
    """A plot area inside an SVG of ``width`` × ``height``: the margins are left for axes and labels."""

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


def _svg(width: int, height: int, label: str, body: Iterable[str]) -> str:
    return (
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{_e(label)}" font-family="system-ui,-apple-system,Segoe UI,Roboto,sans-serif" '
        f'font-size="11" fill="{INK}"><title>{_e(label)}</title>{"".join(body)}</svg>'
    )


def _f(value: float) -> str:
    return f"{value:.1f}"


def _text(
    x: float, y: float, text: str, *, anchor: str = "middle", size: int = 11, fill: str = INK, **extra: str
) -> str:
    attributes = "".join(f' {k.replace("_", "-")}="{_e(v)}"' for k, v in extra.items())
    return (
        f'<text x="{_f(x)}" y="{_f(y)}" text-anchor="{anchor}" font-size="{size}" fill="{fill}"{attributes}>'
        f"{_e(text)}</text>"
    )


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str | None = None, **extra: str) -> str:
    attributes = "".join(f' {k.replace("_", "-")}="{_e(v)}"' for k, v in extra.items())
    inner = f"<title>{_e(title)}</title>" if title else ""
    return (
        f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(max(w, 0.0))}" height="{_f(max(h, 0.0))}" fill="{fill}"'
        f"{attributes}>{inner}</rect>"
    )


def _line(x1: float, y1: float, x2: float, y2: float, stroke: str, width: float = 1.0, **extra: str) -> str:
    attributes = "".join(f' {k.replace("_", "-")}="{_e(v)}"' for k, v in extra.items())
    return (
        f'<line x1="{_f(x1)}" y1="{_f(y1)}" x2="{_f(x2)}" y2="{_f(y2)}" stroke="{stroke}" '
        f'stroke-width="{width}"{attributes}/>'
    )


def _message_svg(width: int, height: int, label: str, message: str) -> str:
    return _svg(width, height, label, [_text(width / 2, height / 2, message, fill=GREY, size=13)])


def _legend(x: float, y: float, items: Sequence[tuple[str, str]]) -> str:
    parts = []
    for color, label in items:
        parts.append(_rect(x, y - 9, 10, 10, color))
        parts.append(_text(x + 14, y, label, anchor="start"))
        x += 24 + 6.5 * len(label)
    return "".join(parts)


def _label_step(labels: Sequence[str], width: float) -> int:
    """Label every n-th of ``labels`` spread over ``width`` pixels so that no two overlap (11 px text)."""
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


def _tick_label(value: float) -> str:
    if abs(value) >= 1e6:
        return f"{value / 1e6:g}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


def _scale(domain: tuple[float, float], pixels: tuple[float, float]) -> Callable[[float], float]:
    (d0, d1), (p0, p1) = domain, pixels
    span = d1 - d0 or 1.0
    return lambda v: p0 + (v - d0) / span * (p1 - p0)


def _y_axis(frame: _Frame, ticks: Sequence[float], y: Callable[[float], float], title: str) -> list[str]:
    parts = []
    for tick in ticks:
        parts.append(_line(frame.x0, y(tick), frame.x1, y(tick), GRID))
        parts.append(_text(frame.x0 - 6, y(tick) + 4, _tick_label(tick), anchor="end", fill=GREY))
    middle = (frame.y0 + frame.y1) / 2
    parts.append(_text(13, middle, title, fill=GREY, transform=f"rotate(-90 13 {_f(middle)})"))
    return parts


def histogram_svg(values: np.ndarray, trainable: np.ndarray, axis_title: str, *, width: int = 560) -> str:
    """Stacked histogram of integer ``values``: trainable rows (blue) under masked rows (red)."""
    label = f"histogram of {axis_title}"
    height = 250
    if not values.size:
        return _message_svg(width, height, label, "no rows")
    low, high = int(values.min()), int(values.max())
    bin_width = 1 if high - low < 30 else math.ceil(nice_ticks(0, (high - low + 1) / 30, 1)[-1])
    first = low - low % bin_width
    edges = np.arange(first, high + bin_width + 1, bin_width)
    counts_trainable = np.histogram(values[trainable], edges)[0]
    counts_masked = np.histogram(values[~trainable], edges)[0]
    frame = _Frame(width, height, top=30)
    y_ticks = nice_ticks(0, max(1, int((counts_trainable + counts_masked).max())))
    x = _scale((float(edges[0]), float(edges[-1])), (frame.x0, frame.x1))
    y = _scale((0.0, y_ticks[-1]), (frame.y0, frame.y1))
    parts = _y_axis(frame, y_ticks, y, "rows")
    for i, (n_train, n_mask) in enumerate(zip(counts_trainable.tolist(), counts_masked.tolist(), strict=True)):
        left, right = x(edges[i]) + 1, x(edges[i + 1]) - 1
        span = f"{edges[i]}" if bin_width == 1 else f"{edges[i]}–{edges[i + 1] - 1}"
        parts.append(_rect(left, y(n_train), right - left, frame.y0 - y(n_train), BLUE, f"{span}: {n_train} trainable"))
        top = y(n_train + n_mask)
        parts.append(_rect(left, top, right - left, y(n_train) - top, RED, f"{span}: {n_mask} masked"))
    if bin_width == 1:
        step = _label_step([str(e) for e in edges[:-1].tolist()], frame.x1 - frame.x0)
        x_ticks = [(e + 0.5, str(e)) for e in edges[:-1:step].tolist()]
    else:
        x_ticks = [(t, _tick_label(t)) for t in nice_ticks(float(edges[0]), float(edges[-1]), 6) if t <= edges[-1]]
    for position, text in x_ticks:
        parts.append(_line(x(position), frame.y0, x(position), frame.y0 + 4, GREY))
        parts.append(_text(x(position), frame.y0 + 16, text, fill=GREY))
    parts.append(_line(frame.x0, frame.y0, frame.x1, frame.y0, INK))
    parts.append(_text((frame.x0 + frame.x1) / 2, height - 6, axis_title, fill=GREY))
    parts.append(_legend(frame.x0, 16, [(BLUE, f"trainable ({int(trainable.sum()):,})"), (RED, "masked")]))
    return _svg(width, height, label, parts)


def reward_strip_svg(groups: Sequence[GroupRewards], total_groups: int, *, width: int = 1180) -> str:
    """Per group: dots (trainable rows' rewards), crosses (masked rows) and the trainable mean.

    Masked rows without a reward are crosses in a lane under the axis.
    """
    label = "reward per group"
    height = 320
    every = [r for g in groups for r in (*g.trainable, *g.masked) if math.isfinite(r)]
    if not groups:
        return _message_svg(width, height, label, "no groups")
    frame = _Frame(width, height, bottom=84, top=30)
    y_ticks = nice_ticks(min(every, default=0.0), max(every, default=1.0))
    y = _scale((y_ticks[0], y_ticks[-1]), (frame.y0, frame.y1))
    band = (frame.x1 - frame.x0) / len(groups)
    lane = frame.y0 + 14
    parts = _y_axis(frame, y_ticks, y, "reward")
    parts.append(_text(frame.x0 - 6, lane + 4, "masked", anchor="end", fill=RED, font_size="10"))
    for i, group in enumerate(groups):
        center = frame.x0 + band * (i + 0.5)
        if i % 2:
            parts.append(_rect(frame.x0 + band * i, frame.y1, band, frame.y0 - frame.y1 + 24, "#f9fafb"))
        finite = [r for r in group.trainable if math.isfinite(r)]
        points = [(y(r), False) for r in finite] + [(y(r), True) for r in group.masked]
        points += [(lane, True)] * group.unrewarded
        for (px, py), masked in _swarm(center, band, points):
            if masked:
                parts.append(_cross(px, py))
            else:
                parts.append(f'<circle cx="{_f(px)}" cy="{_f(py)}" r="3.2" fill="{BLUE}" fill-opacity="0.75"/>')
        if finite:
            mean = sum(finite) / len(finite)
            parts.append(_line(center - band * 0.35, y(mean), center + band * 0.35, y(mean), INK, 2.0))
        tick_y = frame.y0 + 34
        rotate = f"rotate(-45 {_f(center)} {_f(tick_y)})"
        parts.append(_text(center, tick_y, group.group_id, anchor="end", fill=GREY, transform=rotate))
    parts.append(_line(frame.x0, frame.y0, frame.x1, frame.y0, INK))
    shown = f"{len(groups)} of {total_groups} groups" if len(groups) < total_groups else f"{total_groups} groups"
    parts.append(_text(frame.x1, 16, shown, anchor="end", fill=GREY))
    parts.append(_legend(frame.x0, 16, [(BLUE, "trainable row"), (RED, "masked row"), (INK, "mean (trainable)")]))
    return _svg(width, height, label, parts)


def _cross(x: float, y: float) -> str:
    return _line(x - 3, y - 3, x + 3, y + 3, RED, 1.5) + _line(x - 3, y + 3, x + 3, y - 3, RED, 1.5)


def _swarm(center: float, band: float, points: Sequence[tuple[float, bool]]) -> list[tuple[tuple[float, float], bool]]:
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


def reasons_svg(masked: Mapping[str, int], failures: Mapping[str, int], *, width: int = 560) -> str:
    """Horizontal bars: masked rollouts by reason, then ledger failure rows by reason."""
    label = "failure reasons"
    sections = [
        (title, color, _top_reasons(counts))
        for title, color, counts in (
            ("masked rollouts", RED, masked),
            ("ledger failure rows", PURPLE, failures),
        )
    ]
    if not any(rows for _, _, rows in sections):
        return _message_svg(width, 120, label, "no masked rollouts and no failure rows")
    row_height, left = 22, 220
    lines = sum(1 + max(len(rows), 1) for _, _, rows in sections)
    height = 30 + lines * row_height + 28
    largest = max(count for _, _, rows in sections for _, count in rows)
    frame = _Frame(width, height, left=left, right=40, top=30, bottom=28)
    x_ticks = nice_ticks(0, largest, 4)
    x = _scale((0.0, x_ticks[-1]), (frame.x0, frame.x1))
    parts = []
    for tick in x_ticks:
        parts.append(_line(x(tick), frame.y1, x(tick), frame.y0, GRID))
        parts.append(_text(x(tick), frame.y0 + 16, _tick_label(tick), fill=GREY))
    top = frame.y1
    for title, color, rows in sections:
        parts.append(_text(8, top + 14, title, anchor="start", font_weight="600"))
        top += row_height
        if not rows:
            parts.append(_text(left - 8, top + 14, "none", anchor="end", fill=GREY))
            top += row_height
        for reason, count in rows:
            shown = reason if len(reason) <= 32 else reason[:31] + "…"
            parts.append(_text(left - 8, top + 14, shown, anchor="end"))
            parts.append(_rect(x(0), top + 4, x(count) - x(0), row_height - 8, color, f"{reason}: {count}"))
            parts.append(_text(x(count) + 4, top + 15, f"{count:,}", anchor="start", fill=GREY))
            top += row_height
    parts.append(_line(frame.x0, frame.y1, frame.x0, frame.y0, INK))
    return _svg(width, height, label, parts)


def _top_reasons(counts: Mapping[str, int]) -> list[tuple[str, int]]:
    ordered = sorted(((str(k), int(v)) for k, v in counts.items() if v), key=lambda kv: (-kv[1], kv[0]))
    if len(ordered) <= MAX_REASONS_SHOWN:
        return ordered
    rest = ordered[MAX_REASONS_SHOWN - 1 :]
    return [*ordered[: MAX_REASONS_SHOWN - 1], (f"other ({len(rest)} reasons)", sum(c for _, c in rest))]


def weight_versions_svg(
    version_min: Mapping[int | None, int], version_max: Mapping[int | None, int], *, width: int = 560
) -> str:
    """Grouped bars per weight version: rows whose min (teal) and max (purple) version it is."""
    label = "rows per weight version"
    height = 250
    if not version_min and not version_max:
        return _message_svg(width, height, label, "no rows")
    categories = _version_categories([v for v in (*version_min, *version_max) if v is not None])
    bars: list[tuple[str, int, int]] = []
    for name, low, high in categories:
        bars.append((name, _rows_between(version_min, low, high), _rows_between(version_max, low, high)))
    if None in version_min or None in version_max:
        bars.append(("none", version_min.get(None, 0), version_max.get(None, 0)))
    frame = _Frame(width, height, top=30)
    y_ticks = nice_ticks(0, max(1, *(max(b[1], b[2]) for b in bars)))
    y = _scale((0.0, y_ticks[-1]), (frame.y0, frame.y1))
    band = (frame.x1 - frame.x0) / len(bars)
    bar = min(28.0, band * 0.38)
    step = _label_step([name for name, _, _ in bars], frame.x1 - frame.x0)
    parts = _y_axis(frame, y_ticks, y, "rows")
    for i, (name, n_min, n_max) in enumerate(bars):
        center = frame.x0 + band * (i + 0.5)
        parts.append(
            _rect(center - bar - 1, y(n_min), bar, frame.y0 - y(n_min), TEAL, f"version {name}: min of {n_min} rows")
        )
        parts.append(
            _rect(center + 1, y(n_max), bar, frame.y0 - y(n_max), PURPLE, f"version {name}: max of {n_max} rows")
        )
        if i % step == 0:
            parts.append(_text(center, frame.y0 + 16, name, fill=GREY))
    parts.append(_line(frame.x0, frame.y0, frame.x1, frame.y0, INK))
    parts.append(_text((frame.x0 + frame.x1) / 2, height - 6, "weight version", fill=GREY))
    parts.append(_legend(frame.x0, 16, [(TEAL, "weight_version_min"), (PURPLE, "weight_version_max")]))
    return _svg(width, height, label, parts)


def _rows_between(counts: Mapping[int | None, int], low: int, high: int) -> int:
    return sum(n for v, n in counts.items() if v is not None and low <= v <= high)


def _version_categories(versions: Sequence[int]) -> list[tuple[str, int, int]]:
    """(label, low, high) per distinct version, or ranges of equal width when there are too many."""
    distinct = sorted(set(versions))
    if len(distinct) <= MAX_VERSION_BARS:
        return [(str(v), v, v) for v in distinct]
    low, high = distinct[0], distinct[-1]
    step = math.ceil((high - low + 1) / MAX_VERSION_BARS)
    starts = sorted({low + (v - low) // step * step for v in distinct})
    return [(f"{s}–{s + step - 1}", s, s + step - 1) for s in starts]


def audit_svg(audit: Mapping[str, Any], *, width: int = 1180) -> str:
    """Two panels from the audit's statistics: logprob differences (log scale), importance ratios vs the clip."""
    label = "logprob audit"
    height = 190
    half = width // 2
    parts = _audit_differences(audit, _Frame(half - 10, height, left=150, right=24, top=30, bottom=34))
    ratios = _audit_ratios(audit, _Frame(half - 10, height, left=120, right=24, top=30, bottom=34))
    parts.append(f'<g transform="translate({half + 10} 0)">{"".join(ratios)}</g>')
    return _svg(width, height, label, parts)


def _log_ticks(low_exp: int, high_exp: int) -> list[float]:
    """Powers of ten from 10^low_exp to 10^high_exp, with 2 and 5 × 10^k in between when the span is short."""
    ticks = [10.0**k * m for k in range(low_exp, high_exp + 1) for m in (1, 2, 5)]
    ticks = [t for t in ticks if t <= 10.0**high_exp]
    return (
        ticks
        if len(ticks) <= 10
        else [10.0**k for k in range(low_exp, high_exp + 1, max(1, (high_exp - low_exp) // 8))]
    )


def _audit_differences(audit: Mapping[str, Any], frame: _Frame) -> list[str]:
    rows = [
        ("mean |diff|", audit.get("mean_abs_diff")),
        ("p99 |diff|", audit.get("p99_abs_diff")),
        ("max |diff|", audit.get("max_abs_diff")),
        ("raw mean |diff|", audit.get("raw_mean_abs_diff")),
    ]
    parts = [_text(frame.x0, 16, "|stored − recomputed| logprob (nats)", anchor="start", font_weight="600")]
    values = [v for _, v in rows if isinstance(v, int | float) and v > 0]
    if not values:
        parts.append(_text((frame.x0 + frame.x1) / 2, frame.height / 2, "no token compared", fill=GREY))
        return parts
    low_exp = max(-12, min(-6, math.floor(math.log10(min(values)))))
    high_exp = max(0, math.ceil(math.log10(max(values))))
    x = _scale((float(low_exp), float(high_exp)), (frame.x0, frame.x1))
    for tick in _log_ticks(low_exp, high_exp):
        parts.append(_line(x(math.log10(tick)), frame.y1, x(math.log10(tick)), frame.y0, GRID))
        if math.log10(tick).is_integer():
            parts.append(_text(x(math.log10(tick)), frame.y0 + 14, f"{tick:g}", fill=GREY))
    row = (frame.y0 - frame.y1) / len(rows)
    for i, (name, value) in enumerate(rows):
        top = frame.y1 + i * row
        parts.append(_text(frame.x0 - 8, top + row / 2 + 4, name, anchor="end"))
        if isinstance(value, int | float):
            end = x(math.log10(value)) if value > 0 else frame.x0
            color = GREY if name.startswith("raw") else BLUE
            parts.append(_rect(frame.x0, top + 5, end - frame.x0, row - 10, color, f"{name}: {value:.3g}"))
            parts.append(_text(end + 4, top + row / 2 + 4, f"{value:.3g}", anchor="start", fill=GREY))
        else:
            parts.append(_text(frame.x0 + 4, top + row / 2 + 4, "—", anchor="start", fill=GREY))
    parts.append(_line(frame.x0, frame.y1, frame.x0, frame.y0, INK))
    return parts


def _audit_ratios(audit: Mapping[str, Any], frame: _Frame) -> list[str]:
    clip = (audit.get("clip_low"), audit.get("clip_high"))
    rows = [
        ("token ratio", audit.get("token_ratio_min"), audit.get("token_ratio_mean"), audit.get("token_ratio_max")),
        ("sequence ratio", audit.get("seq_ratio_min"), audit.get("seq_ratio_mean"), audit.get("seq_ratio_max")),
    ]
    parts = [_text(frame.x0, 16, "importance ratio exp(recomputed − stored)", anchor="start", font_weight="600")]
    values = [v for v in (*clip, *(v for r in rows for v in r[1:])) if isinstance(v, int | float) and v > 0]
    if not values:
        parts.append(_text((frame.x0 + frame.x1) / 2, frame.height / 2, "no ratio computed", fill=GREY))
        return parts
    low_exp, high_exp = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    if high_exp == low_exp:
        low_exp, high_exp = low_exp - 1, high_exp + 1
    x = _scale((float(low_exp), float(high_exp)), (frame.x0, frame.x1))
    if all(isinstance(c, int | float) and c > 0 for c in clip):
        left, right = x(math.log10(clip[0])), x(math.log10(clip[1]))
        parts.append(_rect(left, frame.y1, right - left, frame.y0 - frame.y1, "#dcfce7"))
        parts.append(_text(left, frame.y0 + 26, f"clip {clip[0]:g}", anchor="middle", fill=GREEN))
        parts.append(_text(right, frame.y0 + 26, f"clip {clip[1]:g}", anchor="middle", fill=GREEN))
    for tick in _log_ticks(low_exp, high_exp):
        parts.append(_line(x(math.log10(tick)), frame.y1, x(math.log10(tick)), frame.y0, GRID))
        parts.append(_text(x(math.log10(tick)), frame.y0 + 14, f"{tick:g}", fill=GREY))
    parts.append(_line(x(0.0), frame.y1, x(0.0), frame.y0, INK, 1.0, stroke_dasharray="3 3"))
    row = (frame.y0 - frame.y1) / len(rows)
    for i, (name, low, mean, high) in enumerate(rows):
        middle = frame.y1 + (i + 0.5) * row
        parts.append(_text(frame.x0 - 8, middle + 2, name, anchor="end"))
        if not all(isinstance(v, int | float) and v > 0 for v in (low, mean, high)):
            parts.append(_text(frame.x0 + 4, middle + 4, "—", anchor="start", fill=GREY))
            continue
        a, m, b = (x(math.log10(v)) for v in (low, mean, high))
        parts.append(_line(a, middle, b, middle, BLUE, 2.0))
        parts.append(_line(a, middle - 6, a, middle + 6, BLUE, 2.0) + _line(b, middle - 6, b, middle + 6, BLUE, 2.0))
        parts.append(
            f'<circle cx="{_f(m)}" cy="{_f(middle)}" r="5" fill="{BLUE}"><title>mean {mean:.4g}</title></circle>'
        )
        parts.append(_text(frame.x0 - 8, middle + 16, f"{low:.3g} · {mean:.3g} · {high:.3g}", anchor="end", fill=GREY))
    return parts
