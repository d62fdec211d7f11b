"""The dataset's two manifests: ``dataset/_STAGED.json`` (finalize) and ``dataset/_COMMITTED.json`` (publish).

Both are a :class:`DatasetMarker`: every file of the dataset (``dataset/part-NNNNN.parquet``,
``dataset/metrics.json``, and once published the card ``dataset/README.md``) with its size and
sha256, the counts, the dataset schema version, the batch config finalize used and the shards a
partial dataset was finalized without. The committed manifest adds each validation suite's outcome
and the review decision; it is the one object consumers trust. Readers trust only what a manifest
names and check each file's size and sha256 (:func:`read_dataset_part`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import pyarrow as pa

from tasks import layout
from tasks.checks import check_int, is_int
from tasks.errors import MalformedDatasetMarkerError
from tasks.ids import check_id
from tasks.records.dataset_row import DATASET_SCHEMA_VERSION, DatasetRow
from tasks.records.review import ReviewDecision
from tasks.schema import read_parquet_bytes
from tasks.storage.marker import MarkedFile, read_marked_bytes
from tasks.storage.objects import ObjectStore
from tasks.strict_json import load_dataclass, parse_json

# 2: records missing_shards and partial; 3: files are MarkedFile (with their kind), validation outcomes;
# 4: the card is publish's (a staged manifest names none), the review decision
MARKER_VERSION = 4


@dataclass(frozen=True)
class DatasetMarker:
    """``dataset/_COMMITTED.json``; constructing one checks names, order and counts.

    ``missing_shards`` lists (ascending) the planned shards a partial dataset was finalized
    without; ``partial`` is true exactly when there is one. ``card``, ``validation`` and
    ``review`` are None in the staged manifest; the committed one names the card and holds each
    suite's outcome, and the review decision when there was one (:mod:`tasks.records.review`).
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
            check_missing_shards(self.missing_shards, self.config.get("shards"))
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
        raw = parse_json(text, source=source, error=MalformedDatasetMarkerError)
        return load_dataclass(cls, raw, source=source, error=MalformedDatasetMarkerError, require_all=True)


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


def check_missing_shards(missing: Sequence[int], shards: int) -> None:
    """ValueError unless ``missing`` holds distinct shard numbers of a batch of ``shards`` shards, ascending."""
    numbers = is_int(shards) and all(is_int(s) for s in missing)
    if not numbers or list(missing) != sorted(set(missing)) or not all(0 <= s < shards for s in missing):
        raise ValueError(f"missing shards {list(missing)!r} must be distinct shard numbers in [0, {shards}), ascending")
