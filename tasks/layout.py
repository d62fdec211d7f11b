"""Object names under a batch directory (docs/architecture.md, "Storage layout"); the only place they are spelled.

All paths are relative to ``{root}/batches/{batch_id}/`` so that committed data can be moved
or copied between roots without rewriting records that point into it.
"""

from __future__ import annotations

import re

from tasks.ids import attempt_name, check_id, shard_name

BATCHES_DIR = "batches"  # relative to the storage root: one folder per batch
MARKER_NAME = "_COMMITTED.json"
REPORTS_DIR = "reports"
REPORTS_INDEX = f"{REPORTS_DIR}/index.html"  # the overview page, rewritten after each validation run
REVIEW_RECORD = f"{REPORTS_DIR}/review.json"  # the review decision, created once
CLAIM_NAME = "_CLAIM.json"
SUITE_SUMMARY_NAME = "summary.json"  # a suite run is complete once its summary exists
SUITE_PROFILE_NAME = "profile.json"  # the run's profile in numbers, written before its summary
SUITE_REPORT_NAME = "index.html"  # a suite run's Data Docs index
_ATTEMPT_IN_PATH = re.compile(r"/attempt-(\d+)/")
_SUITE_NAME = re.compile(r"[a-z]+")
_SUITE_RUN = re.compile(r"run-(\d{3,})")


def batch_dir(batch_id: str) -> str:
    """Path of a batch relative to the storage root."""
    return f"{BATCHES_DIR}/{check_id(batch_id, field='batch_id')}"


def plan_config() -> str:
    return "plan/batch.json"


def plan_shard(shard: int) -> str:
    return f"plan/{shard_name(shard)}.parquet"


def staging_shard_dir(shard: int) -> str:
    return f"staging/{shard_name(shard)}"


def ledger_shard_dir(shard: int) -> str:
    return f"ledger/{shard_name(shard)}"


def staging_segment(shard: int, attempt: int, index: int) -> str:
    return f"{staging_shard_dir(shard)}/{attempt_name(attempt)}/seg-{index:06d}.parquet"


def ledger_file(shard: int, attempt: int, kind: str, index: int, *, compacted: bool = False) -> str:
    """``kind`` is one of ``calls``, ``failures``, ``receipts``.

    ``compacted``: ``{kind}-compacted-NNNNNN.parquet``, the attempt's own rows rewritten at commit
    into fewer files (``LedgerWriter.commit``); valid only once its own attempt's marker names it.
    """
    if kind not in LEDGER_KINDS:
        raise ValueError(f"ledger file kind must be one of {LEDGER_KINDS}, got {kind!r}")
    infix = COMPACTED_INFIX if compacted else ""
    return f"{ledger_shard_dir(shard)}/{attempt_name(attempt)}/{kind}-{infix}{index:06d}.parquet"


def attempt_claim(shard: int, attempt: int) -> str:
    """``_CLAIM.json`` of an attempt: created once, before the attempt writes anything else."""
    return f"{ledger_shard_dir(shard)}/{attempt_name(attempt)}/{CLAIM_NAME}"


def shard_marker(shard: int) -> str:
    return f"{ledger_shard_dir(shard)}/{MARKER_NAME}"


DATASET_DIR = "dataset"
DATASET_MARKER = f"{DATASET_DIR}/{MARKER_NAME}"  # written by publish: the one object consumers trust
DATASET_STAGED = f"{DATASET_DIR}/_STAGED.json"  # written by finalize: the dataset as built, not yet validated
DATASET_METRICS = f"{DATASET_DIR}/metrics.json"
DATASET_CARD = f"{DATASET_DIR}/README.md"


def dataset_part(index: int) -> str:
    return f"{DATASET_DIR}/part-{index:05d}.parquet"


def attempt_of(path: str) -> int:
    """The attempt number encoded in a staging or ledger object path."""
    match = _ATTEMPT_IN_PATH.search("/" + path)
    if match is None:
        raise ValueError(f"{path!r} is not inside an attempt directory")
    return int(match.group(1))


LEDGER_KINDS = ("calls", "failures", "receipts")
COMPACTED_INFIX = "compacted-"  # {kind}-compacted-NNNNNN.parquet: see ledger_file


def suite_dir(suite: str) -> str:
    """``reports/{suite}``: every run of one validation suite."""
    if not isinstance(suite, str) or not _SUITE_NAME.fullmatch(suite):
        raise ValueError(f"a suite name is lowercase letters, got {suite!r}")
    return f"{REPORTS_DIR}/{suite}"


def suite_run_name(number: int) -> str:
    return f"run-{number:03d}"


def suite_run_number(path: str, suite: str) -> int | None:
    """The run number of a path inside ``reports/{suite}/run-NNN/``, or None for any other path."""
    prefix = suite_dir(suite) + "/"
    if not path.startswith(prefix):
        return None
    match = _SUITE_RUN.fullmatch(path[len(prefix) :].split("/", 1)[0])
    return None if match is None else int(match.group(1))


def suite_run_dir(suite: str, run: str) -> str:
    """``reports/{suite}/{run}``: one run's claim, Data Docs and summary."""
    return f"{suite_dir(suite)}/{run}"


def suite_profile(suite: str, run: str) -> str:
    return f"{suite_run_dir(suite, run)}/{SUITE_PROFILE_NAME}"


def suite_run_claim(suite: str, run: str) -> str:
    return f"{suite_run_dir(suite, run)}/{CLAIM_NAME}"


def suite_summary(suite: str, run: str) -> str:
    return f"{suite_run_dir(suite, run)}/{SUITE_SUMMARY_NAME}"
