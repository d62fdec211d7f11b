"""The trigger policy: every field a run conf may set, the engine options it may not, the deployment's lists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.batch_fields import BatchFields, field_default
from tasks.config import BatchConfig, EngineSpec, ModelSpec
from tasks.errors import TriggerPolicyError
from tasks.models.reference import BUNDLED_REFERENCE
from tasks.trigger_policy import (
    ENGINE_OPTIONS,
    POLICY_VARIABLE,
    TRIGGER_FIELDS,
    TriggerPolicy,
    load_trigger_policy,
    storage_pattern,
)

POLICY = TriggerPolicy(
    "a test policy",
    storage_urls=("file:///data/runs", "s3://ledger/runs"),
    storage_connections=("ledger_s3",),
    server_connections=("rollout_servers",),
    models=("/models/qwen",),
)


def test_the_policy_declares_every_batch_field_and_only_those():
    assert set(TRIGGER_FIELDS) == set(BatchFields.model_fields)
    assert all("engine_kwargs" not in opened and "inference_kwargs" not in opened for opened in ENGINE_OPTIONS.values())
    assert not {"urls", "api_key_file"} & set(ENGINE_OPTIONS["vllm_server"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"engine_options": {"engine_kwargs": {"reasoning_parser_plugin": "/tmp/x.py"}}},
            r"engine_options.engine_kwargs: a trigger may not set it \(the deployment sets it\)",
        ),
        ({"engine_options": {"engine_kwargs": {"trust_remote_code": True}}}, "engine_options.engine_kwargs"),
        ({"engine": "megatron", "engine_options": {"inference_kwargs": {}}}, "engine_options.inference_kwargs"),
        (
            {
                "engine": "vllm_server",
                "engine_options": {"urls": ["http://attacker"]},
                "engine_conn_id": "rollout_servers",
            },
            "engine_options.urls: .*come from the run's servers connection",
        ),
        (
            {"engine": "vllm_server", "engine_options": {"api_key_file": "/etc/shadow"}},
            "engine_options.api_key_file",
        ),
        ({"engine": "vllm_server", "engine_options": {}}, "names its servers by engine_conn_id"),
        ({"engine_conn_id": "someone_elses"}, "engine_conn_id 'someone_elses': not a servers connection"),
        ({"model": "/home/worker/secret-model"}, r"model '/home/worker/secret-model': a trigger picks one of"),
        ({"engine_options": {"max_model_len": 1}}, r"max_model_len must be an integer in \[2, 1048576\], got 1"),
        ({"engine_options": {"dtype": "float8"}}, r"dtype must be one of \['auto'"),
        ({"run_as": "root"}, r"run conf field\(s\) \['run_as'\]"),
    ],
)
def test_a_trigger_cannot_set_what_the_policy_does_not_open(values, message):
    with pytest.raises(TriggerPolicyError, match=message) as refused:
        POLICY.check_values(values)
    assert "trigger policy: a test policy" in str(refused.value)


def test_a_trigger_sets_the_open_engine_options_and_picks_listed_models_and_connections():
    POLICY.check_values({"engine_options": {"max_model_len": 4096, "dtype": "bfloat16", "seed": None}})
    POLICY.check_values({"model": "/models/qwen"})
    POLICY.check_values({"model": "file:///models/qwen"})  # the same folder as a URI
    POLICY.check_values(
        {"engine": "vllm_server", "engine_options": {"request_timeout_s": 60}, "engine_conn_id": "rollout_servers"}
    )


@pytest.mark.parametrize(
    ("url", "conn_id", "allowed"),
    [
        ("file:///data/runs", None, True),
        ("file:///data/runs/team-a", None, True),
        ("/data/runs/team-a", None, True),
        ("file:///data/runs-evil", None, False),  # a sibling with the same prefix
        ("file:///data/runs/../secrets", None, False),
        ("file:///data", None, False),
        ("file:///", None, False),
        ("s3://ledger/runs/x", "ledger_s3", True),
        ("s3://ledger_s3@ledger/runs/x", None, True),
        ("s3://ledger/runs/x", "admin_s3", False),
        ("s3://admin_s3@ledger/runs/x", None, False),
        ("s3://other/runs", "ledger_s3", False),
        ("gs://ledger/runs", None, False),
    ],
)
def test_storage_must_be_at_or_below_a_listed_url_with_a_listed_connection(url, conn_id, allowed):
    if allowed:
        POLICY.check_storage(url, conn_id)
    else:
        with pytest.raises(TriggerPolicyError, match="storage"):
            POLICY.check_storage(url, conn_id)


def config(engine: EngineSpec, model: str = BUNDLED_REFERENCE) -> BatchConfig:
    return BatchConfig(
        batch_id="b1",
        environment="guess_number",
        num_tasks=1,
        group_size=1,
        shards=1,
        model=ModelSpec(model),
        engine=engine,
    )


def test_the_worker_refuses_a_config_on_storage_a_trigger_could_not_have_planned():
    server = "http://127.0.0.1:8000"
    POLICY.check_config(config(EngineSpec("vllm", {"max_model_len": 2048})), server_urls=())
    POLICY.check_config(config(EngineSpec("vllm_server", {"urls": [server]})), server_urls=[server])
    with pytest.raises(TriggerPolicyError, match="engine_kwargs"):
        POLICY.check_config(config(EngineSpec("vllm", {"engine_kwargs": {"trust_remote_code": True}})), server_urls=())
    with pytest.raises(TriggerPolicyError, match=r"servers \['http://attacker:80'\]: not the run's servers"):
        POLICY.check_config(config(EngineSpec("vllm_server", {"urls": ["http://attacker:80"]})), server_urls=[server])
    engine = EngineSpec("vllm_server", {"urls": [server], "api_key_file": "/root/.aws/credentials"})
    with pytest.raises(TriggerPolicyError, match="api_key_file"):
        POLICY.check_config(config(engine), server_urls=[server])
    with pytest.raises(TriggerPolicyError, match="model '/elsewhere'"):
        POLICY.check_config(config(EngineSpec(), "/elsewhere"), server_urls=())


def test_the_form_offers_only_what_the_policy_allows():
    limits = POLICY.form_limits()
    assert limits["model"]["enum"] == [BUNDLED_REFERENCE, "/models/qwen"]
    assert limits["engine_conn_id"]["enum"] == [None, "rollout_servers"]
    assert limits["storage_conn_id"]["enum"] == [None, "ledger_s3"]
    assert "engine_kwargs" not in limits["engine_options"]["propertyNames"]["enum"]
    import re

    pattern = re.compile(storage_pattern(POLICY.storage_urls))
    assert pattern.match("file:///data/runs/x") and pattern.match("s3://ledger/runs")
    assert not pattern.match("file:///etc") and not pattern.match("file:///data/runsx")


def test_the_policy_file_lists_the_deployment_and_an_absent_one_allows_only_the_default_storage(tmp_path):
    absent = load_trigger_policy(
        {POLICY_VARIABLE: str(tmp_path / "none.yaml"), "ROLLOUT_LEDGER_STORAGE_URL": "file:///s"}
    )
    assert absent.storage_urls == ("file:///s",) and absent.server_connections == () and absent.models == ()
    path = tmp_path / "policy.yaml"
    path.write_text(json.dumps({"storage": {"urls": ["s3://b/p"], "connections": ["c"]}, "models": ["/m"]}))
    listed = load_trigger_policy({POLICY_VARIABLE: str(path)})
    assert (listed.storage_urls, listed.storage_connections, listed.models) == (("s3://b/p",), ("c",), ("/m",))
    path.write_text("storage: {urls: [1]}\nservers: {connection: [x]}\n")
    with pytest.raises(TriggerPolicyError, match=rf"trigger policy {path}: storage.urls.0: .*servers.connection"):
        load_trigger_policy({POLICY_VARIABLE: str(path)})


def test_the_shipped_policy_allows_the_forms_defaults_and_the_servers_dag():
    environ = {POLICY_VARIABLE: str(Path("dags/trigger_policy.yaml").resolve())}  # no storage URL variable
    shipped = load_trigger_policy(environ)
    defaults = {name: field_default(name, environ) for name in TRIGGER_FIELDS if name != "engine_conn_id"}
    shipped.check_values(defaults)
    shipped.check_values({"engine": "vllm_server", "engine_options": {}, "engine_conn_id": "rollout_servers"})
    shipped.check_storage(defaults["storage_url"], None)
