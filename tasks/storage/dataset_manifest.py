"""The dataset's two manifests: ``dataset/_STAGED.json`` (finalize) and ``dataset/_COMMITTED.json`` (publish).

Both are a :class:`DatasetMarker`: every file of the dataset (``dataset/part-NNNNN.parquet``,
``dataset/metrics.json``, and once published the card ``dataset/README.md``) with its size and
sha256, the counts, the dataset schema version, the batch config finalize used and the shards a
partial dataset was finalized without. The committed manifest adds each validation suite's outcome
and the review decision; it is the one object consumers trust. Readers trust only what a manifest
names and check each file's size and sha256 (:func:`read_dataset_part`). ``schema_version`` is
the dataset rows' (:data:`~tasks.records.dataset_row.DATASET_SCHEMA_VERSION`); parts of every readable
version are read as the current one (:func:`~tasks.records.dataset_row.upgrade_rows`).
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
from tasks.errors import MalformedDatasetMarkerError, MalformedReviewError
from tasks.ids import check_id
from tasks.records.dataset_row import READABLE_DATASET_SCHEMA_VERSIONS, DatasetRow, upgrade_rows
from tasks.records.review import ReviewDecision, upgrade_record
from tasks.schema import read_parquet_bytes
from tasks.storage.marker import MarkedFile, read_marked_bytes
from tasks.storage.objects import ObjectStore
from tasks.strict_json import load_dataclass, parse_json

# 2: records missing_shards and partial; 3: files are MarkedFile (with their kind), validation outcomes;
# 4: the card is publish's (a staged manifest names none), the review decision
MARKER_VERSION = 4
READABLE_MARKER_VERSIONS = (3, 4)  # 3: a committed manifest with validation outcomes only (upgrade_manifest)


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
        readable = self.schema_version in READABLE_DATASET_SCHEMA_VERSIONS and type(self.schema_version) is int
        if self.marker_version != MARKER_VERSION or not readable:
            raise MalformedDatasetMarkerError(
                f"marker_version {self.marker_version!r} / schema_version {self.schema_version!r} not supported "
                f"(expected {MARKER_VERSION} / one of {list(READABLE_DATASET_SCHEMA_VERSIONS)})"
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
        raw = upgrade_manifest(parse_json(text, source=source, error=MalformedDatasetMarkerError), source=source)
        return load_dataclass(cls, raw, source=source, error=MalformedDatasetMarkerError, require_all=True)


def upgrade_manifest(raw: object, *, source: str) -> object:
    """A parsed dataset manifest of an older version in the current shape, or the refusal that says what to do.

    * 4: as it is, an embedded review decision of record version 1 upgraded
      (:func:`tasks.records.review.upgrade_record`);
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
    """A part the marker names, after checking its size and sha256 and its schema, in the current schema
    (a part of an older version upgraded, :func:`~tasks.records.dataset_row.upgrade_rows`)."""
    data = read_marked_bytes(store, part, marker="the dataset marker")
    table = upgrade_rows(read_parquet_bytes(data, use_threads=True))
    DatasetRow.check_table(table, source=f"{store.url}/{part.path}")
    return table


def check_missing_shards(missing: Sequence[int], shards: int) -> None:
    """ValueError unless ``missing`` holds distinct shard numbers of a batch of ``shards`` shards, ascending."""
    numbers = is_int(shards) and all(is_int(s) for s in missing)
    if not numbers or list(missing) != sorted(set(missing)) or not all(0 <= s < shards for s in missing):
        raise ValueError(f"missing shards {list(missing)!r} must be distinct shard numbers in [0, {shards}), ascending")
