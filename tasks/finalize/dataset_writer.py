"""Writing the dataset's files and its staged manifest (:class:`~tasks.storage.dataset_manifest.DatasetMarker`).

Under the batch directory::

    dataset/part-00000.parquet ...   rows (DatasetRow schema), at most ``rows_per_part`` each
    dataset/metrics.json             batch metrics (+ the logprob audit when given)
    dataset/_STAGED.json             the manifest of the files above, written last

Assembled groups are streamed (a shard's at a time when finalizing): besides the rows being added,
at most one part is buffered and one is being written, in a background thread. Every object
is created once, so a crashed run that is repeated rewrites identical bytes (no-ops) and then
stages. A batch whose staged manifest exists is not built again: :func:`stage_dataset` returns
it without reading its groups.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks import layout
from tasks.checks import check_int
from tasks.config import BatchConfig
from tasks.errors import ObjectConflictError
from tasks.finalize.assemble import AssembledRows
from tasks.finalize.metrics import DatasetMetrics
from tasks.records.dataset_row import DATASET_SCHEMA_VERSION, DatasetRow
from tasks.storage.dataset_manifest import DatasetMarker, check_missing_shards, read_staged_marker
from tasks.storage.marker import MarkedFile
from tasks.storage.objects import ObjectStore

DEFAULT_ROWS_PER_PART = 8192
# Dictionary-encode the repetitive text columns only: on token lists it costs half the write time.
_DICTIONARY_COLUMNS = ["batch_id", "group_id", "mask_reason", "terminal_selection"]


@dataclass(frozen=True)
class StagedDataset:
    """Where a batch's dataset is and what its manifest names; ``created`` is False for a no-op."""

    url: str
    marker: DatasetMarker
    created: bool


def stage_dataset(
    store: ObjectStore,
    groups: Iterable[AssembledRows],
    *,
    config: BatchConfig,
    metrics: DatasetMetrics | None = None,
    audit: Mapping[str, Any] | Callable[[], Mapping[str, Any] | None] | None = None,
    missing_shards: Sequence[int] = (),
    rows_per_part: int = DEFAULT_ROWS_PER_PART,
    now: float | None = None,
) -> StagedDataset:
    """Write the dataset of ``config``'s batch from ``groups`` (ascending ``group_id``), its manifest last.

    ``store`` is rooted at the batch directory. ``metrics`` may already hold ledger counts
    (:meth:`DatasetMetrics.add_ledger`); every group is added to it here. ``audit`` (a JSON-ready
    dict, or a function returning one, called once every part is written) goes into
    ``metrics.json`` (the card publish writes shows it). ``missing_shards`` (ascending) are the
    planned shards the groups leave out: the manifest and ``metrics.json`` say the dataset is
    partial and name them. If the staged manifest exists, nothing is read or written and it is returned.
    Raises ValueError when groups arrive out of order or belong to another batch,
    ObjectConflictError when an object differs from one an earlier, unfinished run left (remove
    the dataset objects no manifest names, then retry).
    """
    check_int(rows_per_part, field="rows_per_part", minimum=1, error=ValueError)
    missing = tuple(missing_shards)
    check_missing_shards(missing, config.shards)
    existing = read_staged_marker(store)
    if existing is not None:
        if existing.batch_id != config.batch_id:
            raise ValueError(f"{store.url} holds the dataset of batch {existing.batch_id}, not {config.batch_id}")
        return StagedDataset(url=store.url, marker=existing, created=False)

    metrics = metrics if metrics is not None else DatasetMetrics()
    last_group: str | None = None
    with _PartWriter(store, rows_per_part) as writer:
        for assembled in groups:
            for stats in assembled.groups:
                if last_group is not None and stats.group_id <= last_group:
                    raise ValueError(
                        f"group {stats.group_id} arrives after group {last_group}: groups must ascend by group_id"
                    )
                last_group = stats.group_id
            _check_rows_belong(assembled, config.batch_id)
            metrics.add_groups(assembled)
            writer.add(assembled.table)
        parts = writer.close()
    if callable(audit):  # an audit samples the rows just streamed: it can run only now
        audit = audit()

    config_dict = json.loads(config.to_json())
    summary = {
        **metrics.result(),
        "partial": bool(missing),
        "missing_shards": list(missing),
        "audit": dict(audit) if audit is not None else None,
    }
    metrics_file = MarkedFile.of(
        store.write_once(
            layout.DATASET_METRICS, (json.dumps(summary, sort_keys=True, indent=2, allow_nan=False) + "\n").encode()
        ),
        kind="metrics",
        rows=0,
    )
    marker = DatasetMarker(
        batch_id=config.batch_id,
        schema_version=DATASET_SCHEMA_VERSION,
        parts=parts,
        metrics=metrics_file,
        card=None,
        rows=summary["rows"],
        trainable_rows=summary["trainable_rows"],
        groups=summary["groups"],
        config=config_dict,
        committed_at=time.time() if now is None else now,
        missing_shards=missing,
        partial=bool(missing),
    )
    try:
        store.write_once(layout.DATASET_STAGED, marker.to_json().encode("utf-8"))
    except ObjectConflictError:
        winner = read_staged_marker(store)
        if winner is None or not winner.same_content(marker):
            raise
        return StagedDataset(url=store.url, marker=winner, created=False)
    return StagedDataset(url=store.url, marker=marker, created=True)


def _check_rows_belong(assembled: AssembledRows, batch_id: str) -> None:
    """The rows are of ``batch_id`` and of the assembled groups, in order; ValueError naming the first that is not."""
    table = assembled.table
    groups = [stats.group_id for stats in assembled.groups]
    counts = [stats.rows for stats in assembled.groups]
    if sum(counts) != table.num_rows:
        raise ValueError(f"{table.num_rows} rows for groups {groups[:5]} that assembled {sum(counts)}")
    expected = pa.array(np.repeat(np.array(groups, object), counts), pa.string())
    belongs = pc.and_(pc.equal(table.column("batch_id"), batch_id), pc.equal(table.column("group_id"), expected))
    if not pc.all(belongs, min_count=0).as_py():
        row = table.filter(pc.invert(belongs)).slice(0, 1).to_pylist()[0]
        raise ValueError(f"row {row['rollout_id']} is of batch {row['batch_id']} group {row['group_id']}")


class _PartWriter:
    """Writes parts of exactly ``rows_per_part`` rows (the last may be shorter or empty), in order.

    Rows are encoded as they arrive, one Parquet row group per slice added, in a background
    thread, so encoding overlaps the assembly of the next rows; a part is written to storage
    when it is full or on :meth:`close`. At most ``_IN_FLIGHT`` slices wait to be encoded.
    """

    _IN_FLIGHT = 2

    def __init__(self, store: ObjectStore, rows_per_part: int) -> None:
        self.store = store
        self.rows_per_part = rows_per_part
        self.parts: list[MarkedFile] = []
        self._rows = 0  # rows sent to the part being written
        self._index = 0  # that part's index
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dataset-part")
        self._pending: deque[Future[None]] = deque()
        self._open: tuple[pa.BufferOutputStream, pq.ParquetWriter] | None = None  # the encoding thread's part

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def add(self, table: pa.Table) -> None:
        offset = 0
        while offset < table.num_rows:
            chunk = table.slice(offset, self.rows_per_part - self._rows)
            self._submit(self._encode, chunk)
            offset += chunk.num_rows
            self._rows += chunk.num_rows
            if self._rows == self.rows_per_part:
                self._finish_part()

    def close(self) -> tuple[MarkedFile, ...]:
        """Write what is left; a dataset without rows still gets one empty part (a loadable schema)."""
        if self._rows or not self._index:
            self._finish_part()
        while self._pending:
            self._pending.popleft().result()
        return tuple(self.parts)

    def _finish_part(self) -> None:
        self._submit(self._write, layout.dataset_part(self._index), self._rows)
        self._rows, self._index = 0, self._index + 1

    def _submit(self, task: Callable[..., None], *args: object) -> None:
        while len(self._pending) >= self._IN_FLIGHT:
            self._pending.popleft().result()
        self._pending.append(self._executor.submit(task, *args))

    def _part(self) -> tuple[pa.BufferOutputStream, pq.ParquetWriter]:
        """The part being encoded (in the encoding thread), opened on first use."""
        if self._open is None:
            sink = pa.BufferOutputStream()
            schema = DatasetRow.arrow_schema()
            self._open = (sink, pq.ParquetWriter(sink, schema, compression="zstd", use_dictionary=_DICTIONARY_COLUMNS))
        return self._open

    def _encode(self, rows: pa.Table) -> None:
        self._part()[1].write_table(rows, row_group_size=rows.num_rows)

    def _write(self, path: str, rows: int) -> None:
        sink, writer = self._part()
        writer.close()
        self._open = None
        written = self.store.write_once(path, sink.getvalue().to_pybytes())
        self.parts.append(MarkedFile.of(written, kind="part", rows=rows))
