"""`rollout-ledger status` over real batches on local disk and S3 (moto), made with the fake engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import Any, NamedTuple

import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.config import BatchConfig, ModelSpec, ValidationSpec
from tasks.errors import ConfigError, EngineError, PublishRefusedError
from tasks.finalize.stage import FinalizeOptions
from tasks.generate import generate_shard
from tasks.pipeline import decide_and_report, finalize_and_publish, run_suite
from tasks.plan import plan_batch
from tasks.publish import publish_batch
from tasks.records.ledger import RESUMED_NOTE, SERVED_BY_NOTE, Receipt, canonical_json
from tasks.records.review import new_decision
from tasks.sampling import SamplingSettings
from tasks.status.gather import batch_status
from tasks.status.model import AttemptStatus, ResumeCounts
from tasks.status.render import render_status
from tasks.status.shards import receipt_notes
from tasks.storage.claims import claim_attempt
from tasks.storage.marker import read_marker
from tasks.storage.objects import ObjectStore

from .generation.fakes import FakeScriptedEngine
from .validate.batches import generate_killed_then_resumed

BATCH = "b-status"
HOUR = 3600.0


class Root(NamedTuple):
    url: str
    options: dict[str, Any]

    def store(self) -> ObjectStore:
        return Batch.open(self.url, BATCH, self.options).store


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> Root:
    if request.param == "local":
        return Root(str(tmp_path / "runs"), {})
    bucket = request.getfixturevalue("s3_bucket")
    endpoint = request.getfixturevalue("s3_endpoint")
    return Root(f"{bucket}/runs", {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True})


def make_config(**overrides: Any) -> BatchConfig:
    fields = {
        "batch_id": BATCH,
        "environment": "arithmetic",
        "num_tasks": 4,
        "group_size": 2,
        "shards": 2,
        "model": ModelSpec(reference="fake-model"),
        "sampling": SamplingSettings(temperature=1.0, max_tokens=16),
        "max_turns": 1,
        "max_in_flight": 4,
        "code_version": "rollout-ledger test",
    } | overrides
    return BatchConfig(**fields)


def fail_second_samples(request) -> EngineError | None:
    """Every rollout with sample index 1 (``r......-01``) gets an engine error: one failure row, poisoned."""
    return EngineError("device lost") if request.request_id.split(".")[0].endswith("-01") else None


def generate(root: Root, shard: int, tokenizer, *, weight_version: int = 0, **engine_options: Any) -> None:
    engine = FakeScriptedEngine(tokenizer, reply=lambda request: "The answer is 7.", **engine_options)
    for _ in range(weight_version):
        asyncio.run(engine.update_weights("refit"))
    generate_shard(Batch.open(root.url, BATCH, root.options), shard, engine=engine, run=asyncio.run, progress=False)


def snapshot(root: Root) -> dict[str, bytes]:
    store = root.store()
    return {path: store.read_bytes(path) for path in store.list_files()}


def test_a_never_planned_batch_is_refused_naming_the_url_and_the_plan_command(tmp_path):
    url = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=rf"{re.escape(url)}/batches/{BATCH}/plan/batch.json.*rollout-ledger plan"):
        batch_status(Batch.open(url, BATCH))
    assert not (tmp_path / "nowhere").exists()


def test_a_planned_batch_reports_its_plan_and_every_shard_not_started(root):
    config = make_config(weight_version=3)
    plan_batch(Batch.open(root.url, config.batch_id, root.options), config)
    before = snapshot(root)
    status = batch_status(Batch.open(root.url, BATCH, root.options))
    assert snapshot(root) == before
    plan = status.plan
    assert (plan.environment, plan.model_reference, plan.num_tasks, plan.group_size, plan.shards) == (
        "arithmetic",
        "fake-model",
        4,
        2,
        2,
    )
    assert (plan.rollouts, plan.weight_version, plan.code_version) == (8, 3, "rollout-ledger test")
    assert [(s.shard, s.state, s.attempts) for s in status.shards] == [(0, "not_started", ()), (1, "not_started", ())]
    assert (status.totals.committed_shards, status.totals.rollouts, status.totals.weight_version_min) == (0, 0, None)
    assert (status.dataset.state, status.reports.objects, status.reports.index) == ("none", (), None)
    assert status.next_step == f"run `rollout-ledger generate --root {root.url} --batch-id {BATCH} --shard 0 --shard 1`"
    as_dict = status.to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert as_dict["plan"]["weights_sha256"] == ""
    assert [s["state"] for s in as_dict["shards"]] == ["not_started", "not_started"]


def test_a_committed_shard_and_an_abandoned_attempt(root, tokenizer):
    config = make_config(weight_version=7)
    plan_batch(Batch.open(root.url, config.batch_id, root.options), config)
    generate(root, 0, tokenizer, weight_version=7, fail=fail_second_samples)
    store = root.store()
    claim = claim_attempt(store, batch_id=BATCH, shard=1, try_number=3, code_version="rollout-ledger test")
    marker = read_marker(store, 0)
    assert marker is not None

    status = batch_status(Batch.open(root.url, BATCH, root.options), now=claim.started_at + HOUR)

    committed, abandoned = status.shards
    assert (committed.state, committed.error, committed.attempts) == ("committed", None, ())
    assert committed.committed is not None
    assert (committed.committed.attempt, committed.committed.counts) == (0, marker.counts)
    assert (marker.counts.rollouts, marker.counts.ok, marker.counts.poisoned) == (4, 2, 2)
    assert committed.committed.failures_by_reason == {"engine_error": 2}
    assert committed.committed.poisoned_by_reason == {"engine_error": 2}
    assert (committed.committed.weight_version_min, committed.committed.weight_version_max) == (7, 7)
    empty = {"staging": 0, "calls": 0, "failures": 0, "receipts": 0}
    assert (abandoned.state, abandoned.committed) == ("abandoned", None)
    assert abandoned.attempts == (AttemptStatus(attempt=0, claim=claim, objects=empty, last_activity=claim.started_at),)
    totals = status.totals
    assert (totals.committed_shards, totals.rollouts, totals.ok, totals.poisoned, totals.failed) == (1, 4, 2, 2, 0)
    assert (totals.calls, totals.calls_recorded, totals.failure_rows) == (
        marker.counts.calls_used,
        marker.counts.calls_recorded,
        2,
    )
    assert committed.committed.calls == marker.counts.calls_used
    assert (totals.failures_by_reason, totals.poisoned_by_reason) == ({"engine_error": 2}, {"engine_error": 2})
    assert (totals.weight_version_min, totals.weight_version_max) == (7, 7)
    assert status.next_step == f"run `rollout-ledger generate --root {root.url} --batch-id {BATCH} --shard 1`"

    text = render_status(status)
    assert (
        "shard 0   committed   attempt 0: 4 rollouts (2 ok, 2 poisoned, 0 failed, 0 adopted), "
        f"{totals.calls} calls used, {totals.calls_recorded} recorded, 2 failure rows" in text
    )
    assert f"shard 1   abandoned\n    attempt 0: claimed by {claim.host} pid {claim.pid} at " in text
    assert "(try 3); left 0 staging, 0 calls, 0 failures, 0 receipts object(s)" in text
    assert "weight versions 7..7" in text
    assert "failures by reason: engine_error 2\n  poisoned by reason: engine_error 2" in text
    assert text.endswith(f"next step: {status.next_step}\n")

    live = batch_status(Batch.open(root.url, BATCH, root.options), now=claim.started_at + 1)
    assert live.shards[1].state == "in_progress"
    assert live.next_step == "wait for shard(s) [1] in progress, then run status again"


def test_a_finalized_batch_is_published_and_needs_nothing_more(root, tokenizer):
    config = make_config()
    plan_batch(Batch.open(root.url, config.batch_id, root.options), config)
    for shard in (0, 1):
        generate(root, shard, tokenizer)
    published = finalize_and_publish(Batch.open(root.url, BATCH, root.options), FinalizeOptions(audit=False)).published
    assert published is not None

    status = batch_status(Batch.open(root.url, BATCH, root.options))

    assert [s.state for s in status.shards] == ["committed", "committed"]
    assert (status.totals.rollouts, status.totals.ok, status.totals.failures_by_reason) == (8, 8, {})
    dataset = status.dataset
    assert (dataset.state, dataset.partial, dataset.missing_shards) == ("published", False, ())
    assert (dataset.rows, dataset.trainable_rows, dataset.groups) == (
        published.marker.rows,
        published.marker.trainable_rows,
        4,
    )
    assert dataset.rows == 8
    assert status.next_step == "nothing to run: the dataset is published"
    assert "dataset: published; 8 rows" in render_status(status)


def test_a_partial_dataset_names_its_missing_shards_and_awaits_review(tmp_path, tokenizer):
    root = Root(str(tmp_path / "runs"), {})
    config = make_config()
    plan_batch(Batch.open(root.url, config.batch_id, root.options), config)
    generate(root, 0, tokenizer)
    with pytest.raises(PublishRefusedError, match="needs review"):
        finalize_and_publish(Batch.open(root.url, BATCH), FinalizeOptions(audit=False, allow_partial=True))

    waiting = batch_status(Batch.open(root.url, BATCH))

    assert waiting.dataset.suites == {"lineage": "warned", "dataset": "warned"}  # partial: a warning, not a failure
    assert [s.state for s in waiting.shards] == ["committed", "not_started"]
    assert (waiting.dataset.state, waiting.dataset.partial, waiting.dataset.missing_shards) == (
        "awaiting_review",
        True,
        (1,),
    )
    assert waiting.next_step == (
        "read the validation reports (reports/index.html) and decide: `rollout-ledger publish "
        f"--root {root.url} --batch-id {BATCH} --approve --reason TEXT` or `--reject --reason TEXT` "
        "(or answer the run's Airflow review task)"
    )
    approval = new_decision(BATCH, "publish", "shard 1 was a bad node", decided_by="dana", via="cli", now=HOUR)
    decide_and_report(Batch.open(root.url, BATCH), approval)
    publish_batch(Batch.open(root.url, BATCH))

    status = batch_status(Batch.open(root.url, BATCH))

    assert (status.dataset.state, status.dataset.review) == ("published", approval)
    assert status.next_step == "nothing to run: the dataset is published without shard(s) [1]"
    text = render_status(status)
    assert "PARTIAL: missing shard(s) [1]" in text
    assert "  review: publish by dana (cli) at 1970-01-01T01:00:00Z: shard 1 was a bad node" in text
    assert status.to_dict()["dataset"]["review"]["decided_by"] == "dana"


def test_corrupt_markers_and_claims_are_reported_not_raised(tmp_path, tokenizer):
    root = Root(str(tmp_path / "runs"), {})
    config = make_config(shards=3)
    plan_batch(Batch.open(root.url, config.batch_id, root.options), config)
    generate(root, 0, tokenizer)
    store = root.store()
    store.write_once(layout.shard_marker(1), b"{not json")
    store.write_once(layout.attempt_claim(2, 0), b'{"host": "h"}')
    store.write_once(layout.DATASET_MARKER, b"[]")

    status = batch_status(Batch.open(root.url, BATCH))

    committed, bad_marker, bad_claim = status.shards
    assert committed.state == "committed"
    assert bad_marker.state == "unreadable"
    assert bad_marker.error is not None and bad_marker.error.startswith("MalformedMarkerError: ")
    assert "ledger/shard-00001/_COMMITTED.json is not valid JSON" in bad_marker.error
    assert bad_claim.state == "unreadable"
    assert bad_claim.error is not None and bad_claim.error.startswith("MalformedClaimError: ")
    assert "ledger/shard-00002/attempt-00/_CLAIM.json: missing field(s) ['attempt'" in bad_claim.error
    assert (status.dataset.state, status.totals.committed_shards) == ("unreadable", 1)
    assert status.dataset.error is not None and "MalformedDatasetMarkerError" in status.dataset.error
    assert status.next_step.startswith("inspect shard(s) [1, 2]")
    text = render_status(status)
    assert "shard 1   unreadable MalformedMarkerError: " in text
    assert "shard 2   unreadable MalformedClaimError: " in text


def test_a_staged_dataset_is_judged_by_its_validation_runs(tmp_path, tokenizer):
    root = Root(str(tmp_path / "runs"), {})
    config = make_config(shards=1)
    plan_batch(Batch.open(root.url, config.batch_id, root.options), config)
    generate(root, 0, tokenizer)
    finalize_and_publish(Batch.open(root.url, BATCH), FinalizeOptions(audit=False), publish=False)

    staged = batch_status(Batch.open(root.url, BATCH))
    assert (staged.dataset.state, staged.dataset.suites, staged.dataset.partial) == (
        "staged",
        {"lineage": "passed"},
        False,
    )
    finalize = f"run `rollout-ledger finalize --root {root.url} --batch-id {BATCH}`"
    assert staged.next_step == f"{finalize} to validate and publish the staged dataset"

    impossible = ValidationSpec(reward_min=5.0)  # every reward is below: the dataset suite fails the batch
    assert run_suite("dataset", Batch.open(root.url, BATCH), thresholds=impossible).status == "failed"
    failed = batch_status(Batch.open(root.url, BATCH))
    assert (failed.dataset.state, failed.dataset.suites) == (
        "validation_failed",
        {"lineage": "passed", "dataset": "failed"},
    )
    assert failed.reports.index == "reports/index.html"
    assert (
        failed.next_step
        == "read the validation reports (reports/index.html): validation failed, so nothing was published"
    )
    text = render_status(failed)
    assert (
        "dataset: validation_failed; 8 rows (8 trainable) in 4 groups; validation lineage passed, dataset failed"
        in text
    )
    assert f"{failed.url}/reports/index.html" in text


def test_a_resumed_shard_counts_what_its_rollouts_replayed_and_the_totals_sum_it(tmp_path, tokenizer):
    root = Root(str(tmp_path / "runs"), {})
    config = make_config(environment="guess_number", environment_options={"lo": 1, "hi": 8}, max_turns=4)
    plan_batch(Batch.open(root.url, config.batch_id), config)
    summary = generate_killed_then_resumed(
        Batch.open(root.url, BATCH), 0, tokenizer, crash_after=6, reply=lambda r: str(r.seed % 8 + 1)
    )
    generate(root, 1, tokenizer)

    status = batch_status(Batch.open(root.url, BATCH))

    resumed = ResumeCounts(
        rollouts=summary.resumed,
        replayed_calls=summary.replayed_calls,
        live_calls=summary.live_calls,
        divergences=summary.divergences,
    )
    assert resumed.rollouts > 0 and resumed.replayed_calls > 0 and resumed.live_calls > 0
    assert resumed.divergences == 0
    resumed_shard, plain_shard = (s.committed for s in status.shards)
    assert resumed_shard is not None and plain_shard is not None
    assert (resumed_shard.attempt, resumed_shard.resumed, plain_shard.resumed) == (1, resumed, ResumeCounts())
    assert status.totals.resumed == resumed
    as_dict = status.to_dict()
    assert as_dict["shards"][0]["committed"]["resumed"] == dataclasses.asdict(resumed)
    assert as_dict["shards"][1]["committed"]["resumed"] == dataclasses.asdict(ResumeCounts())
    assert as_dict["totals"]["resumed"] == dataclasses.asdict(resumed)

    lines = render_status(status).splitlines()
    line = (  # counts of zero (divergences, replays refused) are left out
        f"resumed {resumed.rollouts} rollout(s): {resumed.replayed_calls} call(s) replayed, "
        f"{resumed.live_calls} sampled live after a replay"
    )
    shard_0 = next(i for i, text in enumerate(lines) if text.startswith("  shard 0 "))
    assert lines[shard_0 + 1] == f"    {line}"
    assert lines[shard_0 + 2].startswith("  shard 1 ")  # it resumed nothing: no line
    totals = next(i for i, text in enumerate(lines) if text.startswith("  poisoned by reason: "))
    assert lines[totals + 1] == f"  {line}"
    assert sum(text.lstrip().startswith("resumed ") for text in lines) == 2
    every = ResumeCounts(rollouts=2, replayed_calls=3, live_calls=4, divergences=1, replays_refused=1)
    text = render_status(dataclasses.replace(status, totals=dataclasses.replace(status.totals, resumed=every)))
    assert (
        "\n  resumed 2 rollout(s): 3 call(s) replayed, 4 sampled live after a replay, 1 divergence(s), "
        "1 replay(s) refused\n" in text
    )


def _receipt(rollout_id: str, info: dict[str, Any]) -> Receipt:
    """An ok receipt of a resumed rollout whose reward info holds ``info``."""
    return Receipt(
        rollout_id=rollout_id,
        group_id="g000000",
        attempt=1,
        reward=1.0,
        reward_info=canonical_json(info),
        terminal_call_id=f"{rollout_id}.a01.c001",
        terminal_selection="declared",
        terminal_attribution_reason=None,
        status="ok",
        failure_reason=None,
        num_calls=2,
        replayed_calls=(f"{rollout_id}.a00.c000",),
    )


def test_resume_notes_are_summed_and_a_malformed_note_counts_nothing():
    diverged = {"episode": 1, "replayed": 2, "live": 3, "diverged": 1}
    refused = {"episode": 2, "replayed": 0, "live": 4, "diverged": 0, "could_not_replay": ["replay_refused: a", "b"]}
    malformed = [
        [1, 2, 3, 1],
        "resumed",
        {**diverged, "replayed": -1},
        {**diverged, "live": True},
        {**diverged, "diverged": 1.0},
        {**diverged, "episode": "1"},
        {key: value for key, value in diverged.items() if key != "episode"},
        {**diverged, "could_not_replay": "replay_refused"},
        {**diverged, "could_not_replay": [3]},
        None,
    ]
    infos = [{"reward": 1.0, RESUMED_NOTE: diverged}, {RESUMED_NOTE: refused}, {"reward": 0.0}]
    infos += [{SERVED_BY_NOTE: {"http://a:8000": 2}, RESUMED_NOTE: note} for note in malformed]
    receipts = [_receipt(f"r{i:06d}-00", info) for i, info in enumerate(infos)]

    notes = receipt_notes(r.reward_info for r in receipts)

    assert notes.resumed == ResumeCounts(rollouts=2, replayed_calls=2, live_calls=7, divergences=1, replays_refused=2)
    assert notes.calls_by_server == {"http://a:8000": 2 * len(malformed)}  # the other notes still count
    assert notes.rollouts_failed_over == 0
