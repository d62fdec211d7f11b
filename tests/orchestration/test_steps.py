"""What every task derives on its own: the batch id of a run, and the run's storage through an Airflow connection."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tasks.config import ConfigError
from tasks.ids import MAX_ID_LENGTH, is_id
from tasks.orchestration.steps import batch_id_for_run, run_batch_id
from tasks.orchestration.storage import storage_location
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


@pytest.mark.parametrize("form", ["s3://ledger_s3@{bucket}/runs/", "s3://{bucket}/runs"])
def test_s3_storage_gets_the_connections_credentials(s3_connection, s3_endpoint, form):
    bucket = s3_connection.removeprefix("s3://")
    conn_id = None if "@" in form else "ledger_s3"
    where = storage_location(form.format(bucket=bucket), conn_id)
    assert where.root_url == f"{s3_connection}/runs"
    assert where.storage_options["key"] == "testing" and where.storage_options["endpoint_url"] == s3_endpoint
    assert "testing" not in repr(where)
    store = ObjectStore(where.root_url, **where.storage_options)
    store.write_once("probe.txt", b"reachable")
    assert store.read_bytes("probe.txt") == b"reachable"
    # a child process gets the same options from one variable
    assert storage_options_from_env(where.root_url, where.environment()) == where.storage_options
    assert list(where.environment()) == [STORAGE_OPTIONS_VARIABLE]
