"""A shard's commit marker, ``ledger/shard-K/_COMMITTED.json`` (docs/architecture.md §2 and §10).

The marker is written last, once, and is the only thing readers trust: it names every object
of the shard's committed data (staging segments, ledger files of the committing attempt and
the files it adopted from earlier attempts) with size, sha256 and row count, plus counts that
must agree with those rows. A marker that breaks any of these rules is refused with
:class:`MalformedMarkerError`; every file path must be the layout's own name for an object of
this shard in an attempt no later than the committing one, and a compacted ledger file
(``{kind}-compacted-NNNNNN.parquet``) must be the committing attempt's own: only its own
attempt's marker makes one valid (recovery never reads them).

Two figures count calls (:class:`ShardCounts`): ``calls_recorded``, the rows of the named calls
files (a row sum like the other counts, checked here), and ``calls_used``, the calls the
receipted rollouts' manifests hold, each once (:func:`calls_in_manifests`, the rule of
:mod:`tasks.storage.rollout_manifest`), computed by the writer at commit: the named files also
hold calls no manifest uses (an earlier attempt's, diverged from, not replayed, or in flight at
its end). Marker version 2 has both; version 1 (``counts.calls``, the row sum) is read with
``calls_used`` unknown (None): :class:`~tasks.storage.ledger_reader.LedgerReader` computes it
from the named files.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Self

import numpy as np
import pyarrow as pa

from tasks import layout
from tasks.checks import check_choice, check_finite, check_hex_digest, check_int
from tasks.errors import MalformedMarkerError, SegmentChecksumMismatchError
from tasks.ids import check_id
from tasks.storage.objects import ObjectStore, WrittenObject, sha256_hex
from tasks.storage.rollout_manifest import rollout_manifests
from tasks.strict_json import load_dataclass, parse_json

MARKER_VERSION = 2  # 2: counts.calls_recorded and counts.calls_used (1: counts.calls, the row sum)
READABLE_MARKER_VERSIONS = (1, 2)
SHARD_FILE_KINDS = ("staging", *layout.LEDGER_KINDS)
DATASET_FILE_KINDS = ("part", "metrics", "card")
FILE_KINDS = (*SHARD_FILE_KINDS, *DATASET_FILE_KINDS)
_OBJECT_INDEX = re.compile(r"-(\d+)\.parquet$")


@dataclass(frozen=True)
class ShardObject:
    """What a staging or ledger object path of a shard says about itself.

    ``compacted``: a ledger file an attempt rewrote its own rows into at commit
    (:func:`tasks.layout.ledger_file`); it holds the same rows as that attempt's other files of
    its kind, so a reader takes one set or the other, never both.
    """

    kind: str
    attempt: int
    index: int
    compacted: bool = False


def parse_shard_object(path: str, shard: int) -> ShardObject:
    """Kind, attempt, index and compaction of ``path``; ValueError unless it is the layout's name for them."""
    if not isinstance(path, str):
        raise ValueError(f"object path must be a str, got {path!r}")
    compacted = False
    if path.startswith(layout.staging_shard_dir(shard) + "/"):
        kind = "staging"
    elif path.startswith(layout.ledger_shard_dir(shard) + "/"):
        name = path.rsplit("/", 1)[-1]
        kind = name.split("-", 1)[0]
        if kind not in layout.LEDGER_KINDS:
            raise ValueError(f"{path!r} is not a ledger file of kind {layout.LEDGER_KINDS}")
        compacted = name.startswith(f"{kind}-{layout.COMPACTED_INFIX}")
    else:
        raise ValueError(f"{path!r} is outside the staging and ledger directories of shard {shard}")
    index_match = _OBJECT_INDEX.search(path)
    if index_match is None:
        raise ValueError(f"{path!r} does not end in a -NNNNNN.parquet object index")
    attempt, index = layout.attempt_of(path), int(index_match.group(1))
    expected = (
        layout.staging_segment(shard, attempt, index)
        if kind == "staging"
        else layout.ledger_file(shard, attempt, kind, index, compacted=compacted)
    )
    if path != expected:
        raise ValueError(f"{path!r} does not match the layout name {expected!r}")
    return ShardObject(kind=kind, attempt=attempt, index=index, compacted=compacted)


@dataclass(frozen=True)
class MarkedFile:
    """One object a marker (a shard's or the dataset's) names: batch-relative path, kind, size, sha256, rows.

    ``rows`` counts the rows of a Parquet object; a JSON or Markdown object (the dataset's metrics
    and card) holds 0.
    """

    path: str
    kind: str
    size: int
    sha256: str
    rows: int

    def __post_init__(self) -> None:
        check_choice(self.kind, FILE_KINDS, field=f"file {self.path!r}: kind", error=MalformedMarkerError)
        check_int(self.size, field=f"file {self.path!r}: size", error=MalformedMarkerError)
        check_int(self.rows, field=f"file {self.path!r}: rows", error=MalformedMarkerError)
        check_hex_digest(self.sha256, field=f"file {self.path!r}: sha256", error=MalformedMarkerError)

    @classmethod
    def of(cls, written: WrittenObject, *, kind: str, rows: int) -> Self:
        return cls(path=written.path, kind=kind, size=written.size, sha256=written.sha256, rows=rows)


def read_marked_bytes(store: ObjectStore, marked: MarkedFile, *, marker: str = "the commit marker") -> bytes:
    """The bytes of a file ``marker`` names, once they are the size and sha256 it recorded.

    :class:`SegmentChecksumMismatchError` names the file when it is missing or either differs:
    nothing a marker names is used before this check.
    """
    where = f"{store.url}/{marked.path}"
    try:
        data = store.read_bytes(marked.path)
    except FileNotFoundError:
        raise SegmentChecksumMismatchError(f"{where} is named by {marker} but missing") from None
    if len(data) != marked.size:
        raise SegmentChecksumMismatchError(f"{where} is {len(data)} bytes, {marker} names {marked.size}")
    actual = sha256_hex(data)
    if actual != marked.sha256:
        raise SegmentChecksumMismatchError(f"{where} has sha256 {actual}, {marker} names {marked.sha256}")
    return data


@dataclass(frozen=True)
class ShardCounts:
    """Counts a marker commits; each but ``calls_used`` equals a sum over the rows of the named files.

    ``staged_rows``/``calls_recorded``/``failures``: rows of the named staging, calls and failures
    files (leftover rows of un-receipted rollouts in adopted files included); ``rollouts``: rows of
    the named receipts files, split by status into ``ok``/``poisoned``/``failed``;
    ``adopted_rollouts``: receipts rows in files of earlier attempts. ``calls_used``: the calls the
    receipted rollouts' manifests hold, each once (:func:`calls_in_manifests`), at most
    ``calls_recorded``; None for a version-1 marker, which did not record it.
    """

    rollouts: int
    ok: int
    poisoned: int
    failed: int
    calls_recorded: int
    calls_used: int | None
    failures: int
    staged_rows: int
    adopted_rollouts: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "calls_used" or self.calls_used is not None:
                check_int(getattr(self, f.name), field=f"counts.{f.name}", error=MalformedMarkerError)
        if self.ok + self.poisoned + self.failed != self.rollouts:
            raise MalformedMarkerError(
                f"counts: ok {self.ok} + poisoned {self.poisoned} + failed {self.failed} != rollouts {self.rollouts}"
            )
        if self.adopted_rollouts > self.rollouts:
            raise MalformedMarkerError(
                f"counts: adopted_rollouts {self.adopted_rollouts} exceeds rollouts {self.rollouts}"
            )
        if self.calls_used is not None and self.calls_used > self.calls_recorded:
            raise MalformedMarkerError(
                f"counts: calls_used {self.calls_used} exceeds calls_recorded {self.calls_recorded}"
            )


def calls_in_manifests(calls: pa.Table, call_attempts: np.ndarray, receipts: pa.Table) -> int:
    """How many call rows of ``calls`` the manifests of ``receipts`` hold, each row once however many
    manifests name it: a marker's ``calls_used`` (arguments as :func:`~tasks.storage.rollout_manifest.rollout_manifests`
    takes them)."""
    return int(np.unique(rollout_manifests(calls, call_attempts, receipts).rows).size)


_COUNT_OF_KIND = {"staging": "staged_rows", "calls": "calls_recorded", "failures": "failures", "receipts": "rollouts"}


@dataclass(frozen=True)
class ShardMarker:
    """The commit marker of one shard; constructing one checks every rule of the module docstring."""

    batch_id: str
    shard: int
    attempt: int
    files: tuple[MarkedFile, ...]
    counts: ShardCounts
    committed_at: float
    marker_version: int = MARKER_VERSION

    def __post_init__(self) -> None:
        problem = _version_problem(self.marker_version)
        if problem is not None:
            raise MalformedMarkerError(problem)
        if isinstance(self.counts, ShardCounts) and (self.counts.calls_used is None) != (self.marker_version == 1):
            raise MalformedMarkerError(
                f"counts.calls_used is {self.counts.calls_used!r}: a version-{self.marker_version} marker "
                + ("does not record it (None)" if self.marker_version == 1 else "records it (an int)")
            )
        try:
            check_id(self.batch_id, field="batch_id")
        except (TypeError, ValueError) as exc:
            raise MalformedMarkerError(str(exc)) from None
        check_int(self.shard, field="shard", error=MalformedMarkerError)
        check_int(self.attempt, field="attempt", error=MalformedMarkerError)
        check_finite(self.committed_at, field="committed_at", error=MalformedMarkerError)
        if not isinstance(self.files, tuple) or not all(isinstance(f, MarkedFile) for f in self.files):
            raise MalformedMarkerError("files must be a tuple of MarkedFile")
        if not isinstance(self.counts, ShardCounts):
            raise MalformedMarkerError("counts must be ShardCounts")
        sums = dict.fromkeys(_COUNT_OF_KIND.values(), 0)
        adopted = 0
        seen: set[str] = set()
        for marked in self.files:
            if marked.path in seen:
                raise MalformedMarkerError(f"file {marked.path!r} is named twice")
            seen.add(marked.path)
            try:
                parsed = parse_shard_object(marked.path, self.shard)
            except ValueError as exc:
                raise MalformedMarkerError(f"marker of shard {self.shard}: {exc}") from None
            if parsed.kind != marked.kind:
                raise MalformedMarkerError(f"file {marked.path!r} is a {parsed.kind} object, marked as {marked.kind}")
            if parsed.attempt > self.attempt:
                raise MalformedMarkerError(
                    f"file {marked.path!r} belongs to attempt {parsed.attempt}, after committing attempt {self.attempt}"
                )
            if parsed.compacted and parsed.attempt != self.attempt:
                raise MalformedMarkerError(
                    f"file {marked.path!r} is a compacted file of attempt {parsed.attempt}; only that attempt's "
                    f"own marker names one, this is attempt {self.attempt}'s"
                )
            sums[_COUNT_OF_KIND[marked.kind]] += marked.rows
            if marked.kind == "receipts" and parsed.attempt < self.attempt:
                adopted += marked.rows
        sums["adopted_rollouts"] = adopted
        for name, total in sums.items():
            if getattr(self.counts, name) != total:
                raise MalformedMarkerError(
                    f"counts.{name} is {getattr(self.counts, name)}, the named files hold {total} rows"
                )
        object.__setattr__(self, "files", tuple(sorted(self.files, key=lambda f: _file_order(f, self.shard))))

    @property
    def path(self) -> str:
        return layout.shard_marker(self.shard)

    def files_of(self, kind: str) -> tuple[MarkedFile, ...]:
        """Named files of ``kind`` in ledger order: attempt, then compacted files, then object index."""
        return tuple(f for f in self.files if f.kind == kind)

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no spaces, files in ledger order; a version-1 marker as version 1 wrote it."""
        raw = dataclasses.asdict(self)
        if self.marker_version == 1:
            counts = raw["counts"]
            counts["calls"] = counts.pop("calls_recorded")
            del counts["calls_used"]
        return json.dumps(raw, sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "marker") -> Self:
        """Parse and validate a marker; :class:`MalformedMarkerError` names ``source`` and the problem.

        The version is checked first, so a marker of another version is refused as such; a version-1
        marker's ``counts.calls`` reads as ``calls_recorded``, with ``calls_used`` unknown (None).
        """
        raw = parse_json(text, source=source, error=MalformedMarkerError)
        if isinstance(raw, dict):
            problem = _version_problem(raw.get("marker_version", MARKER_VERSION))
            if problem is not None:
                raise MalformedMarkerError(f"{source}: {problem}")
            if raw.get("marker_version") == 1 and isinstance(raw.get("counts"), dict):
                raw = raw | {"counts": _version_1_counts(raw["counts"], source=f"{source}.counts")}
        return load_dataclass(cls, raw, source=source, error=MalformedMarkerError, require_all=True)


def _version_1_counts(counts: dict[str, object], *, source: str) -> dict[str, object]:
    """A version-1 marker's counts in the current shape: ``calls`` (the row sum) as ``calls_recorded``, no
    ``calls_used``."""
    unknown = sorted({"calls_recorded", "calls_used"} & set(counts))
    if unknown:
        raise MalformedMarkerError(f"{source}: unknown field(s) {unknown} in a version-1 marker")
    if "calls" not in counts:
        raise MalformedMarkerError(f"{source}: missing field(s) ['calls']")
    upgraded = {key: value for key, value in counts.items() if key != "calls"}
    return upgraded | {"calls_recorded": counts["calls"], "calls_used": None}


def _version_problem(version: object) -> str | None:
    if type(version) is int and version in READABLE_MARKER_VERSIONS:
        return None
    newer = type(version) is int and version > MARKER_VERSION
    return f"marker_version {version!r} is not supported (this code reads {list(READABLE_MARKER_VERSIONS)})" + (
        "; it was written by newer code: read it with that code" if newer else ""
    )


def _file_order(marked: MarkedFile, shard: int) -> tuple[int, int, bool, int]:
    """Kind, attempt, compacted files first (they hold the attempt's rows from its first), index."""
    parsed = parse_shard_object(marked.path, shard)
    return (SHARD_FILE_KINDS.index(marked.kind), parsed.attempt, not parsed.compacted, parsed.index)


def write_marker(store: ObjectStore, marker: ShardMarker) -> WrittenObject:
    """Create the shard's marker once; an identical rewrite is a no-op, a different one an ObjectConflictError.

    ``store`` is rooted at the batch directory.
    """
    return store.write_once(marker.path, marker.to_json().encode("utf-8"))


def read_marker(store: ObjectStore, shard: int) -> ShardMarker | None:
    """The shard's validated marker, or None when the shard is not committed."""
    path = layout.shard_marker(shard)
    try:
        data = store.read_bytes(path)
    except FileNotFoundError:
        return None
    marker = ShardMarker.from_json(data, source=path)
    if marker.shard != shard:
        raise MalformedMarkerError(f"{path} is the marker of shard {marker.shard}, not {shard}")
    return marker
