"""The batch fields, declared once: the form, the plan flags, the config's checks and the docs table follow it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import jsonschema
import pytest

from tasks import batch_fields_doc
from tasks.batch_fields import (
    SECTIONS,
    BatchFields,
    check_values,
    config_paths,
    field_default,
    field_defaults,
    plan_flag,
    run_fields,
)
from tasks.cli import plan as cli_plan
from tasks.cli.main import build_parser
from tasks.config import BatchConfig, ValidationSpec, config_from_values
from tasks.engines.registry import engine_labels, engine_names
from tasks.environments.registry import BUILTIN_ENVIRONMENTS
from tasks.errors import ConfigError
from tasks.orchestration.form import form_fields

PROVENANCE = {"weights_sha256": "a" * 64, "tokenizer_sha256": "b" * 64, "chat_template_sha256": "c" * 64}
REQUIRED_FLAGS = {"--environment", "--num-tasks", "--group-size", "--shards"}


def test_every_field_is_titled_described_sectioned_and_defaulted():
    fields = form_fields()
    assert list(fields) == list(BatchFields.model_fields)
    for name, spec in fields.items():
        assert spec["title"] and spec["description"] and spec["section"] in SECTIONS, name
        jsonschema.validate(spec["default"], {k: v for k, v in spec.items() if k != "default"})
    assert set(run_fields()) == {
        "batch_id",
        "engine_conn_id",
        "storage_url",
        "storage_conn_id",
        "require_review",
        "review_timeout_hours",
    }


def test_the_form_schema_carries_the_declared_bounds_choices_and_labels():
    fields = form_fields()
    assert (fields["num_tasks"]["type"], fields["num_tasks"]["minimum"], fields["num_tasks"]["maximum"]) == (
        "integer",
        1,
        1_000_000,
    )
    assert fields["top_p"]["exclusiveMinimum"] == 0 and fields["top_p"]["maximum"] == 1
    assert fields["batch_id"]["type"] == ["null", "string"] and fields["reward_min"]["type"] == ["null", "number"]
    assert fields["engine"]["enum"] == list(engine_names()) and fields["engine"]["values_display"] == engine_labels()
    games = sorted(set(BUILTIN_ENVIRONMENTS) - {"agent_command", "agent_callable"})
    assert fields["environment"]["enum"][: len(games)] == games  # then the registry's names
    assert set(fields["advantage"]["values_display"]) == set(fields["advantage"]["enum"])
    assert "anyOf" not in json.dumps(fields)  # the Airflow form reads `type`


def test_every_config_path_is_a_field_of_the_config_with_the_declared_default():
    config = BatchConfig(
        batch_id="b",
        environment="guess_number",
        num_tasks=8,
        group_size=4,
        shards=2,
        model=BatchConfig.__dataclass_fields__["model"].type and _model(),
    )
    for name, path in config_paths().items():
        value = config
        for part in path.split("."):
            assert part in {f.name for f in dataclasses.fields(value)}, path
            value = getattr(value, part)
        if name not in ("environment", "num_tasks", "group_size", "shards", "model") and not name.endswith("options"):
            assert value == field_default(name), f"{path} defaults to {value!r}, declared {field_default(name)!r}"
    assert ValidationSpec() == config.validation


def _model():
    from tasks.config import ModelSpec

    return ModelSpec(reference=field_default("model"), **PROVENANCE)


def plan_values(*flags: str) -> dict:
    args = build_parser().parse_args(["plan", "--root", "/tmp/r", "--batch-id", "b1", *flags])
    return cli_plan.plan_values(args)


def test_the_plan_flags_are_the_config_fields_typed_described_and_required_as_declared():
    plan = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["plan"]
    actions = {a.dest: a for a in plan._actions if a.dest in BatchFields.model_fields and a.dest != "batch_id"}
    assert set(actions) == set(config_paths())
    for name, action in actions.items():
        assert action.option_strings == [plan_flag(name).name], name
        assert BatchFields.model_fields[name].description in action.help, name
    assert {a.option_strings[0] for a in actions.values() if a.required} == REQUIRED_FLAGS
    assert actions["engine"].choices == engine_names() and actions["top_p"].type is float
    assert plan_flag("environment_options").name == "--env-option"


def test_the_plan_flags_and_the_form_values_give_the_same_config():
    demo = ["--environment", "guess_number", "--num-tasks", "8", "--group-size", "4", "--shards", "2"]
    form = {k: v for k, v in field_defaults().items() if k not in run_fields()}
    assert _config(plan_values(*demo)) == _config(form)
    changed = {
        "environment_options": {"lo": 1, "hi": 50},
        "num_tasks": 6,
        "group_size": 3,
        "shards": 3,
        "max_turns": 2,
        "seed": 11,
        "engine_options": {"max_model_len": 1024, "enforce_eager": True},
        "temperature": 0.5,
        "top_k": 20,
        "advantage": "rloo",
        "max_poisoned_rate": 0.5,
        "reward_max": 1.0,
    }
    flags = [
        *("--environment", "guess_number", "--env-option", "lo=1", "--env-option", "hi=50"),
        *("--num-tasks", "6", "--group-size", "3", "--shards", "3", "--max-turns", "2", "--seed", "11"),
        *("--engine-option", "max_model_len=1024", "--engine-option", "enforce_eager=true"),
        *("--temperature", "0.5", "--top-k", "20", "--advantage", "rloo"),
        *("--max-poisoned-rate", "0.5", "--reward-max", "1"),
    ]
    assert _config(plan_values(*flags)) == _config({**form, **changed})


def _config(values: dict) -> BatchConfig:
    return config_from_values(values, batch_id="b1", model=PROVENANCE)


def test_the_default_options_belong_to_the_default_environment_and_engine():
    assert check_values({}).environment_options == {"lo": 1, "hi": 10}
    assert check_values({"environment": "arithmetic"}).environment_options == {}
    assert check_values({"engine": "megatron"}).engine_options == {}
    assert check_values({"engine": "vllm"}).engine_options == {"max_model_len": 2048}
    assert plan_values("--environment", "arithmetic", *("--num-tasks", "1", "--group-size", "1", "--shards", "1")) == {
        "environment": "arithmetic",
        **{k: v for k, v in plan_values(*_required()).items() if k not in ("environment", "environment_options")},
    }


def _required() -> list[str]:
    return ["--environment", "guess_number", "--num-tasks", "1", "--group-size", "1", "--shards", "1"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"num_tasks": 0}, "num_tasks must be an int in [1, 1000000], got 0"),
        ({"group_size": True}, "group_size must be an int in [1, 4096], got True"),
        ({"max_tokens": "32"}, "max_tokens must be an int >= 1, got '32'"),
        ({"top_p": 0.0}, "top_p must be a finite number in (0, 1], got 0.0"),
        ({"max_group_advantage_mean": float("inf")}, "max_group_advantage_mean must be a finite number >= 0"),
        ({"advantage": "ppo"}, "advantage must be one of ['grpo', 'dr_grpo', 'rloo'], got 'ppo'"),
        ({"review_timeout_hours": 721}, "review_timeout_hours must be a finite number in (0, 720], got 721"),
        ({"batch_id": "../x"}, "batch_id must be a str matching"),
        ({"num_taks": 3}, "unknown batch field(s) ['num_taks']"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field(values, message):
    with pytest.raises(ConfigError) as error:
        check_values(values, source="the form")
    assert str(error.value).startswith("the form: ") and message in str(error.value)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"max_turns": 0}, "max_turns must be an int in [1, 1024], got 0"),
        ({"sampling": {"max_tokens": 0}}, "max_tokens must be an int >= 1"),
        ({"validation": {"max_poisoned_rate": 1.5}}, "validation.max_poisoned_rate must be a finite number in [0, 1]"),
        ({"on_invalid": "keep"}, "on_invalid must be one of ['mask', 'drop'], got 'keep'"),
        ({"environment_options": ["lo"]}, "environment_options must be a JSON object, got ['lo']"),
    ],
)
def test_a_stored_config_is_checked_against_the_same_declaration(patch, message):
    raw = json.loads(_config({}).to_json())
    for key, value in patch.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError) as error:
        BatchConfig.from_dict(raw)
    assert message in str(error.value)


def test_the_docs_table_is_generated_from_the_declaration():
    text = batch_fields_doc.DOC.read_text()
    assert batch_fields_doc.render(text) == text, (
        "docs/configuration.md is out of date: python -m tasks.batch_fields_doc"
    )
    for name in BatchFields.model_fields:
        assert f"| `{name}` |" in text, name


def test_importing_the_declaration_loads_no_heavy_library():
    heavy = ("numpy", "pyarrow", "fsspec", "airflow", "torch", "tasks.config", "tasks.orchestration")
    code = f"import sys, tasks.batch_fields; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_engine_field_is_a_name_whose_choices_the_front_ends_take_from_the_registry():
    assert BatchFields.model_fields["engine"].annotation is str  # the declaration sits below the engines
    assert form_fields()["engine"]["enum"] == list(engine_names())
