"""The staged reader: fetches staged rows back by staging key, one read per segment (docs/architecture.md §5, §8).

Invariant: rows come back only from segments whose bytes match the committed sha256 (when
given) and whose schema is the :class:`StagedDelta` schema, and only when the row at the
coordinates holds the requested ``rollout_id/call_id``.

Bad contents and a failing store are told apart by type: whatever is wrong with what storage
holds (a segment absent, bytes that are not a staged-delta Parquet file, a checksum, a row past
the end or of another call, a row that breaks the staged delta's rules) raises a
:class:`StorageIntegrityError` whose ``reason`` names it and whose message names the segment (and
the staging key, for a row); any other exception is the store failing to answer
(:class:`~tasks.errors.StorageUnavailableError` once its retries ran out, credentials,
permissions), never a verdict on the contents.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.errors import (
    CallIdMismatchError,
    DuplicateStagingKeyError,
    MissingStagingRowError,
    SchemaMismatchError,
    SegmentChecksumMismatchError,
    StagingKeyMismatchError,
    StorageIntegrityError,
)
from tasks.records.ledger import StagedDelta
from tasks.schema import read_parquet_bytes
from tasks.storage.objects import ObjectStore, sha256_hex
from tasks.storage.staging import CommitCoordinates

DEFAULT_CACHED_SEGMENTS = 4
INVALID_STAGED_ROW = "invalid_staged_row"  # the reason of bytes, a schema or a row that is not a staged delta


class StagedReader:
    """Fetches staged rows by ``(staging_key, coordinates)``, one read per segment.

    ``segment_sha256`` maps segment paths to the sha256 a commit marker recorded; when given,
    only those segments are read and each must match. Parsed segments are kept in a small
    LRU across calls (``cached_segments``, 0 disables it).
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        segment_sha256: Mapping[str, str] | None = None,
        cached_segments: int = DEFAULT_CACHED_SEGMENTS,
    ) -> None:
        self._store = store
        self._segment_sha256 = dict(segment_sha256) if segment_sha256 is not None else None
        self._cached_segments = cached_segments
        self._cache: OrderedDict[str, pa.Table] = OrderedDict()
        self._lock = threading.Lock()

    def fetch(self, requests: Sequence[tuple[str, CommitCoordinates]]) -> pa.Table:
        """The requested rows, in request order, as a table with the :class:`StagedDelta` schema.

        Raises :class:`DuplicateStagingKeyError`, :class:`MissingStagingRowError`,
        :class:`SegmentChecksumMismatchError`, :class:`StagingKeyMismatchError` or
        :class:`CallIdMismatchError`, each naming the key, segment and row.
        """
        schema = StagedDelta.arrow_schema()
        if not requests:
            return schema.empty_table()
        seen: set[str] = set()
        by_segment: dict[str, list[int]] = {}
        for position, (key, coords) in enumerate(requests):
            if key.count("/") != 1:
                raise ValueError(f"staging key {key!r} is not of the form rollout_id/call_id")
            if key in seen:
                raise DuplicateStagingKeyError(f"staging key {key} is requested twice")
            seen.add(key)
            by_segment.setdefault(coords.segment, []).append(position)
        parts: list[pa.Table] = []
        order: list[int] = []
        for segment, positions in by_segment.items():
            table = self.segment(segment)
            rows = [requests[p][1].row for p in positions]
            for position, row in zip(positions, rows, strict=True):
                if not 0 <= row < table.num_rows:
                    key = requests[position][0]
                    raise MissingStagingRowError(
                        f"staging key {key}: row {row} is past the {table.num_rows} rows of segment {segment}"
                    )
            part = table.take(pa.array(rows, type=pa.int64()))
            _check_keys(part, [requests[p][0] for p in positions], segment, rows)
            parts.append(part)
            order.extend(positions)
        combined = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        if order != sorted(order):
            combined = combined.take(pa.array(np.argsort(np.asarray(order), kind="stable")))
        return combined

    def fetch_records(self, requests: Sequence[tuple[str, CommitCoordinates]]) -> list[StagedDelta]:
        """The requested rows as validated :class:`StagedDelta` records, in request order.

        Raises what :meth:`fetch` raises, and ``StorageIntegrityError`` with reason
        ``invalid_staged_row`` naming the first requested row that breaks the record's rules.
        """
        table = self.fetch(requests)
        try:
            return StagedDelta.from_table(table, source="staged rows")
        except (ValueError, TypeError) as invalid:
            raise _first_invalid_row(table, requests, invalid) from invalid

    def fetch_token_ids(self, requests: Sequence[tuple[str, CommitCoordinates]]) -> list[np.ndarray]:
        """Each requested row's ``token_ids_delta`` as a read-only int64 array, in request order."""
        column = self.fetch(requests).column("token_ids_delta").combine_chunks()
        offsets = column.offsets.to_numpy()
        flat = column.flatten().to_numpy(zero_copy_only=False)
        flat.flags.writeable = False
        return np.split(flat, offsets[1:-1] - offsets[0])

    def segment(self, segment: str) -> pa.Table:
        """Every row of ``segment`` with the :class:`StagedDelta` schema, after its checksum and schema checks.

        Raises :class:`SegmentChecksumMismatchError`, :class:`MissingStagingRowError` (a segment
        absent or not committed), or ``StorageIntegrityError`` with reason ``invalid_staged_row``
        for bytes that are not a Parquet file or one of another schema.
        """
        with self._lock:
            table = self._cache.get(segment)
            if table is not None:
                self._cache.move_to_end(segment)
                return table
        table = self._load(segment)
        if self._cached_segments > 0:
            with self._lock:
                self._cache[segment] = table
                while len(self._cache) > self._cached_segments:
                    self._cache.popitem(last=False)
        return table

    def _load(self, segment: str) -> pa.Table:
        expected = None
        if self._segment_sha256 is not None:
            expected = self._segment_sha256.get(segment)
            if expected is None:
                raise MissingStagingRowError(f"segment {segment} is not named by the commit marker")
        try:
            data = self._store.read_bytes(segment)
        except FileNotFoundError:
            raise MissingStagingRowError(f"segment {segment} does not exist") from None
        if expected is not None:
            actual = sha256_hex(data)
            if actual != expected:
                raise SegmentChecksumMismatchError(
                    f"segment {segment} has sha256 {actual}, the commit marker recorded {expected}"
                )
        try:
            # In-memory bytes: any error decoding them (pyarrow raises OSError for some) is theirs.
            table = StagedDelta.upgrade(read_parquet_bytes(data))  # a segment older than a column reads with its value
        except (pa.ArrowException, OSError) as exc:
            raise StorageIntegrityError(
                f"segment {segment} is not a readable Parquet file: {exc}", reason=INVALID_STAGED_ROW
            ) from exc
        try:
            StagedDelta.check_table(table, source=f"segment {segment}")
        except SchemaMismatchError as exc:
            raise StorageIntegrityError(str(exc), reason=INVALID_STAGED_ROW) from exc
        schema = StagedDelta.arrow_schema()
        return table if table.schema.equals(schema) else table.select(schema.names).cast(schema)


def _check_keys(part: pa.Table, keys: list[str], segment: str, rows: list[int]) -> None:
    """Raise when a fetched row holds another rollout or call than its staging key names."""
    requested = [key.split("/", 1) for key in keys]
    want_rollouts = pa.array([r[0] for r in requested], type=pa.string())
    want_calls = pa.array([r[1] for r in requested], type=pa.string())
    rollout_ok = pc.equal(part.column("rollout_id"), want_rollouts)
    call_ok = pc.equal(part.column("call_id"), want_calls)
    if pc.all(pc.and_(rollout_ok, call_ok)).as_py():
        return
    ok_rollouts = rollout_ok.to_numpy(zero_copy_only=False)
    ok_calls = call_ok.to_numpy(zero_copy_only=False)
    bad = int(np.flatnonzero(~(ok_rollouts & ok_calls))[0])
    found = f"{part.column('rollout_id')[bad].as_py()}/{part.column('call_id')[bad].as_py()}"
    where = f"staging key {keys[bad]}: row {rows[bad]} of segment {segment} holds {found}"
    if not ok_rollouts[bad]:
        raise StagingKeyMismatchError(where)
    raise CallIdMismatchError(where)


def _first_invalid_row(
    table: pa.Table, requests: Sequence[tuple[str, CommitCoordinates]], invalid: Exception
) -> StorageIntegrityError:
    """The error naming the first of ``requests`` (the rows of ``table``) whose row breaks the record's rules
    (``invalid``, what the rows together raised, if none does alone)."""
    for position, (key, coords) in enumerate(requests):
        try:
            StagedDelta.from_table(table.slice(position, 1))
        except (ValueError, TypeError) as exc:
            where = f"staging key {key}: row {coords.row} of segment {coords.segment}"
            return StorageIntegrityError(f"{where} is not a valid staged delta: {exc}", reason=INVALID_STAGED_ROW)
    return StorageIntegrityError(f"the staged rows are not valid staged deltas: {invalid}", reason=INVALID_STAGED_ROW)
