"""``rollout-ledger status`` as text: a compact page of lines from a gathered :class:`BatchStatus`.

Reads no storage: every line comes from the status records. Hashes are shortened to 12 hex
digits, times are UTC, and an absent value reads ``none``, ``unknown`` or ``unrecorded``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from tasks import layout
from tasks.status.model import (
    AttemptStatus,
    BatchStatus,
    DatasetStatus,
    ReportsStatus,
    ResumeCounts,
    ShardStatus,
    Totals,
)
from tasks.storage.claims import AttemptClaim


def render_status(status: BatchStatus) -> str:
    """A compact text: plan header, one line per shard, totals, dataset, reports, next step."""
    lines = [*_plan_lines(status), "shards:"]
    lines += [f"  {line}" for shard in status.shards for line in _shard_lines(shard)]
    lines += _totals_lines(status.totals, status.plan.rollouts)
    lines += _dataset_lines(status.dataset)
    lines += _reports_lines(status.url, status.reports)
    lines.append(f"next step: {status.next_step}")
    return "\n".join(lines) + "\n"


def _plan_lines(status: BatchStatus) -> list[str]:
    plan = status.plan
    hashes = ", ".join(
        f"{name} {_short(value)}"
        for name, value in (
            ("weights", plan.weights_sha256),
            ("tokenizer", plan.tokenizer_sha256),
            ("chat template", plan.chat_template_sha256),
        )
    )
    return [
        f"batch {status.batch_id} at {status.url}",
        f"  plan: {plan.environment}, {plan.num_tasks} tasks x {plan.group_size} = {plan.rollouts} rollouts "
        f"in {plan.shards} shard(s); weight version {plan.weight_version}; code {plan.code_version or 'unrecorded'}",
        f"  model: {plan.model_reference} ({hashes})",
    ]


def _shard_lines(shard: ShardStatus) -> list[str]:
    head = f"shard {shard.shard:<3} {shard.state:<11}"
    if shard.committed is not None:
        c, counts = shard.committed, shard.committed.counts
        calls = _calls(c.calls, counts.calls_recorded)
        if counts.calls_used is None:
            calls += " (used: counted from the ledger, which a version-1 marker does not record)"
        lines = [
            f"{head} attempt {c.attempt}: {counts.rollouts} rollouts ({counts.ok} ok, {counts.poisoned} poisoned, "
            f"{counts.failed} failed, {counts.adopted_rollouts} adopted), {calls}, "
            f"{counts.failures} failure rows, {counts.staged_rows} staged rows"
            + (f"; failed over from attempt(s) {list(c.failovers)}" if c.failovers else "")
            + (f"; {c.rollouts_failed_over} rollout(s) restarted on a live server" if c.rollouts_failed_over else "")
        ]
        if c.calls_by_server:
            lines.append(f"  calls per server: {_per_server(c.calls_by_server)}")
        return lines + [f"  {line}" for line in _resumed_lines(c.resumed)]
    lines = [head.rstrip() + (f" {shard.error}" if shard.error else "")]
    lines += [f"  {_attempt_line(attempt)}" for attempt in shard.attempts]
    return lines


def _per_server(calls: Mapping[str, int]) -> str:
    return ", ".join(f"{url} {n}" for url, n in calls.items())


def _resumed_lines(resumed: ResumeCounts) -> list[str]:
    """What resuming did (:class:`ResumeCounts`), each count only when not zero; none when nothing resumed."""
    if not resumed.rollouts:
        return []
    parts = (
        (resumed.replayed_calls, "call(s) replayed"),
        (resumed.live_calls, "sampled live after a replay"),
        (resumed.divergences, "divergence(s)"),
        (resumed.replays_refused, "replay(s) refused"),
    )
    counted = ", ".join(f"{n} {what}" for n, what in parts if n)
    return [f"resumed {resumed.rollouts} rollout(s)" + (f": {counted}" if counted else "")]


def _attempt_line(attempt: AttemptStatus) -> str:
    left = ", ".join(f"{n} {kind}" for kind, n in attempt.objects.items())
    return (
        f"attempt {attempt.attempt}: {_claimant(attempt.claim)}; left {left} object(s); "
        f"last activity {_time(attempt.last_activity)}"
        + ("; failed over to the next attempt" if attempt.failed_over else "")
    )


def _claimant(claim: AttemptClaim | None) -> str:
    if claim is None:
        return "no readable claim"
    try_number = f" (try {claim.try_number})" if claim.try_number is not None else ""
    return f"claimed by {claim.host} pid {claim.pid} at {_time(claim.started_at)}{try_number}"


def _totals_lines(totals: Totals, planned: int) -> list[str]:
    versions = (
        "none" if totals.weight_version_min is None else f"{totals.weight_version_min}..{totals.weight_version_max}"
    )
    return [
        f"totals ({totals.committed_shards} committed shard(s)): {totals.rollouts}/{planned} rollouts receipted "
        f"({totals.ok} ok, {totals.poisoned} poisoned, {totals.failed} failed), "
        f"{_calls(totals.calls, totals.calls_recorded)}, {totals.failure_rows} failure rows; "
        f"weight versions {versions}",
        f"  failures by reason: {_counts(totals.failures_by_reason)}",
        f"  poisoned by reason: {_counts(totals.poisoned_by_reason)}",
        *(f"  {line}" for line in _resumed_lines(totals.resumed)),
    ]


def _dataset_lines(dataset: DatasetStatus) -> list[str]:
    parts = [dataset.state]
    if dataset.rows is not None:
        parts.append(f"{dataset.rows} rows ({dataset.trainable_rows} trainable) in {dataset.groups} groups")
    if dataset.partial:
        parts.append(f"PARTIAL: missing shard(s) {list(dataset.missing_shards)}")
    if dataset.suites:
        parts.append("validation " + _counts(dataset.suites))
    if dataset.error:
        parts.append(dataset.error)
    lines = ["dataset: " + "; ".join(parts)]
    if dataset.review is not None:
        lines.append(f"  review: {dataset.review.describe()}")
    return lines


def _reports_lines(url: str, reports: ReportsStatus) -> list[str]:
    if not reports.objects:
        return ["reports: none"]
    head = f"reports: {len(reports.objects)} object(s) under {url}/{layout.REPORTS_DIR}/"
    key = [p for p in reports.objects if p == reports.index or p.endswith("/summary.json")]
    return [head, *(f"  {url}/{path}" for path in key)]


def _calls(used: int, recorded: int) -> str:
    """The calls the rollouts use, then every call record (those no rollout uses included)."""
    return f"{used} calls used, {recorded} recorded"


def _counts(counts: Mapping[str, object]) -> str:
    return ", ".join(f"{key} {value}" for key, value in counts.items()) or "none"


def _short(sha256: str) -> str:
    return sha256[:12] if sha256 else "unrecorded"


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
