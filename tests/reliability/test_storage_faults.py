"""Storage faults (docs/reliability.md): transient faults lose nothing, persistent ones fail closed.

Storage runs behind the FAULT INJECTOR of :mod:`.faulty_fs` (a wrapper around the real local
filesystem, or around s3fs on the moto server), which fails a seeded fraction of reads, writes,
lists, existence checks and metadata reads with connection resets, S3 503 SlowDown and 500
answers, timeouts, answers lost after the operation landed, and writes cut off partway.
Generation runs on the FAKE scripted engine (:mod:`tests.generation.fakes`: real tokenizer, real
Parquet), so a batch's dataset is a function of its plan: every run is compared with a fault-free
run of the same plan. Everything else is real: plan, generate, finalize, both validation suites,
publish, and the storage layer's retries (tiny waits here, so the file stays fast).

* Transient faults (5-20 % of operations): the batch completes, every planned rollout is in the
  dataset exactly once, every part verifies, and the dataset equals the fault-free one: 0 rows lost.
* Persistent faults (every write of a kind fails, or the store goes away mid-batch): the stage
  fails with :class:`StorageUnavailableError` naming the operation and object; no marker names
  missing or partial data; running the stage again on healthy storage completes it.

Each test prints one ``storage faults:`` JSON line: faults injected by kind, rows lost.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.errors import StorageUnavailableError
from tasks.finalize.stage import finalize_batch
from tasks.pipeline import finalize_and_publish
from tasks.storage.dataset_manifest import read_dataset_marker, read_dataset_part, read_staged_marker
from tasks.storage.marker import read_marked_bytes, read_marker
from tasks.storage.objects import ObjectStore

from .conftest import generate_all, reliability_config
from .faulty_fs import FaultInjector, FaultRule, faulty_options, faulty_url

# Tiny waits, and enough attempts that 20 % faults never exhaust them (0.2**12 per operation).
TEST_RETRY = {"attempts": 12, "initial_wait_s": 0.0005, "max_wait_s": 0.005, "deadline_s": 30}
# Persistent faults give up fast.
GIVE_UP_RETRY = {"attempts": 3, "initial_wait_s": 0.0005, "max_wait_s": 0.001}
DATASET_KEY = "rollout_id"


def faults_config() -> BatchConfig:
    """16 multi-turn guess_number rollouts in 2 shards (about 40 model calls)."""
    return reliability_config(batch_id="b-storage-faults", num_tasks=8, shards=2)


@dataclass(frozen=True)
class Location:
    """Where a batch lives: a root URL and the storage options that reach it."""

    url: str
    options: dict[str, Any]

    def store(self, batch_id: str) -> ObjectStore:
        return Batch.open(self.url, batch_id, self.options).store


def run_batch(where: Location, config: BatchConfig, tokenizer: Any) -> None:
    """Plan, generate every shard (FAKE engine), lineage suite, finalize, dataset suite, publish."""
    generate_all(where.url, config, tokenizer, where.options)
    finalize_and_publish(Batch.open(where.url, config.batch_id, where.options))


def dataset_rows(store: ObjectStore, *, published: bool = True) -> pa.Table:
    """The published (else the staged) dataset, every part checked against the marker's size and sha256, by rollout."""
    marker = read_dataset_marker(store) if published else read_staged_marker(store)
    assert marker is not None, "the dataset is published" if published else "the dataset is built"
    table = pa.concat_tables(read_dataset_part(store, part) for part in marker.parts)
    return table.sort_by(DATASET_KEY)


def check_nothing_lost(rows: pa.Table, reference: pa.Table, config: BatchConfig) -> int:
    """Every planned rollout exactly once and every row equal to the fault-free run's; returns rows lost (0)."""
    ids = rows.column(DATASET_KEY).to_pylist()
    assert len(ids) == len(set(ids)) == config.num_tasks * config.group_size
    assert rows.equals(reference), "the dataset differs from the fault-free run of the same plan"
    return len(set(reference.column(DATASET_KEY).to_pylist()) - set(ids))


def figures(case: str, injector: FaultInjector, **extra: Any) -> str:
    return "storage faults: " + json.dumps(
        {
            "case": case,
            "faults": injector.total(),
            "by_kind": dict(sorted(injector.faults.items())),
            "by_operation": dict(sorted(injector.faults_by_operation.items())),
            "operations": sum(injector.operations.values()),
            **extra,
        }
    )


@pytest.fixture(scope="module")
def reference(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    """The dataset of a fault-free run of :func:`faults_config` on local disk."""
    config = faults_config()
    where = Location(str(tmp_path_factory.mktemp("storage-faults-reference")), {})
    run_batch(where, config, tokenizer)
    return dataset_rows(where.store(config.batch_id))


def target_root(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """A real root (local disk, or a fresh bucket on moto) and the fault wrapper's options for its target."""
    if kind == "local":
        return str(tmp_path / "runs"), {}
    return f"{request.getfixturevalue('s3_bucket')}/runs", {"s3": {"skip_instance_cache": True}}


@pytest.mark.parametrize(("kind", "rate"), [("local", 0.05), ("local", 0.2), ("s3", 0.2)])
def test_transient_faults_lose_no_row(
    kind: str, rate: float, reference: pa.Table, tokenizer: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, target = target_root(kind, tmp_path, request)
    config = faults_config()
    injector = FaultInjector([FaultRule(rate=rate)], seed=int(rate * 100))
    faulty = Location(faulty_url(url), faulty_options(injector, retry=TEST_RETRY, **target))
    run_batch(faulty, config, tokenizer)
    rows = dataset_rows(Location(url, {}).store(config.batch_id))
    lost = check_nothing_lost(rows, reference, config)
    print(figures(f"transient {rate:.0%} on {kind}", injector, rows_lost=lost))
    assert lost == 0
    assert injector.total() > 0


# --- persistent faults ----------------------------------------------------------------------------

# Faults that keep an operation from landing (a lost answer would mean it landed).
REFUSALS = ("connection_reset", "slow_down", "timeout", "partial_write")


def without_call_ids(rows: pa.Table) -> list[dict[str, Any]]:
    """The rows with the call ids left out of the span columns: a call id names the attempt that made it."""
    out = rows.to_pylist()
    for row in out:
        for name in ("call_spans", "weight_version_spans"):
            row[name] = [{k: v for k, v in span.items() if k != "call_id"} for span in row[name]]
    return out


def check_markers_name_whole_objects(store: ObjectStore, config: BatchConfig) -> int:
    """Every object a shard marker names is there, with the size and sha256 the marker records; the shards committed."""
    committed = 0
    for shard in range(config.shards):
        marker = read_marker(store, shard)
        if marker is not None:
            committed += 1
            for marked in marker.files:
                read_marked_bytes(store, marked)
    return committed


@pytest.mark.parametrize(
    ("refused", "failed_object"),
    [
        ("ledger/*/calls-*", "ledger/shard-00000/attempt-00/calls-000000.parquet"),
        ("staging/*", "staging/shard-00000/attempt-00/seg-"),
    ],
    ids=["calls", "staging"],
)
def test_storage_that_refuses_every_write_of_a_kind_fails_generate_closed(
    refused: str, failed_object: str, tmp_path: Path, reference, tokenizer
) -> None:
    """No rollout is poisoned for the storage's failure, no marker is written, the retry commits attempt 1."""
    config = faults_config()
    healthy = Location(str(tmp_path / "runs"), {})
    refusing = FaultRule(rate=1.0, operations=frozenset({"write"}), kinds=REFUSALS, match=f"*/{refused}")
    injector = FaultInjector([refusing], seed=3)
    faulty = Location(faulty_url(healthy.url), faulty_options(injector, retry=GIVE_UP_RETRY))
    with pytest.raises(StorageUnavailableError, match="storage unavailable: write") as failed:
        generate_all(faulty.url, config, tokenizer, faulty.options)
    error = failed.value
    assert (error.reason, error.operation, error.attempts) == ("storage_unavailable", "write", 3)
    assert f"/batches/{config.batch_id}/{failed_object}" in error.path
    store = healthy.store(config.batch_id)
    assert read_marker(store, 0) is None, "no shard marker over objects that were never written"
    kind = refused.split("/", 1)[0]
    assert not [p for p in store.list_files(kind) if fnmatch.fnmatch(p, refused) or p.endswith(".part")], (
        "nothing half-written"
    )
    assert not store.list_files("ledger/shard-00000/attempt-00/receipts-000000.parquet"), "no rollout receipted"

    generate_all(healthy.url, config, tokenizer)  # the retry, on healthy storage
    assert check_markers_name_whole_objects(store, config) == config.shards
    assert read_marker(store, 0).attempt == 1
    finalize_batch(Batch.open(healthy.url, config.batch_id))
    assert without_call_ids(dataset_rows(store, published=False)) == without_call_ids(reference)
    print(figures(f"every {refused} write refused (local)", injector, rows_lost=0))


def test_a_store_that_goes_away_mid_batch_fails_closed_and_the_retry_completes(s3_bucket, reference, tokenizer) -> None:
    config = faults_config()
    healthy = Location(f"{s3_bucket}/runs", {})
    injector = FaultInjector([FaultRule(rate=1.0, kinds=("unavailable",), after=40)], seed=4)
    options = faulty_options(injector, retry=GIVE_UP_RETRY, s3={"skip_instance_cache": True})
    faulty = Location(faulty_url(healthy.url), options)
    with pytest.raises(StorageUnavailableError, match="ConnectionRefusedError") as failed:
        run_batch(faulty, config, tokenizer)
    assert failed.value.attempts == 3
    store = healthy.store(config.batch_id)
    committed = check_markers_name_whole_objects(store, config)
    assert committed < config.shards, "the store went away before the batch was generated"

    generate_all(healthy.url, config, tokenizer)
    assert check_markers_name_whole_objects(store, config) == config.shards
    finalize_batch(Batch.open(healthy.url, config.batch_id))
    assert without_call_ids(dataset_rows(store, published=False)) == without_call_ids(reference)
    print(figures("store goes away mid-batch (s3)", injector, shards_committed_before=committed, rows_lost=0))


def test_finalize_and_publish_fail_closed_on_a_dataset_they_cannot_write(tmp_path: Path, reference, tokenizer) -> None:
    """Parts refused: finalize fails, no dataset manifest; then the published marker refused: publish fails;
    then healthy storage: the identical dataset is published."""
    config = faults_config()
    healthy = Location(str(tmp_path / "runs"), {})
    store = healthy.store(config.batch_id)
    generate_all(healthy.url, config, tokenizer)
    injected = []
    for refused in ("dataset/part-*", "dataset/_COMMITTED.json"):
        rule = FaultRule(rate=1.0, operations=frozenset({"write"}), kinds=REFUSALS, match=f"*/{refused}")
        injector = FaultInjector([rule], seed=5)
        faulty = Location(faulty_url(healthy.url), faulty_options(injector, retry=GIVE_UP_RETRY))
        with pytest.raises(StorageUnavailableError, match=f"write .*/{refused.replace('*', '')}"):
            finalize_and_publish(Batch.open(faulty.url, config.batch_id, faulty.options))
        assert read_dataset_marker(store) is None, "nothing published"
        if refused.startswith("dataset/part-"):
            assert read_staged_marker(store) is None, "no dataset manifest over parts that were never written"
        injected.append(injector)

    finalize_and_publish(Batch.open(healthy.url, config.batch_id))
    assert dataset_rows(store).equals(reference)
    for refused, injector in zip(("dataset parts", "dataset/_COMMITTED.json"), injected, strict=True):
        print(figures(f"{refused} refused (local)", injector, rows_lost=0))


def test_unavailable_storage_is_a_retryable_failure_for_the_cli_and_the_orchestrator() -> None:
    """The CLI exits 1 (not 2 or 3, which the Airflow generate task never retries) with the named error,
    and the Airflow steps' permanent-failure classes do not include it, so Airflow retries the task."""
    from tasks.entry_point import classify_error
    from tasks.errors import EXIT_FAILED, is_retryable
    from tasks.orchestration.generate_process import PERMANENT_EXIT_CODES

    path = "s3://bucket/runs/batches/b/ledger/shard-00000/attempt-00/calls-000000.parquet"
    reset = ConnectionResetError(104, "connection reset by peer")
    error = StorageUnavailableError("write", path, attempts=6, seconds=12.5, last_error=reset)
    code, line = classify_error(error, "generate", "s3://bucket/runs")
    assert code == EXIT_FAILED and code not in PERMANENT_EXIT_CODES
    assert f"storage unavailable: write {path} failed 6 time(s) in 12.5 s" in line
    assert "ConnectionResetError" in line and "run the stage again" in line
    assert is_retryable(error)
