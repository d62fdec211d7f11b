"""``replayed_calls_staged_once``: the calls a resumed rollout's receipt replayed are call records of earlier attempts,
and none was staged again by its own attempt.

A batch whose rollouts resumed after a killed attempt passes it, every replayed call found. A copy whose ledger was
tampered with fails it, naming each tampered rollout: an own-attempt call carrying a replayed call's chain hash (a
committed call re-sampled: the same parent chain and tokens), and receipts naming as replayed a call no attempt
recorded, a call of their own attempt, or another rollout's call; finalize refuses those three as
``missing_replayed_call`` (resealed: the markers vouch for the edited files, so the ledger reader reads them).
"""

from __future__ import annotations

import pytest

from tasks.finalize.reasons import MISSING_REPLAYED_CALL
from tasks.finalize.verify.chains import shard_chains
from tasks.records.ledger import CallRecord, Receipt
from tasks.storage.ledger_reader import LedgerReader
from tasks.validate import SuiteOutcome, validate_lineage
from tasks.validate.lineage_profile import lineage_inputs, profile_lineage
from tests.finalize.tamper import BatchFiles
from tests.local_batch import LocalBatch, copy_batch

EXPECTATION = "replayed_calls_staged_once"


def own_calls(calls: list[CallRecord], receipt: Receipt) -> list[CallRecord]:
    """The rollout's calls recorded by its receipt's own attempt (a call id names its attempt)."""
    tag = f".a{receipt.attempt:02d}."
    return [c for c in calls if c.rollout_id == receipt.rollout_id and tag in c.call_id]


def test_a_resumed_batch_passes_with_every_replayed_call_found_once(resumed_batch: LocalBatch, tmp_path):
    batch = copy_batch(resumed_batch, tmp_path)
    ledger = LedgerReader(batch.store, 0)
    replayed = {r.rollout_id: len(r.replayed_calls) for r in ledger.receipts}
    assert sum(n > 0 for n in replayed.values()) >= 4  # the rule has rows to check
    assert any(r.replayed_calls and own_calls(ledger.calls, r) for r in ledger.receipts)  # replayed, then live

    profile = profile_lineage(batch.handle, lineage_inputs(batch.handle))["rollouts"].to_pylist()
    counts = {row["rollout_id"]: (row["replayed"], row["replayed_found"], row["restaged"]) for row in profile}
    assert counts == {rollout: (n, n, 0) for rollout, n in replayed.items()}

    outcome = validate_lineage(batch.handle)
    assert outcome.status == "passed"
    (found,) = [e for e in outcome.summary.expectations if e.name == EXPECTATION]
    assert (found.success, found.severity, found.observed, found.unexpected_count) == (True, "fail", 0.0, 0)


@pytest.fixture(scope="module")
def tampered(
    resumed_batch: LocalBatch, tmp_path_factory: pytest.TempPathFactory
) -> tuple[SuiteOutcome, dict[str, str], LocalBatch]:
    """A copy of the resumed batch with one tampering per resumed rollout (roles below), validated once."""
    batch = copy_batch(resumed_batch, tmp_path_factory.mktemp("replayed-tampered"))
    files = BatchFiles(batch.dir, 0)
    ledger = LedgerReader(batch.store, 0)
    calls = ledger.calls
    resumed = sorted(
        (r for r in ledger.receipts if r.replayed_calls and own_calls(calls, r)), key=lambda r: r.rollout_id
    )
    restaged, unrecorded, own_named, borrowed = resumed[:4]

    copied = files.call(restaged.replayed_calls[-1])[2]["chain_hash"]
    files.edit_call(own_calls(calls, restaged)[0].call_id, lambda row: row.update(chain_hash=copied))

    def name_replayed(receipt: Receipt, call_id: str) -> None:
        files.edit_receipt(receipt.rollout_id, lambda row: row["replayed_calls"].append(call_id))

    name_replayed(unrecorded, f"{unrecorded.rollout_id}.a00.c099")
    name_replayed(own_named, own_calls(calls, own_named)[-1].call_id)
    name_replayed(borrowed, restaged.replayed_calls[0])

    roles = {
        restaged.rollout_id: "restaged",
        unrecorded.rollout_id: "unrecorded",
        own_named.rollout_id: "own_named",
        borrowed.rollout_id: "borrowed",
    }
    return validate_lineage(batch.handle), roles, batch


def test_a_restaged_or_missing_replayed_call_fails_the_suite_naming_its_rollout(tampered):
    outcome, roles, _ = tampered
    assert outcome.status == "failed"
    assert [e.name for e in outcome.summary.expectations if not e.success] == [EXPECTATION]
    (found,) = [e for e in outcome.summary.expectations if e.name == EXPECTATION]
    assert (found.severity, found.error, found.unexpected_count) == ("fail", None, len(roles))
    assert set(found.examples) == set(roles)


def test_the_profile_counts_what_each_tampering_broke(tampered):
    _, roles, batch = tampered
    profile = profile_lineage(batch.handle, lineage_inputs(batch.handle))["rollouts"].to_pylist()
    broken = {
        roles[row["rollout_id"]]: (row["replayed"] - row["replayed_found"], row["restaged"])
        for row in profile
        if row["rollout_id"] in roles
    }
    assert broken == {"restaged": (0, 1), "unrecorded": (1, 0), "own_named": (1, 0), "borrowed": (1, 0)}


def test_finalize_refuses_the_receipts_whose_replayed_call_is_missing(tampered):
    _, roles, batch = tampered
    ledger = LedgerReader(batch.store, 0)
    chains = shard_chains(ledger.tables, ledger.receipts)
    reasons = {r.rollout_id: reason for r, reason in zip(ledger.receipts, chains.reasons, strict=True)}
    missing = {rollout for rollout, role in roles.items() if role != "restaged"}
    assert {rollout for rollout, reason in reasons.items() if reason == MISSING_REPLAYED_CALL} == missing


def test_recovery_finalize_and_the_suite_agree_on_which_manifests_are_incomplete(tampered):
    """One rule (tasks/storage/rollout_manifest.py), one policy: recovery adopts the receipts as they are (no raise),
    naming them incomplete; finalize masks exactly those; the suite counts exactly those as missing a call."""
    _, roles, batch = tampered
    ledger = LedgerReader(batch.store, 0)
    incomplete = {bundle.rollout_id for bundle in ledger.rollouts() if not bundle.complete}
    chains = shard_chains(ledger.tables, ledger.receipts)
    masked = {r.rollout_id for r, reason in zip(ledger.receipts, chains.reasons, strict=True) if reason}
    profile = profile_lineage(batch.handle, lineage_inputs(batch.handle))["rollouts"].to_pylist()
    counted = {row["rollout_id"] for row in profile if (row["replayed"] or 0) != (row["replayed_found"] or 0)}
    assert incomplete == masked == counted == {rollout for rollout, role in roles.items() if role != "restaged"}
