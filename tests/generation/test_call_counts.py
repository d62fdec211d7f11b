"""Counts that mean one thing (issue 45): every surface reports the calls a shard's rollouts use, and the call
records its marker names (those no rollout uses included) apart, under ``calls_recorded``.

The shard: guess_number on the fake engine, killed after 20 answers (some rollouts receipted, others left
with committed calls in the same ledger files), then generated again with the environment answering
differently after the first turn, so each resumed rollout replays its first call and diverges from the rest:
the calls past the divergence stay in the named files, in no manifest.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.config import BatchConfig, ModelSpec
from tasks.engines.base import GenerationRequest
from tasks.generate import generate_shard
from tasks.generate.console import shard_lines, summaries_json
from tasks.generate.summary import ShardSummary
from tasks.lineage.datasets import generate_lineage
from tasks.plan import plan_batch
from tasks.records.ledger import Receipt
from tasks.sampling import SamplingSettings
from tasks.status.gather import batch_status
from tasks.status.render import render_status
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.marker import calls_in_manifests

from .fakes import FakeScriptedEngine, FatalEngineCrash

BATCH = "b-counts"
ANSWERS_BEFORE_THE_KILL = 20


def _reply(request: GenerationRequest) -> str:
    return str(request.seed % 8 + 1)  # guess_number over 1..8: some rollouts end early, so files mix rollouts


def _config() -> BatchConfig:
    return BatchConfig(
        batch_id=BATCH,
        environment="guess_number",
        environment_options={"lo": 1, "hi": 8},
        num_tasks=3,
        group_size=3,
        shards=1,
        model=ModelSpec(reference="fake-model"),
        sampling=SamplingSettings(temperature=1.0, max_tokens=16),
        max_turns=4,
        max_in_flight=9,
    )


def _generate(root: Path, engine: FakeScriptedEngine) -> ShardSummary:
    return generate_shard(Batch.open(str(root), BATCH), 0, engine=engine, run=asyncio.run, progress=False)


@pytest.fixture(scope="module")
def resumed(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ShardSummary]:
    """The batch root and the summary of the run that committed the shard (attempt 1)."""
    root = tmp_path_factory.mktemp("call-counts")
    plan_batch(Batch.open(str(root), BATCH), _config())
    answered: list[str] = []

    def die(request: GenerationRequest) -> BaseException | None:
        answered.append(request.request_id)
        return FatalEngineCrash("process died") if len(answered) > ANSWERS_BEFORE_THE_KILL else None

    with pytest.raises(FatalEngineCrash):
        _generate(root, FakeScriptedEngine(tokenizer, reply=_reply, fail=die))
    from tasks.environments import guess_number

    original = guess_number.GuessNumber.step

    def changed(self, task, messages):  # a changed tool result: the second turn's prompt differs now
        turn = original(self, task, messages)
        if turn.done:
            return turn
        return type(turn)(**{**turn.__dict__, "messages": [{"role": "user", "content": "Again, a number please."}]})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(guess_number.GuessNumber, "step", changed)
        summary = _generate(root, FakeScriptedEngine(tokenizer, reply=_reply))
    return root, summary


def test_every_surface_reports_the_calls_the_rollouts_use_and_the_recorded_ones_apart(resumed):
    root, summary = resumed
    batch = Batch.open(str(root), BATCH)
    ledger = LedgerReader(batch.store, 0)
    marker = ledger.marker
    # What the figures are, found without the manifest rule: every named call record, and each receipt's calls.
    recorded = len(ledger.calls)
    used = sum(receipt.num_calls for receipt in ledger.receipts)  # replayed + own, every manifest complete
    assert summary.attempt == 1 and summary.resumed > 0 and summary.replayed_calls > 0 and summary.divergences > 0
    assert marker.counts.adopted_rollouts > 0
    assert recorded > used > len([c for c in ledger.calls if ".a01." in c.call_id])  # replayed calls are used
    print(f"\ncalls used {used}, recorded {recorded}")

    # The marker (version 2): the row sum and the used figure, which the reader recounts from the named files.
    assert marker.marker_version == 2
    assert (marker.counts.calls_used, marker.counts.calls_recorded) == (used, recorded)
    assert ledger.calls_used == used
    raw = json.loads(batch.store.read_bytes(layout.shard_marker(0)))["counts"]
    assert (raw["calls_used"], raw["calls_recorded"]) == (used, recorded) and "calls" not in raw

    # The shard summary: JSON and lines (the run that committed, and a run that finds it committed).
    (as_json,) = json.loads(summaries_json([summary]))
    assert (as_json["calls"], as_json["calls_recorded"]) == (used, recorded)
    assert f"adopted, {used} calls used, {recorded} recorded, " in shard_lines(summary)[0]
    again = ShardSummary.of_marker(marker)
    assert (again.calls, again.calls_recorded) == (used, recorded)
    assert shard_lines(again)[0] == f"shard 0: already committed by attempt 1: {used} calls used, {recorded} recorded"

    # Status: per shard and in the totals, JSON and text.
    status = batch_status(batch)
    (shard,) = status.shards
    assert shard.committed is not None and shard.committed.calls == used
    assert (status.totals.calls, status.totals.calls_recorded) == (used, recorded)
    totals = status.to_dict()["totals"]
    assert (totals["calls"], totals["calls_recorded"]) == (used, recorded)
    text = render_status(status)
    assert f"adopted), {used} calls used, {recorded} recorded, " in text
    assert f"failed), {used} calls used, {recorded} recorded, " in text

    # Lineage: the ledger's output statistics count the calls used.
    (ledger_out, _) = generate_lineage(batch, 0).outputs
    assert ledger_out.outputFacets["outputStatistics"].rowCount == used


def test_a_marker_whose_used_calls_disagree_with_its_ledger_makes_the_shard_unreadable(resumed, tmp_path):
    root, _ = resumed
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    path = copy / "batches" / BATCH / layout.shard_marker(0)
    raw = json.loads(path.read_text())
    raw["counts"]["calls_used"] -= 1  # still a valid marker: at most calls_recorded
    path.write_text(json.dumps(raw, sort_keys=True, separators=(",", ":")))
    (shard,) = batch_status(Batch.open(str(copy), BATCH)).shards
    assert shard.state == "unreadable"
    assert f"counts.calls_used is {raw['counts']['calls_used']}, the manifests of its receipts hold" in str(shard.error)


def test_a_call_two_manifests_name_counts_once():
    """The rule finds a replayed call by (rollout, call): listed twice, it is one row, counted once."""
    calls = pa.table({"rollout_id": ["r1", "r1", "r1", "r2"], "call_id": ["r1.a00.c000", "r1.a00.c001", "x", "y"]})
    attempts = np.array([0, 0, 1, 1], np.int64)
    twice = Receipt.to_table(
        [
            Receipt(
                rollout_id="r1",
                group_id="g000000",
                attempt=1,
                reward=1.0,
                reward_info="{}",
                terminal_call_id="x",
                terminal_selection="declared",
                terminal_attribution_reason=None,
                status="ok",
                failure_reason=None,
                num_calls=3,
                replayed_calls=("r1.a00.c000", "r1.a00.c000"),
            )
        ]
    )
    assert calls_in_manifests(calls, attempts, twice) == 2  # c000 once and x; c001 (not replayed) and r2's y unused
