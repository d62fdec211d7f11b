"""The host name a Celery worker of the deployment test reports to Airflow (``[core] hostname_callable``).

The test's two workers share one machine but stand for two (a GPU machine and a CPU machine), so
each is started with its own ``ROLLOUT_LEDGER_WORKER_HOSTNAME``; Airflow records it as the
``hostname`` of every task instance that worker runs.
"""

from __future__ import annotations

import os

HOSTNAME_VARIABLE = "ROLLOUT_LEDGER_WORKER_HOSTNAME"


def hostname() -> str:
    return os.environ[HOSTNAME_VARIABLE]
