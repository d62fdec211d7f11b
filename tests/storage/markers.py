"""Marker factories for the storage tests: files a marker names, and markers whose counts agree."""

from __future__ import annotations

from typing import Any

from tasks import layout
from tasks.storage.marker import MarkedFile, ShardCounts, ShardMarker

from ._writer_process import BATCH

SHARD = 3


def marked_file(kind: str, attempt: int = 0, index: int = 0, rows: int = 1, *, compacted: bool = False) -> MarkedFile:
    """A file of shard :data:`SHARD` as a marker names it (size and sha256 made up)."""
    path = (
        layout.staging_segment(SHARD, attempt, index)
        if kind == "staging"
        else layout.ledger_file(SHARD, attempt, kind, index, compacted=compacted)
    )
    return MarkedFile(path=path, kind=kind, size=10, sha256="ab" * 32, rows=rows)


def marker_of(files: tuple[MarkedFile, ...] = (), **overrides: Any) -> ShardMarker:
    """A marker of shard :data:`SHARD` naming ``files``, its counts summed from them (every rollout ok)."""
    rows = {kind: sum(f.rows for f in files if f.kind == kind) for kind in ("staging", "calls", "failures", "receipts")}
    counts = ShardCounts(
        rollouts=rows["receipts"],
        ok=rows["receipts"],
        poisoned=0,
        failed=0,
        calls_recorded=rows["calls"],
        calls_used=rows["calls"],
        failures=rows["failures"],
        staged_rows=rows["staging"],
        adopted_rollouts=sum(
            f.rows for f in files if f.kind == "receipts" and layout.attempt_of(f.path) < overrides.get("attempt", 0)
        ),
    )
    fields: dict[str, Any] = {
        "batch_id": BATCH,
        "shard": SHARD,
        "attempt": 0,
        "files": files,
        "counts": counts,
        "committed_at": 1.5,
    }
    return ShardMarker(**(fields | overrides))
