"""Named storage errors. Each carries a stable ``reason`` string that finalization reports."""

from __future__ import annotations


class StorageIntegrityError(Exception):
    """Stored data contradicts what was committed; ``reason`` names how (a stable string)."""

    reason = "storage_integrity"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class SegmentChecksumMismatchError(StorageIntegrityError):
    reason = "segment_checksum_mismatch"


class MissingStagingRowError(StorageIntegrityError):
    reason = "missing_staging_row"


class DuplicateStagingKeyError(StorageIntegrityError):
    reason = "duplicate_staging_key"


class StagingKeyMismatchError(StorageIntegrityError):
    reason = "staging_key_mismatch"


class CallIdMismatchError(StorageIntegrityError):
    reason = "call_id_mismatch"


class UncommittedShardError(StorageIntegrityError):
    reason = "uncommitted_shard"


class LedgerConflictError(StorageIntegrityError):
    """The same call id was recorded twice with differing content."""

    reason = "ledger_conflict"
