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
import re
import socket
import time

from tasks import layout
from tasks.errors import MalformedSummaryError, ObjectConflictError
from tasks.records.suite_summary import SUITES, SuiteSummary
from tasks.storage.objects import ObjectStore

SUMMARY_NAME = "summary.json"
CLAIM_NAME = "_CLAIM.json"
INDEX_NAME = "index.html"
MAX_CLAIM_RACES = 64
_RUN_DIR = re.compile(r"run-(\d{3,})")


def suite_dir(suite: str) -> str:
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {list(SUITES)}, got {suite!r}")
    return f"{layout.REPORTS_DIR}/{suite}"


def run_name(number: int) -> str:
    return f"run-{number:03d}"


def run_dir(suite: str, run: str) -> str:
    """``reports/{suite}/{run}``, batch-relative."""
    return f"{suite_dir(suite)}/{run}"


def claim_run(store: ObjectStore, suite: str, *, run_key: str, batch_id: str) -> str:
    """Create the claim of a new run of ``suite`` and return the run's name (``run-NNN``).

    ``store`` is rooted at the batch. After :data:`MAX_CLAIM_RACES` lost races a RuntimeError says so.
    """
    number = max(_runs(store, suite), default=-1) + 1
    for _ in range(MAX_CLAIM_RACES):
        run = run_name(number)
        claim = {
            "suite": suite,
            "batch_id": batch_id,
            "run": run,
            "run_key": run_key,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": time.time(),
        }
        try:
            if store.write_once(f"{run_dir(suite, run)}/{CLAIM_NAME}", json.dumps(claim).encode()).created:
                return run
        except ObjectConflictError:
            pass
        number += 1
    raise RuntimeError(f"lost {MAX_CLAIM_RACES} claim races for a {suite} run of {batch_id}: too many live runs")


def read_suite_summary(store: ObjectStore, suite: str) -> SuiteSummary | None:
    """The summary of ``suite``'s current run (``store`` rooted at the batch), or None if no run completed.

    Raises :class:`MalformedSummaryError` for a summary that does not parse strictly, or that
    names another suite or run than its path.
    """
    for number in sorted(_runs(store, suite), reverse=True):
        path = f"{run_dir(suite, run_name(number))}/{SUMMARY_NAME}"
        try:
            data = store.read_bytes(path)
        except FileNotFoundError:
            continue  # a run that never completed
        summary = SuiteSummary.from_json(data, source=f"{store.url}/{path}")
        if (summary.suite, summary.run) != (suite, run_name(number)):
            raise MalformedSummaryError(
                f"{store.url}/{path} is the summary of {summary.suite} {summary.run}, not of its own path"
            )
        return summary
    return None


def summary_path(suite: str, run: str) -> str:
    return f"{run_dir(suite, run)}/{SUMMARY_NAME}"


def _runs(store: ObjectStore, suite: str) -> set[int]:
    """Numbers of every run directory of ``suite`` that holds an object (claimed, complete or not)."""
    prefix = suite_dir(suite) + "/"
    found = set()
    for path in store.list_files(suite_dir(suite)):
        match = _RUN_DIR.fullmatch(path[len(prefix) :].split("/", 1)[0])
        if match is not None:
            found.add(int(match.group(1)))
    return found
