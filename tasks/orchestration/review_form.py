"""What the Airflow ``review`` task asks a person: the decision form's subject and Markdown body, read from the batch.

:func:`build_review_request` says whether a decision is needed (a suite warned, or the run requires
review), whether one is already recorded, and renders the form: why review is needed, the headline
numbers, every expectation that warned with its observed value and threshold, and a link to the
run's overview page in the report viewer. The buttons and the reason field are
:data:`tasks.records.review.OPTIONS` and :data:`~tasks.records.review.REASON_FIELD`. Values from
storage are escaped for Markdown. No Airflow import here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks.batch import Batch
from tasks.publish import review_reasons, staged_dataset, validation_outcomes
from tasks.records.review import TIMEOUT_REASON, ReviewDecision
from tasks.records.suite_summary import SUITES
from tasks.storage.dataset_manifest import DatasetMarker


@dataclass(frozen=True)
class ReviewRequest:
    """Whether the batch needs a decision (``needed`` says why; empty: it does not), and the form to ask it with.

    ``decision`` is the one already recorded (the CLI, an earlier try), ``published`` whether the
    dataset is committed; either way nobody is asked again.
    """

    batch_id: str
    needed: tuple[str, ...]
    decision: ReviewDecision | None
    published: bool
    subject: str
    body: str


def build_review_request(batch: Batch, *, require_review: bool, report_url: str, timeout_hours: float) -> ReviewRequest:
    """The batch's review request; raises :class:`tasks.errors.PublishRefusedError` when publish could not take it."""
    batch_id = batch.batch_id
    decision = batch.review()
    published = batch.published_dataset()
    if decision is not None or published is not None:
        return ReviewRequest(batch_id, (), decision, published is not None, "", "")
    staged = staged_dataset(batch)
    outcomes = validation_outcomes(batch)
    needed = tuple(review_reasons(outcomes, require_review=require_review))
    metrics = batch.dataset_metrics(staged)
    warned = [
        (suite, outcome)
        for suite in SUITES
        if (summary := batch.suite_summary(suite)) is not None
        for outcome in summary.expectations
        if not outcome.success and outcome.severity == "warn"
    ]
    body = render_body(
        batch_id,
        needed=needed,
        staged=staged,
        metrics=metrics,
        statuses={suite: outcome["status"] for suite, outcome in outcomes.items()},
        warned=[(suite, o.name, o.observed, o.threshold, o.unexpected_count) for suite, o in warned],
        report_url=report_url,
        timeout_hours=timeout_hours,
    )
    return ReviewRequest(batch_id, needed, None, False, f"Review batch {batch_id} before it is published", body)


def render_body(
    batch_id: str,
    *,
    needed: Sequence[str],
    staged: DatasetMarker,
    metrics: Mapping[str, Any],
    statuses: Mapping[str, str],
    warned: Sequence[tuple[str, str, float | None, Any, int]],
    report_url: str,
    timeout_hours: float,
) -> str:
    """The form's Markdown. ``warned``: (suite, expectation, observed, threshold, rows) of each warning."""
    audit = metrics.get("audit") or {}
    masked = staged.rows - staged.trainable_rows
    headline = [
        ("rollouts planned", metrics.get("planned_rollouts")),
        ("rows (trainable / masked)", f"{staged.rows} ({staged.trainable_rows} / {masked})"),
        ("groups", staged.groups),
        ("invalid row rate", metrics.get("invalid_row_rate")),
        ("mean reward (trainable rows)", (metrics.get("reward") or {}).get("mean")),
        ("logprob audit: mean / max abs difference", _pair(audit.get("mean_abs_diff"), audit.get("max_abs_diff"))),
        *((f"{suite} suite", status) for suite, status in statuses.items()),
    ]
    if staged.partial:
        headline.append(("missing shards (partial dataset)", ", ".join(map(str, staged.missing_shards))))
    lines = [
        f"Batch `{_code(batch_id)}` waits for your decision: {_text('; '.join(needed))}.",
        "",
        f"[Open the validation report]({report_url}) (both suites, plots, Data Docs).",
        "",
        "| headline | value |",
        "| --- | --- |",
        *(f"| {label} | {_cell(value)} |" for label, value in headline),
        "",
    ]
    if warned:
        lines += [
            "Expectations that warned:",
            "",
            "| suite | expectation | observed | threshold | rows |",
            "| --- | --- | --- | --- | --- |",
            *(
                f"| {suite} | `{_code(name)}` | {_cell(observed)} | {_cell(threshold)} | {rows} |"
                for suite, name, observed, threshold, rows in warned
            ),
            "",
        ]
    lines += [
        "**Publish** commits the dataset for training; **Reject** keeps it unpublished, for good. Either way, "
        f"give a reason: it goes into the batch's record. Without an answer within {_hours(timeout_hours)} "
        f"the batch is rejected (`{TIMEOUT_REASON}`).",
    ]
    return "\n".join(lines)


def _pair(first: object, second: object) -> str | None:
    if first is None and second is None:
        return None
    return f"{_number(first)} / {_number(second)}"


def _cell(value: object) -> str:
    """A value for a Markdown table cell: numbers to 4 significant digits, "–" for none, text escaped."""
    if value is None:
        return "–"
    return _text(_number(value))


def _number(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "–" if value is None else str(value)


def _text(value: str) -> str:
    """Text with Markdown's table, emphasis and link characters escaped."""
    for char in "\\|*_[]<>`":
        value = value.replace(char, "\\" + char)
    return value.replace("\n", " ")


def _code(value: str) -> str:
    return value.replace("`", "'")


def _hours(hours: float) -> str:
    return f"{hours:g} hour{'s' if hours != 1 else ''}"
