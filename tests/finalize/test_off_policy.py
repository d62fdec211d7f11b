"""The off-policy gate names each injected fault within its batch, and raises no alarm on a clean one.

A batch here is eight rows sampled from a tiny random Llama exactly as vLLM samples (its
processed distribution, :func:`processed_log_softmax`, at T=0.7, top_p=0.9, top_k=20), each row
with the sampling, kept sets and weight-version spans a dataset row of schema 3 records. One fault
is injected into one row of a copy of the batch; the audit (the HF recompute of
:func:`audit_logprobs`) must name that row with the fault's reason, and the gate's measures must
breach the expectation that warns or fails on it (:func:`tasks.finalize.off_policy.gate_measures`).
Faults at rest are caught earlier too (a NaN logprob: DatasetRow and the dataset suite's
``logprobs_finite``; an altered staged mask: its call's digest), in those layers' own tests.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest
import torch

from tasks.config import ValidationSpec
from tasks.finalize.logprob_audit import audit_logprobs, processed_log_softmax
from tasks.finalize.off_policy import (
    OffPolicyThresholds,
    ScoredRow,
    gate_measures,
    off_policy_figures,
)
from tasks.sampling import SamplingSettings
from tests.finalize.tiny_llama import VOCAB, tiny_llama

SAMPLING = SamplingSettings(temperature=0.7, top_p=0.9, top_k=20)
PLANNED = 3
FAULTY = "r2"
THRESHOLDS = OffPolicyThresholds()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama-gate"), seed=1)


def _row(model: Any, seed: int, *, calls: int = 2) -> dict[str, Any]:
    """A row of ``calls`` calls sampled as vLLM does, with its kept sets, raw logprobs and spans (all at PLANNED)."""
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(0, VOCAB, size=int(rng.integers(3, 8)))]
    mask, logprobs, raw = [0] * len(ids), [0.0] * len(ids), [0.0] * len(ids)
    counts: list[int] = []
    kept_ids: list[int] = []
    spans = []
    for call in range(calls):
        if call:
            env = [int(t) for t in rng.integers(0, VOCAB, size=3)]
            ids, mask, logprobs, raw = ids + env, mask + [0] * 3, logprobs + [0.0] * 3, raw + [0.0] * 3
        start = len(ids)
        for _ in range(int(rng.integers(5, 12))):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1:].float()
            dist = processed_log_softmax(
                logits, temperature=SAMPLING.temperature, top_k=SAMPLING.top_k, top_p=SAMPLING.top_p
            )[0].double()
            probs = dist.exp().numpy()
            token = int(rng.choice(VOCAB, p=probs / probs.sum()))
            kept = np.flatnonzero(np.isfinite(dist.numpy()))
            ids.append(token)
            mask.append(1)
            logprobs.append(float(dist[token]))
            raw.append(float(logits[0].log_softmax(-1)[token]))
            counts.append(kept.size)
            kept_ids.extend(kept.tolist())
        spans.append({"call_id": f"c{seed}-{call}", "start": start, "end": len(ids), "weight_version": PLANNED})
    return {
        "rollout_id": f"r{seed}",
        "input_ids": np.array(ids, np.int32),
        "loss_mask": np.array(mask, np.uint8),
        "logprobs": np.array(logprobs, np.float32),
        "raw": np.array(raw, np.float32),
        "temperature": SAMPLING.temperature,
        "top_p": SAMPLING.top_p,
        "top_k": SAMPLING.top_k,
        "logprobs_mode": "processed",
        "kept_counts": np.array(counts, np.int32),
        "kept_token_ids": np.array(kept_ids, np.int32),
        "weight_version_spans": spans,
    }


@pytest.fixture(scope="module")
def clean_batch(tiny_model: tuple[str, Any]) -> list[dict[str, Any]]:
    return [_row(tiny_model[1], seed) for seed in range(8)]


def _gate(rows: list[dict[str, Any]], model_path: str) -> dict[str, Any]:
    report = audit_logprobs(
        rows, model_path=model_path, sampling=SAMPLING, sample_size=len(rows), planned_weight_version=PLANNED
    )
    assert report.off_policy is not None
    return report.off_policy


def _breaches(off_policy: dict[str, Any], t: OffPolicyThresholds = THRESHOLDS) -> set[str]:
    """The dataset suite's off-policy expectations these measures break (tasks.validate.suites), by name."""
    m = gate_measures(off_policy)
    bounds = {
        "off_policy_no_nan_logprobs": ("nan_tokens", 0),
        "off_policy_masks_present": ("missing_mask_tokens", 0),
        "off_policy_kept_ratio_mean": ("kept_ratio_mean_deviation", t.max_ratio_deviation),
        "off_policy_kept_geometric_mean": ("kept_geometric_mean_deviation", t.max_ratio_deviation),
        "off_policy_tokens_within_bound": ("outside_bound_rate", t.max_outside_rate),
        "off_policy_staleness": ("staleness_max", t.max_staleness),
        "off_policy_rows_explained": ("unexplained_rows", 0),
    }
    return {name for name, (measure, bound) in bounds.items() if m[measure] is not None and m[measure] > bound}


def _flagged(off_policy: dict[str, Any]) -> dict[str, list[str]]:
    return {row["rollout_id"]: row["reasons"] for row in off_policy["flagged_rows"]}


def _sampled(row: dict[str, Any]) -> np.ndarray:
    return np.flatnonzero(row["loss_mask"] == 1)


def test_a_clean_batch_raises_no_alarm_and_its_kept_set_ratios_are_one(clean_batch, tiny_model) -> None:
    gate = _gate(clean_batch, tiny_model[0])
    assert gate["flagged_rows"] == [] and _breaches(gate) == set()
    assert gate["nan_tokens"] == gate["missing_mask_tokens"] == gate["tokens_outside_bound"] == 0
    kept, full = gate["ratios"]["kept_set"], gate["ratios"]["full_vocab"]
    assert kept["token_mean"] == pytest.approx(1.0, abs=1e-5) and kept["geometric_mean"] == pytest.approx(1, abs=1e-5)
    assert kept["token_p01"] == pytest.approx(1.0, abs=1e-4) and kept["token_p99"] == pytest.approx(1, abs=1e-4)
    # truncation: the full-vocabulary ratio is the kept mass S < 1, token by token
    assert 0 < gate["kept_mass_mean"] < 1 and full["token_mean"] == pytest.approx(gate["kept_mass_mean"], rel=1e-5)
    assert gate["staleness"] == {
        "max": 0,
        "mean": 0.0,
        "tokens_by_versions_behind": {"0": gate["tokens"]},
    }
    assert gate["tokens"] == sum(_sampled(r).size for r in clean_batch) and gate["sequences"] == len(clean_batch)
    assert set(gate["peers"]) == {
        "verl_token_tis_2",
        "trl_sequence_3",
        "prime_rl_mask_0.125_8",
        "areal_token_5",
        "nemo_rl_seq_mask_tis",
    }
    assert all(v == {"tokens": 0.0, "sequences": 0.0} for v in gate["peers"].values())
    assert gate["thresholds"] == {name: getattr(ValidationSpec(), name) for name in gate["thresholds"]}


def _raw_logprobs(row: dict[str, Any]) -> None:
    row["logprobs"] = row["raw"].copy()


def _wrong_temperature(row: dict[str, Any]) -> None:
    row["temperature"] = 1.0  # sampled at 0.7: the row says otherwise


def _missing_mask(row: dict[str, Any]) -> None:
    row["kept_counts"], row["kept_token_ids"] = np.zeros(0, np.int32), np.zeros(0, np.int32)


def _altered_mask(row: dict[str, Any]) -> None:
    """The first sampled token's kept set loses that token (the mask says it could not have been drawn)."""
    token = int(row["input_ids"][_sampled(row)[0]])
    first = int(row["kept_counts"][0])
    kept = [int(i) for i in row["kept_token_ids"][:first] if i != token] or [(token + 1) % VOCAB]
    row["kept_counts"] = np.concatenate([[len(kept)], row["kept_counts"][1:]]).astype(np.int32)
    row["kept_token_ids"] = np.concatenate([kept, row["kept_token_ids"][first:]]).astype(np.int32)


def _nan_logprob(row: dict[str, Any]) -> None:
    row["logprobs"] = row["logprobs"].copy()
    row["logprobs"][_sampled(row)[1]] = np.nan


def _stale_version(row: dict[str, Any]) -> None:
    row["weight_version_spans"][1]["weight_version"] = PLANNED - 1


# fault -> (the reason the gate names its row with, the expectations it breaks: fail ones first)
FAULTS = {
    "raw_instead_of_processed": (
        _raw_logprobs,
        "raw_logprobs",
        {"off_policy_kept_ratio_mean", "off_policy_kept_geometric_mean", "off_policy_rows_explained"},
    ),
    "wrong_temperature": (_wrong_temperature, "temperature_mismatch", {"off_policy_rows_explained"}),
    "missing_mask": (_missing_mask, "missing_mask", {"off_policy_masks_present"}),
    "altered_mask": (
        _altered_mask,
        "outside_kept_set",
        {"off_policy_kept_geometric_mean", "off_policy_rows_explained"},
    ),
    "nan_logprob": (_nan_logprob, "nan_logprob", {"off_policy_no_nan_logprobs"}),
    "stale_weight_version": (_stale_version, "stale_tokens", {"off_policy_staleness"}),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_gate_names_each_injected_fault_within_its_batch(fault: str, clean_batch, tiny_model) -> None:
    inject, reason, breaks = FAULTS[fault]
    rows = copy.deepcopy(clean_batch)
    inject(next(r for r in rows if r["rollout_id"] == FAULTY))
    gate = _gate(rows, tiny_model[0])
    flagged = _flagged(gate)
    assert reason in flagged.get(FAULTY, []), flagged
    assert set(flagged) == {FAULTY}, f"{fault}: clean rows flagged too: {flagged}"
    assert gate["flagged_rows"][0]["rollout_id"] == FAULTY
    assert breaks <= _breaches(gate), (fault, _breaches(gate), gate_measures(gate))


def test_the_named_fault_counts_are_exact(clean_batch, tiny_model) -> None:
    rows = copy.deepcopy(clean_batch)
    faulty = rows[2]
    _missing_mask(faulty)
    _nan_logprob(rows[3])
    _stale_version(rows[4])
    gate = _gate(rows, tiny_model[0])
    assert gate["missing_mask_tokens"] == _sampled(faulty).size
    assert gate["nan_tokens"] == 1
    second_call = rows[4]["weight_version_spans"][1]
    stale = int(np.sum(_sampled(rows[4]) >= second_call["start"]))
    assert gate["staleness"]["max"] == 1 and gate["staleness"]["tokens_by_versions_behind"]["1"] == stale
    # a token whose mask is missing keeps its full-vocabulary ratio; a NaN one has none
    assert gate["tokens"] == sum(_sampled(r).size for r in rows)
    by_id = {row["rollout_id"]: row for row in gate["flagged_rows"]}
    nan_tokens = [t for t in by_id["r3"]["tokens"] if t["logprob"] is None]
    assert len(nan_tokens) == 1 and nan_tokens[0]["ratio"] is None
    assert all(t["kept"] is None and t["ratio"] is None for t in by_id["r2"]["tokens"])
    assert {t["version"] for t in by_id["r4"]["tokens"]} == {PLANNED, PLANNED - 1}


def test_the_wrong_temperature_diagnosis_finds_the_sampled_one(clean_batch, tiny_model) -> None:
    rows = copy.deepcopy(clean_batch)
    _wrong_temperature(rows[2])
    gate = _gate(rows, tiny_model[0])
    assert _flagged(gate)["r2"][0] == "temperature_mismatch"


# --- figures on hand-made scores: the ratios and the peers' rules ------------------------------------


def _scored(log_ratios: list[float], rollout: str = "x", *, stored: float = -1.0) -> ScoredRow:
    n = len(log_ratios)
    kept = np.full(n, stored) + np.array(log_ratios)
    return ScoredRow(
        rollout_id=rollout,
        token_ids=np.arange(n),
        stored=np.full(n, stored),
        full_vocab=kept - 0.1,
        kept_set=kept,
        kept_counts=np.full(n, 3),
        versions=np.zeros(n, np.int64),
    )


def test_ratios_and_peer_rules_follow_their_definitions() -> None:
    rows = [_scored([math.log(2.5), 0.0, 0.0], "a"), _scored([math.log(0.1), math.log(1.5)], "b"), _scored([0.0], "c")]
    gate = off_policy_figures(rows, planned_weight_version=0, thresholds=THRESHOLDS)
    kept = gate["ratios"]["kept_set"]
    assert kept["token_mean"] == pytest.approx((2.5 + 1 + 1 + 0.1 + 1.5 + 1) / 6)
    assert kept["sequence_mean"] == pytest.approx((2.5 + 0.15 + 1) / 3)
    assert kept["geometric_mean"] == pytest.approx((2.5 ** (1 / 3) + 0.15**0.5 + 1) / 3)
    assert gate["ratios"]["full_vocab"]["token_mean"] == pytest.approx(kept["token_mean"] * math.exp(-0.1))
    assert gate["kept_mass_mean"] == pytest.approx(math.exp(-0.1))
    peers = gate["peers"]
    assert peers["verl_token_tis_2"] == {"tokens": pytest.approx(1 / 6), "sequences": pytest.approx(1 / 3)}
    assert peers["areal_token_5"] == {"tokens": 0.0, "sequences": 0.0}
    assert peers["prime_rl_mask_0.125_8"] == {"tokens": pytest.approx(1 / 6), "sequences": pytest.approx(1 / 3)}
    assert peers["trl_sequence_3"] == {"tokens": 0.0, "sequences": 0.0}  # 2.5 < 3
    assert peers["nemo_rl_seq_mask_tis"] == {"tokens": pytest.approx(5 / 6), "sequences": pytest.approx(2 / 3)}
    assert gate["tokens_outside_bound"] == 2 and gate["sequences_outside_bound"] == 2
    assert [r["rollout_id"] for r in gate["flagged_rows"]] == ["b", "a"]  # worst |log ratio| first


def test_a_sequence_product_above_three_is_masked_by_trls_default() -> None:
    gate = off_policy_figures(
        [_scored([math.log(1.5)] * 3, "long"), _scored([0.0], "short")],
        planned_weight_version=0,
        thresholds=THRESHOLDS,
    )
    assert gate["peers"]["trl_sequence_3"] == {"tokens": pytest.approx(3 / 4), "sequences": 0.5}
    assert gate["peers"]["verl_token_tis_2"] == {"tokens": 0.0, "sequences": 0.0}


def test_figures_stay_finite_json_when_a_ratio_overflows() -> None:
    import json

    gate = off_policy_figures([_scored([900.0, -math.inf])], planned_weight_version=0, thresholds=THRESHOLDS)
    text = json.dumps(gate, allow_nan=False)
    assert 1e8 < json.loads(text)["ratios"]["kept_set"]["token_p99"] <= math.exp(20)
    assert _flagged(gate)["x"] == ["outside_kept_set", "ratio_outside_bounds"]


def test_no_rows_give_null_figures_and_null_measures() -> None:
    gate = off_policy_figures([], planned_weight_version=5, thresholds=THRESHOLDS)
    assert gate["tokens"] == 0 and gate["ratios"]["kept_set"]["token_mean"] is None
    assert gate["staleness"] == {"max": None, "mean": None, "tokens_by_versions_behind": {}}
    assert set(gate_measures(gate).values()) == {0, None}
    assert set(gate_measures(None).values()) == {None}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ratio_bound": 1.0}, "ratio_bound"),
        ({"max_ratio_deviation": -1.0}, "max_ratio_deviation"),
        ({"max_outside_rate": 2.0}, "max_outside_rate"),
        ({"max_staleness": -1}, "max_staleness"),
    ],
)
def test_invalid_thresholds_are_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OffPolicyThresholds(**kwargs)


def test_the_thresholds_come_from_the_batch_config_fields() -> None:
    spec = ValidationSpec(off_policy_ratio_bound=3.0, off_policy_max_staleness=2)
    thresholds = OffPolicyThresholds.of(spec)
    assert thresholds.ratio_bound == 3.0 and thresholds.max_staleness == 2
    assert thresholds.as_fields() == {name: getattr(spec, name) for name in thresholds.as_fields()}
