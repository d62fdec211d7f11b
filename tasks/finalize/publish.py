"""The dataset's files and its two manifests: staged by finalize, committed by publish.

Under the batch directory::

    dataset/part-00000.parquet ...   rows (DatasetRow schema), at most ``rows_per_part`` each
    dataset/metrics.json             batch metrics (+ the logprob audit when given)
    dataset/_STAGED.json             finalize's manifest: every file above with size and sha256,
                                     counts, schema version, the batch config and the missing
                                     shards of a partial dataset; written last by finalize
    dataset/README.md                the dataset card, written by publish (it records the
                                     validation outcomes and the review decision)
    dataset/_COMMITTED.json          publish: the staged manifest plus the card, both validation
                                     outcomes and the review decision; the one object consumers
                                     trust (``tasks.publish``)

Assembled groups are streamed (a shard's at a time when finalizing): besides the rows being added,
at most one part is buffered and one is being written, in a background thread. Every object
is created once, so a crashed run that is repeated rewrites identical bytes (no-ops) and then
stages. A batch whose staged manifest exists is not built again: :func:`stage_dataset` returns
it without reading its groups. Readers trust only what a manifest names and check each file's
size and sha256 (:func:`read_dataset_part`).
"""

from __future__ import annotations

import dataclasses
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

from tasks.checks import check_int, is_int
from tasks.config import BatchConfig
from tasks.finalize.assemble import AssembledRows
from tasks.finalize.dataset_schema import DATASET_SCHEMA_VERSION, DatasetRow
from tasks.finalize.metrics import DatasetMetrics
from tasks.ids import check_id
from tasks.review import MalformedReviewError, ReviewDecision, upgrade_record
from tasks.schema import read_parquet_bytes
from tasks.storage import layout
from tasks.storage.marker import MalformedMarkerError, MarkedFile, read_marked_bytes
from tasks.storage.objects import ObjectConflictError, ObjectStore
from tasks.strict_json import load_dataclass, parse_json

# 2: records missing_shards and partial; 3: files are MarkedFile (with their kind), validation outcomes;
# 4: the card is publish's (a staged manifest names none), the review decision
MARKER_VERSION = 4
READABLE_MARKER_VERSIONS = (3, 4)  # 3: a committed manifest with validation outcomes only (upgrade_manifest)
DEFAULT_ROWS_PER_PART = 8192
# Dictionary-encode the repetitive text columns only: on token lists it costs half the write time.
_DICTIONARY_COLUMNS = ["batch_id", "group_id", "mask_reason", "terminal_selection"]


class MalformedDatasetMarkerError(MalformedMarkerError):
    """A dataset marker (not a shard marker) that cannot be trusted."""


@dataclass(frozen=True)
class DatasetMarker:
    """``dataset/_COMMITTED.json``; constructing one checks names, order and counts.

    ``missing_shards`` lists (ascending) the planned shards a partial dataset was finalized
    without; ``partial`` is true exactly when there is one. ``card``, ``validation`` and
    ``review`` are None in the staged manifest; the committed one names the card and holds each
    suite's outcome, and the review decision when there was one (:mod:`tasks.review`).
    """

    batch_id: str
    schema_version: int
    parts: tuple[MarkedFile, ...]
    metrics: MarkedFile
    card: MarkedFile | None
    rows: int
    trainable_rows: int
    groups: int
    config: dict[str, Any]
    committed_at: float
    missing_shards: tuple[int, ...]
    partial: bool
    validation: dict[str, Any] | None = None
    review: ReviewDecision | None = None
    marker_version: int = MARKER_VERSION

    def __post_init__(self) -> None:
        if self.marker_version != MARKER_VERSION or self.schema_version != DATASET_SCHEMA_VERSION:
            raise MalformedDatasetMarkerError(
                f"marker_version {self.marker_version!r} / schema_version {self.schema_version!r} not supported "
                f"(expected {MARKER_VERSION} / {DATASET_SCHEMA_VERSION})"
            )
        try:
            check_id(self.batch_id, field="batch_id")
        except (TypeError, ValueError) as exc:
            raise MalformedDatasetMarkerError(str(exc)) from None
        if not self.parts or [p.path for p in self.parts] != [layout.dataset_part(i) for i in range(len(self.parts))]:
            raise MalformedDatasetMarkerError(f"parts must be {layout.dataset_part(0)} onwards, consecutively")
        if sum(p.rows for p in self.parts) != self.rows:
            raise MalformedDatasetMarkerError(f"rows {self.rows} differ from the rows of the named parts")
        card = () if self.card is None else (self.card,)
        if self.metrics.path != layout.DATASET_METRICS or any(c.path != layout.DATASET_CARD for c in card):
            raise MalformedDatasetMarkerError(
                f"metrics and card must be {layout.DATASET_METRICS} and {layout.DATASET_CARD}"
            )
        kinds = {"part": self.parts, "metrics": (self.metrics,), "card": card}
        wrong = [f.path for kind, files in kinds.items() for f in files if f.kind != kind]
        wrong += [f.path for f in (self.metrics, *card) if f.rows]
        if wrong:
            raise MalformedDatasetMarkerError(f"files {wrong} are marked with the wrong kind or rows")
        if self.review is not None and self.review.batch_id != self.batch_id:
            raise MalformedDatasetMarkerError(f"review is a decision on batch {self.review.batch_id!r}")
        check_int(self.trainable_rows, field="trainable_rows", maximum=self.rows, error=MalformedDatasetMarkerError)
        if self.config.get("batch_id") != self.batch_id:
            raise MalformedDatasetMarkerError(f"config is of batch {self.config.get('batch_id')!r}")
        try:
            _check_missing_shards(self.missing_shards, self.config.get("shards"))
        except ValueError as exc:
            raise MalformedDatasetMarkerError(str(exc)) from None
        if self.partial is not bool(self.missing_shards):
            raise MalformedDatasetMarkerError(f"partial is {self.partial!r} with missing shards {self.missing_shards}")

    @property
    def files(self) -> tuple[MarkedFile, ...]:
        return (*self.parts, self.metrics, *(() if self.card is None else (self.card,)))

    def same_content(self, other: DatasetMarker) -> bool:
        """Whether ``other`` commits the same files and counts (``committed_at`` aside)."""
        return dataclasses.replace(other, committed_at=self.committed_at) == self

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = layout.DATASET_MARKER) -> Self:
        """The marker ``text`` holds; :class:`MalformedDatasetMarkerError` naming the field for anything else."""
        raw = upgrade_manifest(parse_json(text, source=source, error=MalformedDatasetMarkerError), source=source)
        return load_dataclass(cls, raw, source=source, error=MalformedDatasetMarkerError, require_all=True)


def upgrade_manifest(raw: object, *, source: str) -> object:
    """A parsed dataset manifest of an older version in the current shape, or the refusal that says what to do.

    * 4: as it is, an embedded review decision of record version 1 upgraded (:func:`tasks.review.upgrade_record`);
    * 3, committed (with validation outcomes, ``_COMMITTED.json`` since publish was gated): read as 4
      without a review decision, which version 3 did not have: it was published with both suites
      passed or warned, before warned batches waited for one;
    * 3 staged, 3 committed before validation existed, 2 and 1: refused. Publish cannot commit a
      version-3 staged dataset (finalize wrote a card, publish writes its own), and nothing vouches
      that an older committed one passed validation; the message says how to build it again.
    """
    if not isinstance(raw, dict) or "marker_version" not in raw:
        return raw  # the loader names what is wrong with it
    version = raw["marker_version"]
    if type(version) is not int or not 1 <= version <= MARKER_VERSION:
        newer = type(version) is int and version > MARKER_VERSION
        step = "it was written by newer code: read it with that code" if newer else "no code ever wrote it"
        raise MalformedDatasetMarkerError(_unsupported(source, version, step))
    if version == MARKER_VERSION:
        if isinstance(raw.get("review"), dict):
            try:
                return raw | {"review": upgrade_record(raw["review"], source=f"{source}.review")}
            except MalformedReviewError as exc:
                raise MalformedDatasetMarkerError(str(exc)) from None
        return raw
    if version == 3 and isinstance(raw.get("validation"), dict):
        return raw | {"review": None, "marker_version": MARKER_VERSION}
    if version == 1:
        step = (
            "version 1 predates validation and its batch's config is version 1: re-plan the batch under a new batch "
            "id and generate it again"
        )
    else:
        what = (
            "a staged dataset whose card finalize wrote"
            if version == 3 and "validation" in raw
            else "a dataset published without validation"
        )
        step = (
            f"it is {what}: copy the batch's plan/, staging/ and ledger/ (not dataset/ or reports/) under a new "
            "root and run `rollout-ledger finalize --root NEW_ROOT --batch-id BATCH_ID` on the copy"
        )
    raise MalformedDatasetMarkerError(_unsupported(source, version, step))


def _unsupported(source: str, version: object, step: str) -> str:
    return (
        f"{source}: marker_version {version!r} is not supported (this code reads {list(READABLE_MARKER_VERSIONS)}, "
        f"version 3 only as a published manifest with validation outcomes); {step}"
    )


@dataclass(frozen=True)
class StagedDataset:
    """Where a batch's dataset is and what its manifest names; ``created`` is False for a no-op."""

    url: str
    marker: DatasetMarker
    created: bool


def read_staged_marker(store: ObjectStore) -> DatasetMarker | None:
    """The dataset as finalize built it (``dataset/_STAGED.json``; ``store`` is the batch's), or None."""
    return _read_manifest(store, layout.DATASET_STAGED, validated=False)


def read_dataset_marker(store: ObjectStore) -> DatasetMarker | None:
    """The published dataset (``dataset/_COMMITTED.json``, with its validation outcomes), or None."""
    return _read_manifest(store, layout.DATASET_MARKER, validated=True)


def _read_manifest(store: ObjectStore, path: str, *, validated: bool) -> DatasetMarker | None:
    try:
        data = store.read_bytes(path)
    except FileNotFoundError:
        return None
    marker = DatasetMarker.from_json(data, source=f"{store.url}/{path}")
    published = {"validation outcomes": marker.validation, "card": marker.card}
    wrong = [name for name, value in published.items() if (value is not None) != validated]
    if wrong or (not validated and marker.review is not None):
        raise MalformedDatasetMarkerError(
            f"{store.url}/{path}: {', '.join(wrong) or 'review'} {'missing' if validated else 'present'}"
        )
    return marker


def read_dataset_part(store: ObjectStore, part: MarkedFile) -> pa.Table:
    """A part the marker names, after checking its size and sha256 and its schema."""
    table = read_parquet_bytes(read_marked_bytes(store, part, marker="the dataset marker"), use_threads=True)
    DatasetRow.check_table(table, source=f"{store.url}/{part.path}")
    return table


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
    _check_missing_shards(missing, config.shards)
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


def _check_missing_shards(missing: Sequence[int], shards: int) -> None:
    """ValueError unless ``missing`` holds distinct shard numbers of a batch of ``shards`` shards, ascending."""
    numbers = is_int(shards) and all(is_int(s) for s in missing)
    if not numbers or list(missing) != sorted(set(missing)) or not all(0 <= s < shards for s in missing):
        raise ValueError(f"missing shards {list(missing)!r} must be distinct shard numbers in [0, {shards}), ascending")


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
