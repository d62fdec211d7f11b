"""Storage credentials never leave the process that uses them (docs/reliability.md).

Every stage runs against the moto S3 server with distinctive FAKE credentials, supplied as an
Airflow connection (``tasks.orchestration.storage_location.storage_location``), as storage options, and
through ``$ROLLOUT_LEDGER_STORAGE_OPTIONS`` / the AWS variables for the CLI. Then everything a
person or another task can see is scanned for them: every object written under the batch
(``batch.json``, markers, ledger and dataset Parquet, reports with ``index.html``, Data Docs and
``summary.json``, the dataset card), captured logs and output, the values the DAG's steps return
for XCom, the generate child's argv, and the CLI's one-line errors for storage failures.

Generation uses the FAKE scripted engine (:mod:`tests.generation.fakes`); a full DAG run with the
real engine is ``tests/orchestration/test_dag_runs_e2e.py``. The report viewer's authentication,
authorization (403 without access to the DAG) and traversal / absolute path refusals are tested in
``tests/orchestration/test_report_viewer.py``.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from tasks.cli.main import main as cli_main
from tasks.errors import ConfigError
from tasks.orchestration import steps
from tasks.orchestration.generate_process import GenerateCommand
from tasks.orchestration.storage_location import storage_location
from tasks.storage.options import STORAGE_OPTIONS_VARIABLE
from tasks.trigger_policy import POLICY_VARIABLE
from tests.policies import write_trigger_policy

from .conftest import generate_all, reliability_config

KEY = "AKIA-LEAKCHECK-KEY"
SECRET = "leakcheck-secret-value"
CONN_ID = "leakcheck_s3"
AWS_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def assert_no_credentials(text: str, where: str) -> None:
    for secret in (KEY, SECRET):
        assert secret not in text, f"{where} contains {secret!r}"


@pytest.fixture(autouse=True)
def _root_log_handlers_removed():
    """The CLI's logging setup and Airflow's (both run in this process here) add root log handlers
    bound to the test's captured stderr, which pytest closes after the test: they go with the test,
    or a later log line (moto's server thread) fails to write."""
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)


@pytest.fixture
def leak_check(s3_endpoint, s3_bucket, monkeypatch, caplog, tmp_path):
    """A bucket reachable only through an Airflow connection holding the distinctive credentials."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    extra = {"endpoint_url": s3_endpoint, "region_name": "us-east-1"}
    connection = {"conn_type": "aws", "login": KEY, "password": SECRET, "extra": extra}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps(connection))
    policy = write_trigger_policy(tmp_path / "policy.yaml", storage_urls=[s3_bucket], storage_connections=[CONN_ID])
    monkeypatch.setenv(POLICY_VARIABLE, str(policy))  # the deployment lists the bucket and the connection
    caplog.set_level(logging.INFO)
    for name in ("tasks", "rollout_ledger"):
        caplog.set_level(logging.DEBUG, logger=name)
    return s3_bucket


def all_objects(root_url: str, storage_options: dict) -> dict[str, bytes]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(root_url, **storage_options, skip_instance_cache=True)
    return {name: fs.cat_file(name) for name in fs.find(path)}


def test_no_stage_writes_logs_or_returns_the_connections_credentials(
    leak_check, s3_endpoint, tokenizer, caplog, capsys
):
    url = f"{leak_check}/runs"
    where = storage_location(url, CONN_ID)
    assert (where.storage_options["key"], where.storage_options["secret"]) == (KEY, SECRET)
    assert_no_credentials(repr(where), "repr(StorageLocation)")

    config = reliability_config(batch_id="b-leakcheck")
    generate_all(where.root_url, config, tokenizer, storage_options=where.storage_options)
    params = {"storage_url": url, "storage_conn_id": CONN_ID, "batch_id": config.batch_id}
    run = SimpleNamespace(dag_id="rollout_batch", run_id="manual__leakcheck")
    xcom = {
        "plan": list(range(config.shards)),
        "batch": steps.batch_record(params, run),
        "validate_lineage": steps.validate("lineage", params, run),
        "finalize": steps.finalize(params, run),
        "validate_dataset": steps.validate("dataset", params, run),
        "publish": steps.publish(params, run),
        "sweep": steps.sweep(params, run),
    }
    xcom["consume"] = steps.published_dataset(xcom["publish"])
    assert xcom["publish"]["rows"] == config.num_rollouts
    assert_no_credentials(json.dumps(xcom), "XCom values")

    command = GenerateCommand(where, config.batch_id, 0, try_number=1)
    assert_no_credentials(" ".join(command.argv("python")), "the generate child's argv")
    assert_no_credentials(json.dumps(command.environment({})), "the generate child's environment")
    assert json.loads(command.handed_over())["storage_options"]["secret"] == SECRET  # they go on its stdin only

    objects = all_objects(where.root_url, where.storage_options)
    names = {name.split("/b-leakcheck/", 1)[-1] for name in objects}
    for expected in ("plan/batch.json", "ledger/shard-00000/_COMMITTED.json", "dataset/_COMMITTED.json"):
        assert expected in names
    assert "reports/index.html" in names and any(n.endswith("summary.json") for n in names)
    assert any("data_docs" in n or (n.endswith(".html") and n != "reports/index.html") for n in names)
    assert "dataset/README.md" in names
    for name, content in objects.items():
        for secret in (KEY, SECRET):
            assert secret.encode() not in content, f"{name} contains {secret!r}"

    captured = capsys.readouterr()
    assert_no_credentials(captured.out + captured.err, "stdout/stderr")
    assert caplog.records
    assert_no_credentials("\n".join(r.getMessage() for r in caplog.records), "log records")


def cli_error(argv: list[str], capsys) -> tuple[int, str]:
    code = cli_main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("supplied", ["options_variable", "aws_variables"])
def test_cli_storage_errors_name_the_variables_read_never_their_values(
    s3_endpoint, monkeypatch, capsys, caplog, supplied
):
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if supplied == "options_variable":
        options = {"key": KEY, "secret": SECRET, "endpoint_url": s3_endpoint}
        monkeypatch.setenv(STORAGE_OPTIONS_VARIABLE, json.dumps(options))
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    for argv in (
        ["finalize", "--root", "s3://no-such-bucket-leakcheck/runs", "--batch-id", "b1"],
        ["status", "--root", "s3://no-such-bucket-leakcheck/runs", "--batch-id", "b1"],
        ["sweep", "--root", "s3://no-such-bucket-leakcheck/runs", "--batch-id", "b1", "--shard", "0"],
    ):
        code, output = cli_error(argv, capsys)
        assert code != 0 and output, argv
        assert_no_credentials(output, f"the error of {argv[0]}")
    assert_no_credentials("\n".join(r.getMessage() for r in caplog.records), "log records")


def test_cli_endpoint_down_error_has_no_credentials(monkeypatch, capsys):
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    options = {
        "key": KEY,
        "secret": SECRET,
        "endpoint_url": "http://127.0.0.1:9",
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
        "rollout_ledger_retry": {"attempts": 1},  # the endpoint stays down: one try gives up at once
    }
    monkeypatch.setenv(STORAGE_OPTIONS_VARIABLE, json.dumps(options))
    code, output = cli_error(["status", "--root", "s3://bucket-leakcheck/runs", "--batch-id", "b1"], capsys)
    assert code != 0 and STORAGE_OPTIONS_VARIABLE in output
    assert_no_credentials(output, "the endpoint-down error")


@pytest.mark.parametrize(
    "text",
    [
        f'{{"key": "{KEY}", "secret": "{SECRET}",',  # not JSON
        f'["{KEY}", "{SECRET}"]',  # not an object
    ],
)
def test_a_malformed_options_variable_is_named_without_echoing_it(monkeypatch, capsys, text):
    monkeypatch.setenv(STORAGE_OPTIONS_VARIABLE, text)
    code, output = cli_error(["status", "--root", "s3://bucket-leakcheck/runs", "--batch-id", "b1"], capsys)
    assert code == 2 and STORAGE_OPTIONS_VARIABLE in output
    assert_no_credentials(output, "the options-variable error")


def test_a_storage_url_with_a_password_is_refused_and_never_reaches_xcom():
    url = f"s3://{KEY}:{SECRET}@bucket-leakcheck/runs"
    run = SimpleNamespace(dag_id="rollout_batch", run_id="manual__leakcheck")
    with pytest.raises(Exception) as refused:  # noqa: PT011 - any refusal, as long as it does not echo the secret
        storage_location(url)
    assert_no_credentials(str(refused.value), "the refusal")
    with pytest.raises(ConfigError) as not_recorded:  # plan records nothing for such a URL
        steps.batch_record({"storage_url": url}, run)
    assert_no_credentials(str(not_recorded.value), "the batch record's refusal")
    assert "s3://" in str(refused.value) and "***" in str(refused.value)
