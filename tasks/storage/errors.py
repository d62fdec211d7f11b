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


class StorageUnavailableError(Exception):
    """A storage operation kept failing with transient errors until its retries ran out.

    Not an integrity problem, and never a :class:`StorageIntegrityError`: each object is complete
    or absent, the operation committed nothing a marker names, and running the stage again on
    healthy storage completes it. ``reason`` is stable; ``operation``, ``path``, ``attempts`` and
    ``last_error`` (also the ``__cause__``) say what failed.
    """

    reason = "storage_unavailable"

    def __init__(self, operation: str, path: str, *, attempts: int, seconds: float, last_error: BaseException) -> None:
        detail = str(last_error)
        if len(detail) > 300:
            detail = f"{detail[:300]}..."
        super().__init__(
            f"storage unavailable: {operation} {path} failed {attempts} time(s) in {seconds:.1f} s "
            f"(last error {type(last_error).__name__}: {detail}); nothing it wrote is trusted: "
            "run the stage again once storage is healthy"
        )
        self.operation = operation
        self.path = path
        self.attempts = attempts
        self.last_error = last_error
