"""
### grpo_dataset_consumer: an example of a DAG that trains on what rollout_batch publishes

Scheduled on the `grpo_dataset` asset: it runs after each successful `publish`, reads the event
(dataset URI, batch id, counts, weight version), and checks the committed manifest it names
before anything would train on it. Add your trainer after `check_dataset`, or see `grpo_train`
(docs/loop.md): our reference step on the same events, which announces the next `policy_checkpoint`.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.sdk import dag, task

from tasks.orchestration import steps
from tasks.orchestration.assets import GRPO_DATASET


@dag(
    schedule=[GRPO_DATASET],
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    tags=["rollout-ledger", "example"],
    doc_md=__doc__,
)
def grpo_dataset_consumer() -> None:
    @task
    def check_dataset(triggering_asset_events: Any = None) -> list[dict]:
        return [steps.published_dataset(event.extra) for events in triggering_asset_events.values() for event in events]

    check_dataset()


grpo_dataset_consumer()
