"""
### rollout_batch__<profile>: periodic batches from `dags/profiles.yaml`

One scheduled copy of the `rollout_batch` DAG per profile (cron, time zone, paused flag and batch
form defaults from the file; `$ROLLOUT_LEDGER_PROFILES` names another file). Runs never overlap
and missed intervals are not caught up.
"""

from __future__ import annotations

import os
from pathlib import Path

from airflow.sdk import CronTriggerTimetable
from rollout_batch import rollout_batch_dag

from tasks.orchestration.profiles import load_profiles

PROFILES_FILE = Path(os.environ.get("ROLLOUT_LEDGER_PROFILES") or Path(__file__).with_name("profiles.yaml"))

for profile in load_profiles(PROFILES_FILE):
    globals()[profile.dag_id] = rollout_batch_dag(
        profile.dag_id,
        schedule=CronTriggerTimetable(profile.cron, timezone=profile.timezone),
        defaults=profile.params,
        description=profile.description or f"periodic rollout batch, profile {profile.name}",
        tags=("profile",),
        paused=profile.paused,
    )
