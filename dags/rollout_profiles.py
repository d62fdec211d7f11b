"""Periodic batches: one scheduled ``rollout_batch__<profile>`` DAG per profile of ``profiles.yaml``.

``$ROLLOUT_LEDGER_PROFILES`` names another file. A bad profile shows as this file's import error,
naming the profile and the field in the Airflow UI; the manual ``rollout_batch`` DAG keeps working.
"""

import os
from pathlib import Path

from tasks.orchestration.profiles import load_profiles
from tasks.orchestration.rollout_dag import profile_dag

PROFILES_FILE = Path(os.environ.get("ROLLOUT_LEDGER_PROFILES") or Path(__file__).with_name("profiles.yaml"))

for profile in load_profiles(PROFILES_FILE):
    globals()[profile.dag_id] = profile_dag(profile, profiles_file=str(PROFILES_FILE))
