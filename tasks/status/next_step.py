"""The one sentence ``rollout-ledger status`` ends with: the command or check that moves a batch on.

A pure function of what was gathered. A decided dataset (published or rejected) needs nothing;
untrustworthy data is named before any command that would build on it; otherwise the earliest
stage that has work left (review, finalize, generate of the shards nobody is writing) comes first.
"""

from __future__ import annotations

import shlex

from tasks import layout
from tasks.status.model import SHARD_STATES, DatasetStatus, ReportsStatus, ShardStatus


def next_step(
    root_url: str, batch_id: str, shards: tuple[ShardStatus, ...], dataset: DatasetStatus, reports: ReportsStatus
) -> str:
    """One sentence: the command or check that moves the batch on."""
    target = f"--root {shlex.quote(root_url)} --batch-id {batch_id}"
    by_state = {state: [s.shard for s in shards if s.state == state] for state in SHARD_STATES}
    if dataset.state == "rejected" and dataset.review is not None:
        return f"nothing to run: the batch was rejected ({dataset.review.describe()}), so it is never published"
    if dataset.state == "published":
        if dataset.partial:
            return f"nothing to run: the dataset is published without shard(s) {list(dataset.missing_shards)}"
        return "nothing to run: the dataset is published"
    if by_state["unreadable"]:
        return (
            f"inspect shard(s) {by_state['unreadable']}: their data cannot be trusted (errors above); "
            "if it cannot be repaired, re-plan under a new batch id"
        )
    if dataset.state == "unreadable":
        return "inspect the dataset's records: they cannot be trusted (error above)"
    if dataset.state == "awaiting_review":
        where = reports.index or f"{layout.REPORTS_DIR}/"
        return (
            f"read the validation reports ({where}) and decide: `rollout-ledger publish {target} --approve --reason "
            "TEXT` or `--reject --reason TEXT` (or answer the run's Airflow review task)"
        )
    if dataset.state == "validation_failed":
        where = reports.index or f"{layout.REPORTS_DIR}/"
        return f"read the validation reports ({where}): validation failed, so nothing was published"
    if dataset.state in ("staged", "validated"):
        return f"run `rollout-ledger finalize {target}` to validate and publish the staged dataset"
    runnable = sorted(by_state["not_started"] + by_state["abandoned"])
    if runnable:
        flags = " ".join(f"--shard {s}" for s in runnable)
        return f"run `rollout-ledger generate {target} {flags}`"
    if by_state["in_progress"]:
        return f"wait for shard(s) {by_state['in_progress']} in progress, then run status again"
    return f"run `rollout-ledger finalize {target}`"
