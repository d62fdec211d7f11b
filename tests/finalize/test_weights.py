"""Which weights sampled each weight version (``weights_by_version``), judged from the calls' extras, and the card.

A version is verified only when every call naming it names one sha256; a call that names nothing
takes the plan's check at the planned version and nothing elsewhere. The card names each version
with its sha256 or as declared, not verified, and says why.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from tasks.finalize.weights import MALFORMED, NOT_HASHED, NOT_NAMED, BatchWeights
from tasks.models.provenance import WEIGHTS_DECLARED, WEIGHTS_VERIFIED, weights_extras
from tasks.records.ledger import canonical_json

from .rollouts import batch_config
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
    weights = BatchWeights(planned_version=0, planned_sha256=PLANNED)
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
