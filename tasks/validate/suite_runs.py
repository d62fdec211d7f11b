"""Where a suite's runs live on the batch's storage, and which one is current.

Reports are create-once objects like everything else in a batch, so a run never rewrites
another's files. Each run of a suite owns a numbered directory::

    reports/{suite}/run-000/_CLAIM.json    created first, create-once: which run_key, who, when
    reports/{suite}/run-000/index.html ... GX Data Docs of the run (expectations/, validations/, static/)
    reports/{suite}/run-000/summary.json   written last: the run is complete once it exists

A run takes the first number above every directory used so far; losing the create-once race for
a claim moves to the next number (as a shard attempt does), so two runs never share a directory.
The current run of a suite is the highest-numbered one with a ``summary.json`` (a run that
crashed before its summary is ignored and its directory stays as it is). A run whose ``run_key``
(what it read and the thresholds it used) equals the current run's does not run again: the
current summary is its outcome, so re-running a stage is idempotent, while a re-run with other
thresholds or more committed shards gets a new directory and becomes current.
"""

from __future__ import annotations

import json
import os
import socket
import time

from tasks import layout
from tasks.batch import Batch
from tasks.storage.claims import claim_next


def claim_run(batch: Batch, suite: str, *, run_key: str) -> str:
    """Create the claim of a new run of ``suite`` and return the run's name (``run-NNN``).

    The run takes the first number above every run directory used so far (claim races: see
    :func:`tasks.storage.claims.claim_next`).
    """

    def claim(number: int) -> tuple[str, bytes]:
        run = layout.suite_run_name(number)
        record = {
            "suite": suite,
            "batch_id": batch.batch_id,
            "run": run,
            "run_key": run_key,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": time.time(),
        }
        return layout.suite_run_claim(suite, run), json.dumps(record).encode()

    first = max(batch.suite_runs(suite), default=-1) + 1
    number = claim_next(batch.store, first, claim, what=f"a {suite} run of {batch.batch_id}")
    return layout.suite_run_name(number)
