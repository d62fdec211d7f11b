"""What every task derives on its own: the batch id of a run, and the run's storage through an Airflow connection."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from tasks.batch import Batch
from tasks.errors import ConfigError
from tasks.ids import MAX_ID_LENGTH, is_id
from tasks.orchestration.steps import batch_id_for_run, run_batch_id
from tasks.orchestration.storage_location import storage_location
from tasks.storage.objects import ObjectStore
from tasks.storage.options import STORAGE_OPTIONS_VARIABLE, storage_options_from_env

RUN = SimpleNamespace(dag_id="rollout_batch", run_id="manual__2026-12-01T10:00:00.123456+00:00")


def test_the_batch_id_of_a_run_is_a_valid_id_and_stable():
    batch_id = run_batch_id({}, RUN)
    assert batch_id == "rollout_batch.manual__2026-12-01T10-00-00.123456-00-00" and is_id(batch_id)
    assert run_batch_id({"batch_id": None}, RUN) == batch_id == batch_id_for_run(RUN.dag_id, RUN.run_id)
    assert run_batch_id({"batch_id": "mine"}, RUN) == "mine"


def test_long_or_odd_run_ids_still_give_distinct_valid_ids():
    first = batch_id_for_run("d" * 100, "scheduled__" + "x" * 100)
    second = batch_id_for_run("d" * 100, "scheduled__" + "x" * 99 + "y")
    assert len(first) == MAX_ID_LENGTH and is_id(first) and is_id(second) and first != second
    assert is_id(batch_id_for_run("..", "//"))


def test_local_storage_has_no_options(tmp_path):
    where = storage_location(f"file://{tmp_path}")
    assert where.root_url == f"file://{tmp_path}" and where.storage_options == {} and where.environment() == {}


def test_an_unsupported_scheme_or_a_missing_bucket_is_named():
    with pytest.raises(ConfigError, match="scheme 'gs' is not supported"):
        storage_location("gs://bucket/prefix")
    with pytest.raises(ConfigError, match="names no bucket"):
        storage_location("s3:///prefix")


@pytest.fixture
def s3_connection(s3_endpoint, s3_bucket, monkeypatch):
    """An Airflow AWS connection to moto; the AWS variables removed, so only the connection has credentials."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    extra = {"endpoint_url": s3_endpoint, "region_name": "us-east-1"}
    connection = {"conn_type": "aws", "login": "testing", "password": "testing", "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_LEDGER_S3", json.dumps(connection))
    return s3_bucket


def test_the_connections_own_config_kwargs_are_kept_and_the_s3_defaults_fill_the_rest(s3_connection, monkeypatch):
    connection = json.loads(os.environ["AIRFLOW_CONN_LEDGER_S3"])
    retries = {"mode": "standard", "total_max_attempts": 3}
    connection["extra"]["config_kwargs"] = {"connect_timeout": 7, "retries": retries}
    monkeypatch.setenv("AIRFLOW_CONN_LEDGER_S3_TUNED", json.dumps(connection))  # Airflow caches a store per conn id
    where = storage_location(f"{s3_connection}/runs", "ledger_s3_tuned")
    assert where.storage_options["config_kwargs"] == connection["extra"]["config_kwargs"]
    store = ObjectStore(where.root_url, **where.storage_options)
    store.write_once("probe.txt", b"reachable")
    config = store.fs.s3.meta.config
    assert (config.connect_timeout, config.retries) == (7, retries)


@pytest.mark.parametrize("form", ["s3://ledger_s3@{bucket}/runs/", "s3://{bucket}/runs"])
def test_s3_storage_gets_the_connections_credentials(s3_connection, s3_endpoint, form, monkeypatch):
    import airflow.sdk.log

    masked = []
    monkeypatch.setattr(airflow.sdk.log, "mask_secret", lambda secret, name=None: masked.append(secret))
    bucket = s3_connection.removeprefix("s3://")
    conn_id = None if "@" in form else "ledger_s3"
    where = storage_location(form.format(bucket=bucket), conn_id)
    assert where.root_url == f"{s3_connection}/runs"
    assert where.storage_options["key"] == "testing" and where.storage_options["endpoint_url"] == s3_endpoint
    assert where.storage_options["secret"] in masked  # masked in Airflow's logs, whatever gave the credentials
    assert "testing" not in repr(where)
    store = ObjectStore(where.root_url, **where.storage_options)
    store.write_once("probe.txt", b"reachable")
    assert store.fs.s3.meta.config.retries["total_max_attempts"] == 1  # the store's retry policy is the only loop
    assert store.read_bytes("probe.txt") == b"reachable"
    # a child process gets the same options from one variable
    assert storage_options_from_env(where.root_url, where.environment()) == where.storage_options
    assert list(where.environment()) == [STORAGE_OPTIONS_VARIABLE]


def test_a_recorded_rejection_fails_the_review_and_the_publish_steps_without_retry(tmp_path):
    """The steps follow a decision already on storage (here the CLI's): neither asks again, publish refuses for good."""
    from airflow.sdk.exceptions import AirflowFailException

    from tasks.orchestration import steps
    from tasks.publish import write_review
    from tasks.records.review import new_decision

    params = {"storage_url": f"file://{tmp_path}", "batch_id": "b1", "require_review": False}
    rejection = new_decision("b1", "reject", "rewards look wrong", decided_by="alice", via="cli")
    write_review(Batch.open(params["storage_url"], "b1"), rejection)

    request = steps.review_request({**params, "review_timeout_hours": 24}, RUN)
    assert (request.decision, request.needed, request.body) == (rejection, (), "")
    with pytest.raises(AirflowFailException, match=r"batch b1 was rejected: reject by alice \(cli\)"):
        steps.follow_decision(params, RUN, request.decision)
    with pytest.raises(AirflowFailException, match="a rejected batch is never published"):
        steps.publish(params, RUN)


def review_answer(chosen: list[str], reason: str | None) -> dict:
    """The event a review task resumes with after a person's answer (as the HITL REST API records it)."""
    import datetime as dt

    return {
        "chosen_options": chosen,
        "params_input": {"reason": reason},
        "responded_by_user": {"id": "admin", "name": "admin"},
        "responded_at": dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
    }


def test_an_answer_to_the_review_form_is_a_decision_by_who_answered_when_they_did():
    from tasks.orchestration import steps

    decision = steps.response_decision({"batch_id": "b1"}, RUN, review_answer(["Reject"], "  rewards look wrong "))
    assert (decision.choice, decision.reason, decision.decided_by, decision.via) == (
        "reject",
        "rewards look wrong",
        "admin",
        "airflow",
    )
    assert decision.decided_at == review_answer([], None)["responded_at"].timestamp()


@pytest.mark.parametrize(
    ("chosen", "reason", "named"),
    [
        (["Reject"], "", "a decision to reject needs a reason"),
        (["Publish"], None, "a decision to publish needs a reason"),
        (["Maybe"], "why", "unknown review choice \"'Maybe'\""),
        (["Publish", "Reject"], "why", "unknown review choice"),
    ],
)
def test_a_bad_answer_to_the_review_form_fails_the_task_naming_what_is_wrong(chosen, reason, named):
    from airflow.sdk.exceptions import AirflowFailException

    from tasks.orchestration import steps

    with pytest.raises(AirflowFailException, match=named):
        steps.response_decision({"batch_id": "b1"}, RUN, review_answer(chosen, reason))
