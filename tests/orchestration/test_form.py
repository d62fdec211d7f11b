"""The batch form: its defaults are the demo batch, every value reaches the config, bad values are named."""

from __future__ import annotations

import dataclasses

import pytest

from tasks.batch_fields import STORAGE_URL_VARIABLE, default_storage_url, run_fields
from tasks.config import ValidationSpec, config_from_values
from tasks.errors import ConfigError
from tasks.orchestration.form import form_defaults, form_fields

PROVENANCE = {"weights_sha256": "a" * 64, "tokenizer_sha256": "b" * 64, "chat_template_sha256": "c" * 64}


def config(**values):
    form = {k: v for k, v in form_defaults().items() if k not in ("batch_id", "storage_url", "storage_conn_id")}
    return config_from_values({**form, **values}, batch_id="b1", model=PROVENANCE, source="batch form")


def test_the_defaults_are_the_demo_batch():
    planned = config()
    assert (planned.environment, planned.environment_options) == ("guess_number", {"lo": 1, "hi": 10})
    assert (planned.num_tasks, planned.group_size, planned.shards, planned.max_turns) == (8, 4, 2, 5)
    assert planned.sampling.max_tokens == 32 and planned.engine.name == "vllm"
    assert planned.engine.options == {"max_model_len": 2048}
    assert planned.model.reference == "bundled:smollm2-135m-instruct" and planned.model.weights_sha256 == "a" * 64
    assert planned.validation == ValidationSpec() and planned.code_version


def test_every_field_reaches_the_config():
    planned = config(
        environment="arithmetic",
        environment_options={},
        num_tasks=6,
        group_size=3,
        shards=3,
        max_turns=2,
        max_in_flight=7,
        seed=11,
        engine_options={"max_model_len": 1024},
        weight_version=5,
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        max_tokens=9,
        on_invalid="drop",
        advantage="rloo",
        max_poisoned_rate=0.5,
        reward_min=0.0,
        reward_max=1.0,
    )
    assert (planned.num_tasks, planned.group_size, planned.shards, planned.max_turns) == (6, 3, 3, 2)
    assert (planned.max_in_flight, planned.seed, planned.weight_version) == (7, 11, 5)
    assert planned.engine.options == {"max_model_len": 1024}
    assert (planned.sampling.temperature, planned.sampling.top_p, planned.sampling.top_k) == (0.5, 0.9, 20)
    assert (planned.on_invalid, planned.advantage) == ("drop", "rloo")
    assert (planned.validation.max_poisoned_rate, planned.validation.reward_min, planned.validation.reward_max) == (
        0.5,
        0.0,
        1.0,
    )


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"shards": 9}, "shards (9) cannot exceed num_tasks (8)"),
        ({"engine": "megatronn"}, "unknown engine 'megatronn'; known: vllm, vllm_server, megatron"),
        ({"engine_options": {"max_modle_len": 1}}, "max_modle_len"),
        ({"max_invalid_row_rate": 2.0}, "max_invalid_row_rate must be a finite number in [0, 1], got 2.0"),
        ({"num_taks": 3}, "unknown batch field(s) ['num_taks']"),
        ({"environment": None}, "environment must be a non-empty str, got None"),
    ],
)
def test_a_bad_value_is_named(values, named):
    with pytest.raises(ConfigError) as error:
        config(**values)
    assert named in str(error.value) and str(error.value).startswith("batch form")


def test_every_threshold_of_the_config_is_a_form_field():
    assert {f.name for f in dataclasses.fields(ValidationSpec)} <= set(form_fields())


def test_the_run_fields_never_reach_the_config():
    about_the_run = {
        "batch_id": "other",
        "require_review": True,
        "review_timeout_hours": 1,
        "storage_url": "s3://b/p",
        "storage_conn_id": "store",
        "engine_conn_id": "servers",
    }
    assert set(about_the_run) == set(run_fields())
    assert config(**about_the_run) == config()


def test_the_storage_default_follows_the_variable_then_airflow_home():
    assert default_storage_url({STORAGE_URL_VARIABLE: "s3://b/p"}) == "s3://b/p"
    assert default_storage_url({"AIRFLOW_HOME": "/srv/airflow"}) == "file:///srv/airflow/rollout-ledger"
    assert form_fields({STORAGE_URL_VARIABLE: "s3://b/p"})["storage_url"]["default"] == "s3://b/p"
