"""Which weights sampled each weight version (``weights_by_version``), judged from the calls' extras: per batch
(metrics, card) and per dataset row.

A version is verified only when every call naming it names one sha256 (the batch's calls; a row's
own calls); a call that names nothing takes the plan's check at the planned version and nothing
elsewhere. The card names each version with its sha256 or as declared, not verified, and says why.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pyarrow as pa

from tasks.batch import Batch
from tasks.config import ModelSpec
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.finalize.weights import MALFORMED, NOT_HASHED, NOT_NAMED, BatchWeights, PlannedWeights
from tasks.generate import generate_shard
from tasks.models.provenance import WEIGHTS_DECLARED, WEIGHTS_VERIFIED, weights_extras
from tasks.plan import plan_batch
from tasks.records.dataset_row import DatasetRow, VersionWeights
from tasks.records.ledger import canonical_json

from .conftest import guess_number_config
from .rollouts import assemble, batch_config, make_rollout, rows_of
from .test_publish import card_of

PLANNED, REFIT, OTHER = "11" * 32, "22" * 32, "33" * 32


def planned_config(weights: str = WEIGHTS_VERIFIED):
    """The test batch's config, its model's weights hashed as ``PLANNED`` and known as ``weights``."""
    config = batch_config()
    return dataclasses.replace(config, model=dataclasses.replace(config.model, weights_sha256=PLANNED, weights=weights))


def staged(*calls: tuple[int, object]) -> pa.Table:
    """Staged rows of calls: (admission version, extras as the engine gave them)."""
    return pa.table(
        {
            "weight_version": pa.array([version for version, _ in calls], pa.uint64()),
            "extras_json": [canonical_json(extras) for _, extras in calls],
        }
    )


def test_each_version_is_verified_only_when_all_its_calls_name_one_sha256() -> None:
    weights = BatchWeights(PlannedWeights(version=0, sha256=PLANNED))
    weights.add_staged(
        staged(
            (0, None),  # an engine that names nothing: the plan's check at the planned version
            (0, weights_extras({0: PLANNED})),
            (0, weights_extras({0: PLANNED, 1: REFIT})),  # a call spanning the refit
            (1, {"gateway": {"root_reason": "x"}, "engine": weights_extras({1: REFIT})}),  # the gateway's envelope
            (2, weights_extras({2: None})),  # the server says: not hashed
            (3, weights_extras({3: REFIT})),
            (3, weights_extras({3: OTHER})),  # two weights under one version
            (4, None),  # names nothing away from the planned version
            (5, {"weights_sha256": {"5": "not-a-sha"}}),
        )
    )
    weights.add_staged(staged((1, weights_extras({1: REFIT}))))  # the next shard
    result = weights.result()
    assert result["0"] == {"calls": 3, "weights": WEIGHTS_VERIFIED, "weights_sha256": PLANNED}
    assert result["1"] == {"calls": 3, "weights": WEIGHTS_VERIFIED, "weights_sha256": REFIT}
    assert result["2"] == {"calls": 1, "weights": WEIGHTS_DECLARED, "weights_sha256": None, "why": NOT_HASHED}
    assert result["3"]["weights"] == WEIGHTS_DECLARED and result["3"]["why"].startswith("several weights: 2222")
    assert result["4"]["why"] == NOT_NAMED and result["5"]["why"] == MALFORMED


def test_calls_that_name_nothing_are_not_verified_when_the_plan_only_declared_its_weights() -> None:
    declared = BatchWeights.of_plan(planned_config(WEIGHTS_DECLARED))
    declared.add_staged(staged((0, None)))
    assert declared.result()["0"]["weights"] == WEIGHTS_DECLARED
    verified = BatchWeights.of_plan(planned_config())
    verified.add_staged(staged((0, None)))
    assert verified.result()["0"] == {"calls": 1, "weights": WEIGHTS_VERIFIED, "weights_sha256": PLANNED}
    unrecorded = BatchWeights.of_plan(batch_config())  # a plan that recorded no sha256: nothing to name
    unrecorded.add_staged(staged((0, None)))
    assert unrecorded.result()["0"]["weights"] == WEIGHTS_DECLARED


def test_the_card_names_each_versions_weights_and_never_calls_unhashed_ones_verified(tmp_path) -> None:
    from tasks.finalize.dataset_writer import stage_dataset
    from tasks.storage.objects import ObjectStore

    from .rollouts import mixed_groups

    config = planned_config()
    planned = PLANNED
    marker = stage_dataset(ObjectStore(str(tmp_path)), mixed_groups(config), config=config).marker
    by_version = {
        "0": {"calls": 4, "weights": WEIGHTS_VERIFIED, "weights_sha256": planned},
        "1": {"calls": 2, "weights": WEIGHTS_VERIFIED, "weights_sha256": REFIT},
        "2": {"calls": 1, "weights": WEIGHTS_DECLARED, "weights_sha256": None, "why": NOT_HASHED},
    }
    card = card_of(marker, {"weights_by_version": by_version})
    assert "Weights: declared, not verified for weight version(s) 2; verified for 0, 1." in card
    assert f"| 0 | verified | `{planned}` (the planned model's) | – | 4 |" in card
    assert f"| 1 | verified | `{REFIT}` | – | 2 |" in card
    assert "| 2 | declared, not verified | – | not hashed | 1 |" in card
    assert "Their sha256" not in card  # the plan's line is only for metrics without versions
    only_verified = card_of(marker, {"weights_by_version": {"1": by_version["1"]}})
    assert "Weights: verified for every weight version." in only_verified
    without_versions = card_of(marker, {})  # metrics from before versions were judged: the plan's line
    for text in (card, only_verified, without_versions):
        assert "and its weights per version in `weights_by_version`: their sha256 where every call" in text
        assert "| `weights_by_version` | `list<item: struct<weight_version: uint64, weights_sha256: string>>` |" in text


def named(*pairs: tuple[int, str | None]) -> tuple[VersionWeights, ...]:
    return tuple(VersionWeights(version, sha) for version, sha in pairs)


def test_each_row_names_a_versions_sha256_only_when_all_its_calls_naming_it_name_that_one() -> None:
    gateway = {"gateway": {"root_reason": "x"}, "engine": weights_extras({1: REFIT})}
    rollouts = [
        # calls naming nothing at the planned version take the plan's sha256, one naming it agrees
        make_rollout(sample=0, versions=[0, 0], extras=[None, weights_extras({0: PLANNED})]),
        # a call spanning the refit names both versions; the next, in the gateway's envelope, the refit's
        make_rollout(sample=1, versions=[0, 1], extras=[weights_extras({0: PLANNED, 1: REFIT}), gateway]),
        make_rollout(sample=2, versions=[2, 2], extras=[weights_extras({2: None}), weights_extras({2: None})]),
        make_rollout(sample=3, versions=[3, 3], extras=[weights_extras({3: REFIT}), weights_extras({3: OTHER})]),
        make_rollout(sample=4, versions=[3, 4], extras=[weights_extras({3: REFIT}), None]),  # 4: nothing named
        make_rollout(sample=5, versions=[5, 5], extras=[{"weights_sha256": {"5": "not-a-sha"}}, None]),
        make_rollout(sample=6, versions=[0, 6], extras=[None, weights_extras({7: REFIT})]),  # 6 not among them
        make_rollout(sample=7, reason="chain_hash_mismatch", linearized=False),
    ]
    rows = rows_of(assemble(rollouts, group_size=8, weights=PlannedWeights(version=0, sha256=PLANNED)))
    assert [row.weights_by_version for row in rows] == [
        named((0, PLANNED)),
        named((0, PLANNED), (1, REFIT)),
        named((2, None)),  # not hashed
        named((3, None)),  # two sha256s for one version
        named((3, REFIT), (4, None)),  # away from the planned version, naming nothing is not verified
        named((5, None)),  # malformed extras and nothing named
        named((0, PLANNED), (6, None), (7, REFIT)),
        (),  # a masked row without tokens
    ]
    unverified_plan = rows_of(assemble(rollouts[:1], group_size=1))  # the plan did not verify its weights
    assert unverified_plan[0].weights_by_version == named((0, None))


def test_rows_judge_over_their_own_calls_and_the_batch_over_all_of_them() -> None:
    """Two rows whose calls name different weights for version 1: each row names its own, the batch neither
    (the dataset suite's ``row_weights_within_batch`` flags such rows for review)."""
    plan = PlannedWeights(version=0, sha256=PLANNED)
    calls = [(1, weights_extras({1: REFIT})), (1, weights_extras({1: OTHER})), (0, None)]
    rollouts = [
        make_rollout(sample=sample, versions=[version], extras=[extras], calls=((4, 2),))
        for sample, (version, extras) in enumerate(calls)
    ]
    rows = rows_of(assemble(rollouts, group_size=3, weights=plan))
    assert [row.weights_by_version for row in rows] == [named((1, REFIT)), named((1, OTHER)), named((0, PLANNED))]
    weights = BatchWeights(plan)
    weights.add_staged(staged(*calls))
    result = weights.result()
    assert result["0"]["weights_sha256"] == PLANNED
    assert result["1"]["weights"] == WEIGHTS_DECLARED and result["1"]["why"].startswith("several weights")


def test_finalized_rows_name_the_refit_weights_their_calls_were_hashed_with_and_null_for_unhashed_ones(
    tokenizer, tmp_path
) -> None:
    """The real stage over committed shards: shard 0 sampled at refit version 1, whose weights the engine hashed
    (as a server keeping weight records names them), shard 1 at version 2, whose weights nobody hashed."""
    from tests.generation.fakes import DelegatingEngine, FakeScriptedEngine

    class NamingEngine(DelegatingEngine):
        def __init__(self, inner, sha256: str | None) -> None:
            super().__init__(inner)
            self.sha256 = sha256

        async def generate(self, request):
            result = await self.inner.generate(request)
            return dataclasses.replace(result, extras=weights_extras({self.inner.weight_version: self.sha256}))

    root = str(tmp_path / "runs")
    config = guess_number_config("b-row-weights", ModelSpec(reference="fake-model"), num_tasks=2, shards=2)
    plan_batch(Batch.open(root, config.batch_id), config)
    sampled = {0: (1, REFIT), 1: (2, None)}  # shard -> (weight version, the sha256 its calls name)
    for shard, (version, sha256) in sampled.items():
        engine = NamingEngine(FakeScriptedEngine(tokenizer, weight_version=version), sha256)
        generate_shard(Batch.open(root, config.batch_id), shard, engine=engine, run=asyncio.run, progress=False)
    batch = Batch.open(root, config.batch_id)
    staged = finalize_batch(batch, FinalizeOptions(audit=False)).marker
    shard_of = {p.rollout_id: shard for shard in sampled for p in batch.shard_plan(shard)}
    rows = [row for part in staged.parts for row in DatasetRow.from_table(batch.dataset_part(part))]
    assert rows and all(row.input_ids.size for row in rows)
    for row in rows:
        version, sha256 = sampled[shard_of[row.rollout_id]]
        assert {s.weight_version for s in row.weight_version_spans} == {version}
        assert row.weights_by_version == named((version, sha256)), row.rollout_id
    metrics = batch.dataset_metrics(staged)["weights_by_version"]
    assert metrics["1"]["weights_sha256"] == REFIT and metrics["2"]["why"] == NOT_HASHED
