"""The batch config: one place for defaults and validation, round-tripped through plan/batch.json."""

from __future__ import annotations

import json

import pytest

from tasks.config import CONFIG_VERSION, BatchConfig, EngineSpec, ModelSpec
from tasks.errors import ConfigError

HASH = "ab" * 32


def config(**overrides) -> BatchConfig:
    fields = {
        "batch_id": "b-config",
        "environment": "guess_number",
        "num_tasks": 4,
        "group_size": 2,
        "shards": 2,
        "model": ModelSpec(reference="bundled:smollm2-135m-instruct", weights_sha256=HASH),
    } | overrides
    return BatchConfig(**fields)


def test_the_json_round_trip_is_exact_and_canonical():
    original = config(weight_version=7, engine=EngineSpec(options={"max_model_len": 2048}))
    text = original.to_json()
    assert BatchConfig.from_json(text) == original
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"
    assert json.loads(text)["config_version"] == CONFIG_VERSION


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch_id": "a/b"}, "batch_id 'a/b' is not a valid id"),
        ({"num_tasks": 0}, "num_tasks must be an int in [1, 1000000], got 0"),
        ({"group_size": True}, "group_size must be an int in [1, 4096], got True"),
        ({"shards": 5}, "shards (5) cannot exceed num_tasks (4)"),
        ({"seed": 2**63}, "seed must be an int in [0, 2**63 - 1]"),
        ({"weight_version": -1}, "weight_version must be an int >= 0"),
        ({"advantage": "ppo"}, "advantage must be one of ['grpo', 'dr_grpo', 'rloo']"),
        ({"environment": ""}, "environment must be a non-empty str"),
    ],
)
def test_each_invalid_field_is_refused_by_name(change, message):
    with pytest.raises(ConfigError) as caught:
        config(**change)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"engine": {"name": "megatronn"}}, "batch config.engine: engine: unknown engine 'megatronn'"),
        ({"engine": {"options": {"max_modle_len": 1}}}, "unknown vllm engine option(s) ['max_modle_len']"),
        ({"sampling": {"top_p": 0}}, "batch config.sampling: top_p must be in (0, 1]"),
        ({"model": {"reference": "x", "weights_sha256": "XYZ"}}, "model.weights_sha256 must be 64 lowercase hex"),
        ({"model": {"reference": "x", "typo": 1}}, "batch config.model: unknown field(s) ['typo']"),
        ({"config_version": 1}, "config_version 1 is not supported"),
        ({"num_task": 4}, "unknown field(s) ['num_task']"),
    ],
)
def test_stored_configs_are_checked_as_strictly_as_new_ones(patch, message):
    raw = json.loads(config().to_json()) | patch
    with pytest.raises(ConfigError) as caught:
        BatchConfig.from_json(json.dumps(raw))
    assert message in str(caught.value)


def test_missing_fields_and_non_json_are_named():
    raw = json.loads(config().to_json())
    del raw["shards"]
    with pytest.raises(ConfigError, match=r"missing field\(s\) \['shards'\]"):
        BatchConfig.from_dict(raw)
    with pytest.raises(ConfigError, match=r"plan/batch\.json is not valid JSON"):
        BatchConfig.from_json("{", source="plan/batch.json")


def test_later_stages_may_override_only_what_is_safe():
    planned = config()
    assert planned.with_overrides(on_invalid="drop", advantage="rloo").advantage == "rloo"
    with pytest.raises(ConfigError, match=r"\['weight_version'\] cannot be changed after planning"):
        planned.with_overrides(weight_version=3)


def test_model_provenance_lists_the_three_recorded_hashes():
    assert config().model.provenance == {"weights_sha256": HASH, "tokenizer_sha256": "", "chat_template_sha256": ""}
