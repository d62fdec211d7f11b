"""OpenLineage events of a real ``rollout_batch`` run (``dag.test()``, the provider's file transport).

The run is the shared published run (two shards on the test run's vLLM server). Every task event
the provider wrote must parse with the OpenLineage client's classes and validate against the
OpenLineage JSON Schemas; every task that ran reports its datasets, named as the naming spec says
and stable across tries; and the datasets connect the model to the published dataset.
"""

from __future__ import annotations

import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.lineage import facets
from tasks.lineage.naming import batch_object, model
from tasks.orchestration import steps
from tests.lineage.graph import descendants
from tests.lineage.openlineage_schemas import validate_event
from tests.lineage.parse import parse_event

from .lineage_events import reported, task_events, task_runs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPORTING = ("plan", "generate", "validate_lineage", "finalize", "validate_dataset", "publish", "sweep_orphans")


@pytest.fixture(scope="module")
def published(published_run):
    dag_run, conf = published_run
    return Batch.open(conf["storage_url"], steps.run_batch_id(conf, dag_run)), task_events(dag_run)


def test_every_event_of_the_run_parses_and_validates_against_the_openlineage_schemas(published):
    _, events = published
    assert events
    for event in events:
        assert validate_event(event) == []
        assert parse_event(event).eventType.value == event["eventType"]


def test_every_task_that_ran_reports_its_datasets_in_its_own_run(published):
    batch, events = published
    runs = task_runs(events)
    for task_id in REPORTING:
        found = reported(events, task_id)
        assert len(found) == (batch.config.shards if task_id == "generate" else 1), task_id
        for event in found:
            states = [e["eventType"] for e in runs[event["run"]["runId"]]]
            assert states == ["START", "RUNNING", "COMPLETE"], (task_id, states)
    outputs = {tuple(d["name"].rsplit("/", 2)[-2:]) for e in reported(events, "generate") for d in e["outputs"]}
    assert outputs == {(kind, f"shard-0000{s}") for kind in ("ledger", "staging") for s in range(2)}  # no attempt


def test_the_published_dataset_descends_from_the_model_with_its_provenance(published):
    batch, events = published
    dataset = tuple(batch_object(batch, layout.DATASET_DIR))
    assert dataset in descendants(events, tuple(model(batch.config.model.reference)))
    (url,) = batch.config.engine.options["urls"]  # the server that served it feeds the plan and generate
    (plan,) = reported(events, "plan")
    assert url in {d["namespace"] for d in plan["inputs"]}
    (output,) = reported(events, "publish")[0]["outputs"]
    provenance = output["facets"][facets.PROVENANCE_FACET]
    assert provenance["batchId"] == batch.batch_id and provenance["weightVersions"] == [3]
    assert provenance["model"]["weights_sha256"] == batch.config.model.weights_sha256
