"""Test helpers that corrupt a committed batch on local disk, the way disk rot or a writer bug would.

:class:`BatchFiles` edits the objects of one batch directory in place. ``reseal=False`` leaves
the commit marker alone (disk rot: the marker's sha256 no longer matches); ``reseal=True``
rewrites the marker's size, sha256 and row counts for the edited object (a writer bug: the
marker vouches for the bad bytes, so only row-level verification can catch it).
Staged rows and ledger rows are edited as plain dicts through Arrow, never through the record
classes, whose constructors would refuse the corruptions under test.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks import layout
from tasks.records import digest as dg
from tasks.records.ledger import CallRecord, FailureRow, Receipt, StagedDelta
from tasks.storage.marker import calls_in_manifests
from tasks.storage.staging import encode_segment

Row = dict[str, Any]
SCHEMAS = {"staging": StagedDelta, "calls": CallRecord, "failures": FailureRow, "receipts": Receipt}


class BatchFiles:
    """The objects of one committed shard of a local batch directory, editable row by row."""

    def __init__(self, batch_dir: Path, shard: int = 0) -> None:
        self.dir = batch_dir
        self.shard = shard

    # --- whole objects ---------------------------------------------------------------------

    @property
    def marker_path(self) -> Path:
        return self.dir / layout.shard_marker(self.shard)

    def marker(self) -> dict[str, Any]:
        return json.loads(self.marker_path.read_text())

    def files(self, kind: str) -> list[str]:
        return [f["path"] for f in self.marker()["files"] if f["kind"] == kind]

    def read_rows(self, path: str) -> list[Row]:
        return pq.read_table(self.dir / path).to_pylist()

    def write_rows(self, path: str, rows: list[Row], *, reseal: bool) -> None:
        kind = self._kind(path)
        table = pa.Table.from_pylist(rows, schema=SCHEMAS[kind].arrow_schema())
        if kind == "staging":
            data = encode_segment(table)
        else:
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, compression="zstd")
            data = sink.getvalue().to_pybytes()
        self.write_bytes(path, data, reseal=reseal, rows=len(rows))

    def write_bytes(self, path: str, data: bytes, *, reseal: bool, rows: int | None = None) -> None:
        (self.dir / path).write_bytes(data)
        if reseal:
            self._reseal(path, data, rows)

    def add_file(self, kind: str, rows: list[Row]) -> str:
        """Commit a new ledger file of ``kind`` in attempt 0 holding ``rows``; returns its path."""
        index = len(self.files(kind))
        path = layout.ledger_file(self.shard, 0, kind, index)
        marker = self.marker()
        marker["files"].append({"path": path, "kind": kind, "size": 0, "sha256": "0" * 64, "rows": len(rows)})
        self._write_marker(marker)
        self.write_rows(path, rows, reseal=True)
        return path

    def delete(self, path: str, *, reseal: bool) -> None:
        (self.dir / path).unlink()
        if reseal:
            marker = self.marker()
            marker["files"] = [f for f in marker["files"] if f["path"] != path]
            self._write_marker(marker)

    # --- rows by call / rollout ------------------------------------------------------------

    def call(self, call_id: str) -> tuple[str, int, Row]:
        """(calls file, row index, row) of a call record."""
        for path in self.files("calls"):
            for index, row in enumerate(self.read_rows(path)):
                if row["call_id"] == call_id:
                    return path, index, row
        raise KeyError(call_id)

    def staged(self, call_id: str) -> tuple[str, int, Row]:
        """(segment, row index, row) of a call's staged delta, found through its call record."""
        _, _, record = self.call(call_id)
        segment, row = record["staging_segment"], record["staging_row"]
        return segment, row, self.read_rows(segment)[row]

    def edit_staged(self, call_id: str, edit: Callable[[Row], None], *, reseal: bool = True) -> None:
        segment, index, _ = self.staged(call_id)
        rows = self.read_rows(segment)
        edit(rows[index])
        self.write_rows(segment, rows, reseal=reseal)

    def edit_call(self, call_id: str, edit: Callable[[Row], None]) -> None:
        path, index, _ = self.call(call_id)
        rows = self.read_rows(path)
        edit(rows[index])
        self.write_rows(path, rows, reseal=True)

    def edit_rows(self, path: str, edit: Callable[[list[Row]], None], *, reseal: bool = True) -> None:
        rows = self.read_rows(path)
        edit(rows)
        self.write_rows(path, rows, reseal=reseal)

    def receipts_file(self, rollout_id: str) -> str:
        """The receipts file holding the rollout's receipt (receipts are flushed as rollouts end: any file)."""
        for path in self.files("receipts"):
            if any(row["rollout_id"] == rollout_id for row in self.read_rows(path)):
                return path
        raise KeyError(rollout_id)

    def edit_receipt(self, rollout_id: str, edit: Callable[[Row], None]) -> None:
        self.edit_rows(self.receipts_file(rollout_id), lambda rows: edit(_row_of(rows, rollout_id)))

    def drop_receipt(self, rollout_id: str) -> None:
        self.edit_rows(self.receipts_file(rollout_id), lambda rows: rows.remove(_row_of(rows, rollout_id)))

    def sync_call(self, call_id: str, *fields: str) -> None:
        """Copy ``fields`` of the call's staged row into its call record (a writer that agrees with itself)."""
        _, _, staged = self.staged(call_id)
        self.edit_call(call_id, lambda row: row.update({f: staged[f] for f in fields}))

    # --- internals -------------------------------------------------------------------------

    def _kind(self, path: str) -> str:
        if path.startswith("staging/"):
            return "staging"
        return path.rsplit("/", 1)[-1].split("-", 1)[0]

    def _reseal(self, path: str, data: bytes, rows: int | None) -> None:
        marker = self.marker()
        for entry in marker["files"]:
            if entry["path"] == path:
                entry["size"] = len(data)
                entry["sha256"] = hashlib.sha256(data).hexdigest()
                if rows is not None:
                    entry["rows"] = rows
        self._write_marker(marker)

    def _write_marker(self, marker: dict[str, Any]) -> None:
        """Write the marker with counts recomputed from the files it names (so it parses)."""
        rows_of = {kind: sum(f["rows"] for f in marker["files"] if f["kind"] == kind) for kind in SCHEMAS}
        statuses = [r["status"] for path in self._paths(marker, "receipts") for r in self.read_rows(path)]
        marker["counts"].update(
            staged_rows=rows_of["staging"],
            calls_recorded=rows_of["calls"],
            calls_used=self._calls_used(marker, rows_of["calls"]),
            failures=rows_of["failures"],
            rollouts=rows_of["receipts"],
            ok=statuses.count("ok"),
            poisoned=statuses.count("poisoned"),
            failed=statuses.count("failed"),
        )
        self.marker_path.write_text(json.dumps(marker, sort_keys=True, separators=(",", ":")))

    def _calls_used(self, marker: dict[str, Any], recorded: int) -> int:
        """The calls the receipts' manifests hold among the named call records, as a writer would count them; while
        a named file is missing or unreadable (being written, or corrupted on purpose), the marker's figure, at most
        ``recorded``."""
        try:
            calls = [pq.read_table(self.dir / path) for path in self._paths(marker, "calls")]
            receipts = [pq.read_table(self.dir / path) for path in self._paths(marker, "receipts")]
            attempts = np.repeat(
                [layout.attempt_of(p) for p in self._paths(marker, "calls")], [t.num_rows for t in calls]
            )
            return calls_in_manifests(
                _concat(calls, "calls"), np.asarray(attempts, np.int64), _concat(receipts, "receipts")
            )
        except (OSError, pa.ArrowException, KeyError, ValueError):
            return min(marker["counts"]["calls_used"], recorded)

    @staticmethod
    def _paths(marker: dict[str, Any], kind: str) -> list[str]:
        return [f["path"] for f in marker["files"] if f["kind"] == kind]


def _concat(tables: list[pa.Table], kind: str) -> pa.Table:
    columns = ("rollout_id", "call_id") if kind == "calls" else ("rollout_id", "attempt", "replayed_calls")
    if not tables:
        return SCHEMAS[kind].arrow_schema().empty_table().select(columns)
    return pa.concat_tables([t.select(columns) for t in tables])


def _row_of(rows: list[Row], rollout_id: str) -> Row:
    return next(row for row in rows if row["rollout_id"] == rollout_id)


def redigest(row: Row) -> None:
    """Recompute a staged row's digest over its fields as they are (a writer bug that seals bad data)."""
    row["digest"] = dg.digest_of_checked_call(
        rollout_id=row["rollout_id"],
        call_id=row["call_id"],
        parent_call_id=row["parent_call_id"],
        mode=row["mode"],
        prev_len=row["prev_len"],
        delta_len=row["delta_len"],
        cum_len=row["cum_len"],
        weight_version=row["weight_version"],
        ids=np.asarray(row["token_ids_delta"], np.int64).view(np.uint64),
        mask=np.asarray(row["token_mask_delta"], np.float32),
        logprobs=np.asarray(row["logprobs_delta"], np.float32),
        extras_digest=row["extras_digest"],
        chain_hash=row["chain_hash"],
        cumulative_hash=row["cumulative_hash"],
    )


def flip_hex(value: str) -> str:
    """The same digest with its first hex digit changed."""
    return ("1" if value[0] != "1" else "2") + value[1:]
