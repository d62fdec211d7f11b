"""OpenLineage events of a batch run without Airflow: the CLI's steps through the file transport.

One prompts-file batch is planned, generated with the FAKE scripted engine (real tokenizer,
storage, ledger) and finalized with the CLI's ``finalize`` (lineage suite, build, dataset suite,
publish), with ``AIRFLOW__OPENLINEAGE__TRANSPORT`` naming a file. Every event written must parse
with the OpenLineage client's classes and validate against the OpenLineage JSON Schemas, and the
events must form one graph from the model and the prompt file to the dataset.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tasks.batch import Batch
from tasks.cli.main import main
from tasks.config import BatchConfig, ModelSpec
from tasks.generate import generate_shards
from tasks.lineage import facets
from tasks.lineage.datasets import TaskLineage, generate_lineage, plan_lineage
from tasks.lineage.emit import EventSink, batch_run_id
from tasks.lineage.naming import model, name_of_url
from tasks.plan import plan_batch
from tasks.records.dataset_row import DatasetRow
from tasks.sampling import SamplingSettings

from .client_env import sink_under
from .graph import descendants
from .openlineage_schemas import validate_event
from .parse import parse_event

TASKS = ("plan", "generate", "validate_lineage", "finalize", "validate_dataset", "publish")


def file_transport(path: Path) -> dict[str, str]:
    return {"AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps({"type": "file", "log_file_path": str(path), "append": True})}


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def cli_run(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> tuple[Batch, list[dict[str, Any]], Path]:
    """A batch run the CLI's way with lineage on: (batch, every event in order, the prompt file)."""
    from tests.generation.fakes import FakeScriptedEngine

    where = tmp_path_factory.mktemp("cli-lineage")
    prompts = where / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{i} + 1?", "ground_truth": str(i + 1)}) + "\n" for i in range(6))
    )
    events = where / "events.jsonl"
    sink = sink_under(file_transport(events), where)
    config = BatchConfig(
        batch_id="b-lineage",
        environment=str(prompts),
        num_tasks=6,
        group_size=2,
        shards=2,
        model=ModelSpec(reference="fake-model"),
        sampling=SamplingSettings(temperature=1.0, max_tokens=8),
        weight_version=2,
    )
    batch = Batch.open(str(where / "runs"), config.batch_id)
    with sink.task("plan", batch) as run:
        plan_batch(batch, config)
        run.report(lambda: plan_lineage(batch))
    engine = FakeScriptedEngine(tokenizer, reply=lambda r: str(r.seed % 7), weight_version=2)
    with sink.task("generate", batch) as run:
        generate_shards(batch, [0, 1], engine=engine, run=asyncio.run, progress=False)
        run.report(lambda: TaskLineage.merged(generate_lineage(batch, shard) for shard in (0, 1)))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in file_transport(events).items():
            patch.setenv(name, value)
        assert main(["finalize", "--root", str(where / "runs"), "--batch-id", config.batch_id, "--no-audit"]) == 0
    return batch, read_events(events), prompts


def runs_of(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The events of each task run, by job name, in order."""
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        by_run[event["run"]["runId"]].append(event)
    return {run[0]["job"]["name"]: run for run in by_run.values()}


def test_every_event_parses_with_the_client_classes_and_validates_against_the_spec(cli_run):
    _, events, _ = cli_run
    assert len(events) == 3 * len(TASKS)
    for event in events:
        assert validate_event(event) == []  # every facet's schema is known and checked
        assert parse_event(event).job.name == event["job"]["name"]


def test_each_task_is_one_run_started_reported_and_completed_under_the_batch(cli_run):
    batch, events, _ = cli_run
    runs = runs_of(events)
    assert list(runs) == [f"rollout_batch.{task}" for task in TASKS]
    for job, run in runs.items():
        assert [e["eventType"] for e in run] == ["START", "RUNNING", "COMPLETE"], job
        assert run[1]["inputs"] or run[1]["outputs"], job
        assert {e["run"]["facets"]["parent"]["run"]["runId"] for e in run} == {str(batch_run_id(batch))}


def test_the_events_connect_the_model_and_the_prompt_file_to_the_dataset(cli_run):
    batch, events, prompts = cli_run
    dataset = tuple(name_of_url(batch.store.full_path("dataset")))
    assert dataset in descendants(events, tuple(model(batch.config.model.reference)))
    assert dataset in descendants(events, ("file", str(prompts)))


def test_the_dataset_carries_its_schema_counts_and_provenance(cli_run):
    batch, events, prompts = cli_run
    (published,) = runs_of(events)["rollout_batch.publish"][1]["outputs"]
    marker = batch.published_dataset()
    assert [f["name"] for f in published["facets"]["schema"]["fields"]] == DatasetRow.column_names()
    statistics = published["outputFacets"]["outputStatistics"]
    assert (statistics["rowCount"], statistics["fileCount"]) == (marker.rows, len(marker.parts))
    provenance = published["facets"][facets.PROVENANCE_FACET]
    config = batch.config
    assert provenance["model"] == {
        "reference": config.model.reference,
        "weights": "verified",
        **config.model.provenance,
    }
    assert provenance["weightVersions"] == [2] and provenance["environment"]["options"]["path"] == f"file://{prompts}"
    (prompt_file,) = [d for d in runs_of(events)["rollout_batch.plan"][1]["inputs"] if d["name"] == str(prompts)]
    assert prompt_file["facets"]["version"]["datasetVersion"] == config.environment_options["sha256"]


def test_a_suites_inputs_carry_its_assertions_and_profile(cli_run):
    batch, events, _ = cli_run
    (dataset,) = runs_of(events)["rollout_batch.validate_dataset"][1]["inputs"]
    summary = batch.suite_summary("dataset")
    checked = dataset["inputFacets"]
    assert [a["name"] for a in checked["dataQualityAssertions"]["assertions"]] == [e.name for e in summary.expectations]
    assert all(a["success"] for a in checked["dataQualityAssertions"]["assertions"])
    by_name = {a["name"]: a for a in checked["dataQualityAssertions"]["assertions"]}
    assert by_name["group_rollouts_equal_group_size"]["column"] == "rollouts,group_size"
    metrics = checked["dataQualityMetrics"]
    assert metrics["rowCount"] == batch.published_dataset().rows
    assert metrics["columnMetrics"]["rows.sample_mask"]["sum"] == batch.published_dataset().trainable_rows
    ledgers = runs_of(events)["rollout_batch.validate_lineage"][1]["inputs"]
    assert [d["name"].rsplit("/", 2)[-2:] for d in ledgers] == [["ledger", "shard-00000"], ["ledger", "shard-00001"]]


def test_a_failed_suite_run_carries_the_failed_assertion_and_ends_in_fail(cli_run, tmp_path, monkeypatch):
    batch, _, _ = cli_run
    events = tmp_path / "events.jsonl"
    for name, value in file_transport(events).items():
        monkeypatch.setenv(name, value)
    argv = ["validate", "--root", batch.root_url, "--batch-id", batch.batch_id, "--suite", "dataset"]
    assert main([*argv, "--threshold", "reward_min=100"]) != 0
    start, running, fail = read_events(events)
    assert [e["eventType"] for e in (start, running, fail)] == ["START", "RUNNING", "FAIL"]
    assertions = running["inputs"][0]["inputFacets"]["dataQualityAssertions"]["assertions"]
    failed = [a for a in assertions if not a["success"]]
    assert [(a["name"], a["column"], a["expected"]) for a in failed] == [
        ("rewards_within_bounds", "reward", "[100, null]")
    ]
    assert "rewards_within_bounds" in fail["run"]["facets"]["errorMessage"]["message"]
    for event in (start, running, fail):
        assert validate_event(event) == []


def test_a_transport_error_is_logged_and_counted_and_the_step_goes_on(cli_run, tmp_path, caplog):
    batch, _, _ = cli_run
    sink = sink_under(file_transport(tmp_path), tmp_path)  # a directory: no event can be written
    assert isinstance(sink, EventSink)
    with caplog.at_level(logging.WARNING), sink.task("plan", batch) as run:
        run.report(lambda: plan_lineage(batch))
    assert (sink.emitted, sink.failed) == (0, 3)
    assert "could not emit the START event of rollout_batch.plan" in caplog.text
    with sink.task("plan", batch) as run:
        run.report(lambda: 1 / 0)  # a bug describing the datasets is counted too, never raised
    assert sink.failed == 3 + 3  # START, the description, COMPLETE
