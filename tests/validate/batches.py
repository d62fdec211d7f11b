"""Batches the validation tests run on: generated with the fake scripted engine, copied per test, corrupted on disk.

:class:`LocalBatch` is a local batch directory. :func:`copy_batch` hands a test its own copy, so a
batch is generated (and finalized) once however many tests corrupt or validate it.
:class:`StagedDataset` rewrites rows of the staged dataset and reseals its manifest (a writer
bug: the manifest vouches for the bad bytes, so only the dataset suite can catch them); ledger
objects are corrupted with :class:`tests.finalize.tamper.BatchFiles`. :func:`generate_killed_then_resumed`
commits a shard whose rollouts resumed (replayed calls of a killed attempt).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks import layout
from tasks.batch import Batch
from tasks.engines.base import GenerationRequest
from tasks.generate import generate_shard
from tasks.generate.summary import ShardSummary
from tasks.records.dataset_row import DatasetRow
from tests.local_batch import LocalBatch

Row = dict[str, Any]


class StagedDataset:
    """The staged dataset of a local batch, editable row by row (its manifest resealed after each edit)."""

    def __init__(self, batch: LocalBatch) -> None:
        self.batch = batch
        self.manifest_path = batch.dir / layout.DATASET_STAGED

    def rows(self, part: int = 0) -> list[Row]:
        return pq.read_table(self.batch.dir / layout.dataset_part(part)).to_pylist()

    def edit(self, edit: Callable[[list[Row]], None], part: int = 0) -> None:
        """Apply ``edit`` to the rows of ``part``, rewrite it, and reseal the manifest's size, sha256 and counts."""
        rows = self.rows(part)
        edit(rows)
        self.write(pa.Table.from_pylist(rows, schema=DatasetRow.arrow_schema()), part)

    def write(self, table: pa.Table, part: int = 0) -> None:
        """Write ``table`` as ``part`` (whatever its schema) and reseal the manifest's size, sha256 and counts."""
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        data = sink.getvalue().to_pybytes()
        (self.batch.dir / layout.dataset_part(part)).write_bytes(data)
        manifest = json.loads(self.manifest_path.read_text())
        entry = manifest["parts"][part]
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest(), rows=table.num_rows)
        manifest["rows"] = sum(p["rows"] for p in manifest["parts"])
        manifest["trainable_rows"] = sum(r["sample_mask"] for i in range(len(manifest["parts"])) for r in self.rows(i))
        self.manifest_path.write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")


def row_of(rows: list[Row], rollout_id: str) -> Row:
    return next(row for row in rows if row["rollout_id"] == rollout_id)


def generate_killed_then_resumed(
    batch: Batch,
    shard: int,
    tokenizer: Any,
    *,
    crash_after: int,
    reply: Callable[[GenerationRequest], str],
    weight_version: int = 0,
) -> ShardSummary:
    """Generate ``shard`` on a fake engine that answers ``crash_after`` requests and then dies (the answers are
    committed, their rollouts left without receipts), then again on a healthy one, whose attempt resumes them: it
    replays their committed calls and samples the rest. Returns the second run's summary."""
    from tests.generation.fakes import FakeScriptedEngine, FatalEngineCrash

    answered: list[str] = []

    def die(request: GenerationRequest) -> BaseException | None:
        answered.append(request.request_id)
        return FatalEngineCrash("process died") if len(answered) > crash_after else None

    dying = FakeScriptedEngine(tokenizer, reply=reply, fail=die, weight_version=weight_version)
    with pytest.raises(FatalEngineCrash):
        generate_shard(batch, shard, engine=dying, run=asyncio.run, progress=False)
    engine = FakeScriptedEngine(tokenizer, reply=reply, weight_version=weight_version)
    return generate_shard(batch, shard, engine=engine, run=asyncio.run, progress=False)
