"""Dataset names by the OpenLineage naming spec, and the provenance facet against its published JSON Schema."""

from __future__ import annotations

import json
import os
from pathlib import Path

import attr
import pytest

from tasks.batch import Batch
from tasks.config import BatchConfig, ModelSpec
from tasks.lineage import facets
from tasks.lineage.naming import DatasetName, model, name_of_url, server, shard_ledger

SCHEMA = Path(__file__).parents[2] / "docs" / "lineage" / "provenance-facet.json"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://bucket/runs/batches/b1/dataset", DatasetName("s3://bucket", "runs/batches/b1/dataset")),
        ("s3a://bucket/key", DatasetName("s3://bucket", "key")),
        ("gs://bucket/a/b", DatasetName("gs://bucket", "a/b")),
        ("file:///data/tasks.jsonl", DatasetName("file", "/data/tasks.jsonl")),
        ("/data/tasks.jsonl", DatasetName("file", "/data/tasks.jsonl")),
        ("memory://store/x", DatasetName("memory://store", "x")),
        ("s3://conn_id@bucket/key", DatasetName("s3://bucket", "key")),
        ("https://user:pass@host:9/x", DatasetName("https://host:9", "x")),
    ],
)
def test_urls_are_named_as_the_naming_spec_says(url, expected):
    assert name_of_url(url) == expected


def test_a_relative_path_is_made_absolute_and_the_bundled_model_has_its_own_namespace():
    assert name_of_url("runs/x") == DatasetName("file", os.path.abspath("runs/x"))
    assert model("bundled:smollm2-135m-instruct") == DatasetName("rollout-ledger", "bundled:smollm2-135m-instruct")
    assert model("/models/qwen") == DatasetName("file", "/models/qwen")
    assert server("http://10.0.0.5:8000/", "qwen") == DatasetName("http://10.0.0.5:8000", "qwen")
    assert server("http://user:pass@10.0.0.5:8000/", "qwen") == DatasetName("http://10.0.0.5:8000", "qwen")


def test_a_shards_ledger_is_its_folder_whatever_the_attempt(tmp_path):
    batch = Batch.open(f"file://{tmp_path}", "b1")
    assert shard_ledger(batch, 3) == DatasetName("file", f"{tmp_path}/batches/b1/ledger/shard-00003")
    assert shard_ledger(Batch.open("s3://bucket/runs", "b1"), 0) == DatasetName(
        "s3://bucket", "runs/batches/b1/ledger/shard-00000"
    )


def test_the_provenance_facet_has_exactly_the_fields_its_published_schema_names():
    schema = json.loads(SCHEMA.read_text())
    definition = schema["$defs"]["RolloutLedgerProvenanceDatasetFacet"]["allOf"][1]
    assert facets.PROVENANCE_SCHEMA_URL.startswith(schema["$id"] + "#/$defs/RolloutLedgerProvenanceDatasetFacet")
    fields = {f.name for f in attr.fields(facets.ProvenanceDatasetFacet) if not f.name.startswith("_")}
    assert fields == set(definition["properties"])
    required = {f.name for f in attr.fields(facets.ProvenanceDatasetFacet) if f.default is attr.NOTHING}
    assert required == set(definition["required"])
    bundled = ModelSpec(reference="bundled:smollm2-135m-instruct")
    config = BatchConfig(batch_id="b1", environment="arithmetic", num_tasks=1, group_size=2, shards=1, model=bundled)
    facet = facets.provenance(config, [3, 1, 3])
    assert set(facet.model) == set(definition["properties"]["model"]["required"]) and facet.weightVersions == [1, 3]
