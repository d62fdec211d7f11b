"""The lineage suite fails each expectation on a ledger corrupted to violate it, naming the offending rows.

One batch carries every corruption the committed-ledger reader lets through (each on its own
rollouts, so each expectation's examples are exactly its own rows) and is validated once with
strict thresholds. Rules the reader itself enforces on every record (lengths, root rules,
digests) are shown to fail on corrupted profile tables, or (digests, which the profile matches)
on corrupted ledger tables read through a lenient reader.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.capture.faults import ENGINE_ERROR, STAGING_FAILED
from tasks.config import ValidationSpec
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.objects import ObjectStore
from tasks.validate import SuiteOutcome, validate_dataset, validate_lineage
from tasks.validate.gx_run import run_gx_suite
from tasks.validate.lineage_profile import lineage_inputs, profile_lineage
from tasks.validate.suites import lineage_suite
from tests.finalize.tamper import BatchFiles
from tests.local_batch import LocalBatch, copy_batch

from .batches import row_of
from .conftest import WEIGHT_VERSION

STRICT = ValidationSpec(
    max_poisoned_rate=0.0, max_capture_poisoned_rate=0.0, max_failure_row_rate=0.0, min_declared_terminal_rate=1.0
)
UNPLANNED = "r000099-00"


def shard_calls(files: BatchFiles) -> list[dict]:
    return [row for path in files.files("calls") for row in files.read_rows(path)]


def terminal_child(calls: list[dict], rollout_id: str) -> str:
    """A call of the rollout that has a parent and no child (editing it disturbs no other call)."""
    parents = {c["parent_call_id"] for c in calls}
    return next(
        c["call_id"]
        for c in calls
        if c["rollout_id"] == rollout_id and c["parent_call_id"] is not None and c["call_id"] not in parents
    )


@pytest.fixture(scope="module")
def corrupted(generated_batch: LocalBatch, tmp_path_factory: pytest.TempPathFactory) -> tuple[SuiteOutcome, dict]:
    """Shard 0 corrupted once per expectation (roles below), shard 1's ledger rotten on disk; validated strictly."""
    batch = copy_batch(generated_batch, tmp_path_factory.mktemp("lineage-corrupted"))
    files = BatchFiles(batch.dir, 0)
    calls = shard_calls(files)
    multi = sorted({c["rollout_id"] for c in calls if c["parent_call_id"] is not None})
    single = sorted({c["rollout_id"] for c in calls} - set(multi))
    broken, shifted, late = multi[:3]  # rollouts with children
    missing, duplicated, stale_root, failed = (single + multi[3:])[:4]
    expected: dict[str, set[str]] = {}

    files.drop_receipt(missing)
    expected["one_receipt_per_planned_rollout"] = {missing}

    files.edit_rows(
        files.receipts_file(late), lambda rows: rows.append({**row_of(rows, late), "rollout_id": UNPLANNED})
    )
    expected["receipts_are_planned"] = {UNPLANNED}

    copy = next(c for c in calls if c["rollout_id"] == duplicated)
    files.add_file("calls", [copy])
    for name in ("call_ids_unique", "staging_keys_unique", "staged_rows_unique"):
        expected[name] = {copy["call_id"]}

    orphan = terminal_child(calls, broken)
    files.edit_call(orphan, lambda row: row.update(parent_call_id=f"{broken}.a00.c099"))
    expected["parents_resolve"] = {orphan}

    longer = terminal_child(calls, shifted)
    files.edit_call(longer, lambda row: row.update(prev_len=row["prev_len"] + 1, cum_len=row["cum_len"] + 1))
    expected["prev_len_is_parent_cum_len"] = {longer}

    root = next(c["call_id"] for c in calls if c["rollout_id"] == stale_root and c["parent_call_id"] is None)
    older = terminal_child(calls, late)
    for call in (root, older):
        files.edit_call(call, lambda row: row.update(weight_version=WEIGHT_VERSION - 1))
    expected["weight_versions_at_least_planned"] = {root, older}
    expected["weight_versions_non_decreasing"] = {older}

    files.edit_receipt(late, lambda row: row.update(status="poisoned", failure_reason=STAGING_FAILED))
    expected["poisoned_rollout_rate"] = {late}
    files.edit_receipt(failed, lambda row: row.update(status="failed", failure_reason="agent_exit"))
    expected["failed_rollout_rate"] = {"agent_exit"}  # its examples are the failure reasons

    failed_call = f"{shifted}.a00.c050"
    failure = {
        "batch_id": batch.batch_id,
        "rollout_id": shifted,
        "call_id": failed_call,
        "parent_call_id": None,
        "reason": ENGINE_ERROR,
        "detail": "forged",
    }
    files.add_file("failures", [failure])
    expected["failure_row_rate"] = {failed_call}
    expected["capture_poisoned_rate"] = {late, shifted}

    files.edit_receipt(broken, lambda row: row.update(terminal_selection="heuristic"))
    expected["declared_terminal_rate"] = {broken}

    rotten = BatchFiles(batch.dir, 1)
    rotten.write_bytes(rotten.files("calls")[0], b"not parquet", reseal=False)
    expected["committed_ledgers_verified"] = {"shard-00001"}

    return validate_lineage(batch.handle, thresholds=STRICT), expected


def test_the_corrupted_ledger_fails_exactly_the_violated_expectations(corrupted):
    outcome, expected = corrupted
    failing = {e.name for e in outcome.summary.expectations if not e.success}
    assert failing == set(expected)
    assert outcome.status == "failed" and outcome.success is False
    assert outcome.summary.counts.failed == sum(
        e.severity == "fail" for e in outcome.summary.expectations if not e.success
    )


@pytest.mark.parametrize(
    "name",
    [
        "committed_ledgers_verified",
        "call_ids_unique",
        "staging_keys_unique",
        "staged_rows_unique",
        "parents_resolve",
        "prev_len_is_parent_cum_len",
        "weight_versions_at_least_planned",
        "weight_versions_non_decreasing",
        "failure_row_rate",
        "one_receipt_per_planned_rollout",
        "receipts_are_planned",
        "poisoned_rollout_rate",
        "failed_rollout_rate",
        "capture_poisoned_rate",
        "declared_terminal_rate",
    ],
)
def test_each_violated_expectation_names_its_offending_rows(corrupted, name):
    outcome, expected = corrupted
    (found,) = [e for e in outcome.summary.expectations if e.name == name]
    assert not found.success and found.error is None
    assert set(found.examples) == expected[name]
    assert found.unexpected_count >= len(expected[name])


def test_rates_report_the_observed_rate_against_the_threshold(corrupted):
    outcome, _ = corrupted
    rates = {e.name: e for e in outcome.summary.expectations}
    assert rates["poisoned_rollout_rate"].threshold == 0.0 and rates["poisoned_rollout_rate"].observed > 0
    assert rates["failed_rollout_rate"].threshold == 0.0 and rates["failed_rollout_rate"].unexpected_count == 1
    declared = rates["declared_terminal_rate"]
    assert declared.threshold == 1.0 and 0 < declared.observed < 1  # the share that was declared
    assert rates["weight_versions_at_least_planned"].threshold == WEIGHT_VERSION


def test_rules_the_ledger_reader_enforces_fail_on_a_corrupted_profile(generated_batch, tmp_path, monkeypatch):
    """Digests are corrupted in the ledger tables the profile reads (a reader letting them through); lengths and
    root rules in the profile itself."""
    store = generated_batch.store
    calls = LedgerReader(store, 0).tables.calls.to_pylist()
    digest_edits = {
        "digests_well_formed": (calls[2], {"digest": calls[2]["digest"].upper()}),
        "extras_digests_well_formed": (calls[3], {"extras_digest": calls[3]["extras_digest"][:63]}),
        "chain_hashes_well_formed": (calls[4], {"chain_hash": "not-a-digest"}),
        "cumulative_hashes_well_formed": (calls[5], {"cumulative_hash": calls[5]["cumulative_hash"] + "\n"}),
    }
    for row, change in digest_edits.values():
        row.update(change)

    class LenientReader(LedgerReader):
        def __init__(self, store: ObjectStore, shard: int) -> None:
            super().__init__(store, shard)
            if shard == 0:
                forged = pa.Table.from_pylist(calls, schema=self.tables.calls.schema)
                self.tables = dataclasses.replace(self.tables, calls=forged)

    monkeypatch.setattr(Batch, "ledger", lambda batch, shard: LenientReader(batch.store, shard))
    batch = generated_batch.handle
    tables = profile_lineage(batch, lineage_inputs(batch))
    rows = tables["calls"].to_pylist()
    roots = [c for c in rows if not c["has_parent"]]
    edits = {
        "cum_len_is_prev_len_plus_delta_len": (rows[0], {"cum_len": rows[0]["cum_len"] + 1}),
        "root_iff_no_parent": (roots[1], {"mode": "token_in"}),
    }
    for row, change in edits.values():
        row.update(change)
    tables["calls"] = pa.Table.from_pylist(rows, schema=tables["calls"].schema)
    suite = lineage_suite(ValidationSpec(), weight_version=WEIGHT_VERSION)
    results = run_gx_suite(suite, tables, site_dir=tmp_path / "docs", run_name="run-000")
    assert {name for name, r in results.items() if not r.success} == set(edits) | set(digest_edits)
    for name, (row, _) in (edits | digest_edits).items():
        assert results[name].examples == (row["call_id"],), name
    assert (tmp_path / "docs" / "index.html").is_file()


def test_a_batch_missing_a_shard_only_warns_in_both_suites(generated_batch, tmp_path):
    batch = copy_batch(generated_batch, tmp_path)
    (batch.dir / layout.shard_marker(1)).unlink()
    lineage = validate_lineage(batch.handle)
    finalize_batch(batch.handle, FinalizeOptions(allow_partial=True))
    dataset = validate_dataset(batch.handle)
    for outcome, name in ((lineage, "all_shards_committed"), (dataset, "dataset_complete")):
        assert (outcome.status, outcome.success) == ("warned", True)
        assert [(e.name, e.severity, e.examples) for e in outcome.summary.expectations if not e.success] == [
            (name, "warn", ("shard-00001",))
        ]
        assert (outcome.summary.counts.failed, outcome.summary.counts.warned) == (0, 1)


@pytest.mark.parametrize(
    ("max_rate", "failed", "poisoned", "failed_passes", "poisoned_passes"),
    [
        (0.2, 10, 0, False, True),  # only failed: failed_rollout_rate alone fails
        (0.2, 0, 3, True, False),
        (0.2, 1, 1, True, True),  # together 0.2: at the bound
        (0.3, 1, 2, True, True),  # 0.3 - 0.1 is 0.19999999999999998 before rounding
        (0.2, 1, 2, True, False),  # together 0.3 > 0.2: the poisoned ones are flagged
        (0.2, 3, 1, False, False),
    ],
)
def test_max_poisoned_rate_bounds_failed_and_poisoned_receipts_together(
    max_rate, failed, poisoned, failed_passes, poisoned_passes
):
    """Of 10 receipts: the two rates fail together exactly when failed + poisoned > max_poisoned_rate."""
    from tasks.validate.lineage_profile import failed_share
    from tasks.validate.suites import poisoned_bound

    rollouts = pa.table(
        {
            "poisoned": [True] * poisoned + [False] * (10 - poisoned) + [None],
            "failed_reason": [""] * poisoned + ["agent_exit"] * failed + [""] * (10 - poisoned - failed) + [None],
        }
    )
    share = failed_share(rollouts)
    assert share == failed / 10
    bound = poisoned_bound(max_rate, share)
    assert (failed / 10 <= max_rate) is failed_passes
    # GX's mostly: the share of checked rows that kept the rule is at least 1 - bound
    assert ((10 - poisoned) / 10 >= 1.0 - bound) is poisoned_passes
