"""Every error that leaves a stage for its caller: its stable ``reason``, its exit code, and whether a retry helps.

Three facts about an error decide what a caller does with it, and they are declared here, on the
classes, once:

* ``reason``: a stable name that finalization reports and dashboards count (never renamed);
* ``exit_code``: how ``rollout-ledger`` exits: :data:`EXIT_USAGE` for input a person must fix,
  :data:`EXIT_CONFLICT` for a contradiction with what storage already holds, :data:`EXIT_FAILED`
  for the rest (a failed suite, a refused publish, an engine or storage that failed);
* ``retryable``: whether running the same command again can succeed. Airflow fails a task at once,
  without its retries, on an error that is not retryable.

Errors raised and caught inside one module (an environment's parse error, a capture admission
check, an HTTP 404 of the report viewer) stay in that module.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONFLICT = 0, 1, 2, 3
EXIT_SIGNAL_BASE = 128  # stopped by signal N: exit 128 + N
EXIT_CODES = {
    EXIT_OK: "done",
    EXIT_FAILED: "failed",
    EXIT_USAGE: "usage or input error",
    EXIT_CONFLICT: "conflict with what storage holds",
}


class LedgerError(Exception):
    """Base of the errors below; a subclass sets ``reason``, ``exit_code`` and ``retryable``."""

    reason = "error"
    exit_code = EXIT_FAILED
    retryable = True


class UsageError(LedgerError, ValueError):
    """Input a person must fix (a flag, a config field, an environment, a model path); the message names it."""

    reason = "usage_error"
    exit_code = EXIT_USAGE
    retryable = False


class ConflictError(LedgerError):
    """What was asked contradicts what storage already holds (an object, a plan, a decision, a model's hashes)."""

    reason = "conflict"
    exit_code = EXIT_CONFLICT
    retryable = False


class RefusedError(LedgerError, RuntimeError):
    """The batch may not go further as it stands (a suite failed it, publish refused it); retrying changes nothing."""

    reason = "refused"
    retryable = False


# --- input ----------------------------------------------------------------------------------


class ConfigError(UsageError):
    """A batch config field is missing, unknown or out of range; the message names it."""

    reason = "bad_config"


class StorageRootError(ConfigError):
    """A storage root that cannot be used as given: a malformed URL (``s3:/bucket``, ``file://host/path``), a
    scheme this install cannot write to, a root that does not exist (any command but plan), or one plan would
    create directly under ``/``. The message says what was probably meant and names the supported schemes
    (:mod:`tasks.storage.roots`); nothing was written."""

    reason = "bad_storage_root"


class UnknownBatchError(UsageError):
    """The root exists but holds no batch of that id; the message lists the batches it holds and the closest id."""

    reason = "unknown_batch"


class UncommittedShardsError(ConfigError):
    """Some planned shards have no commit marker; finalizing would silently drop their rollouts."""

    reason = "uncommitted_shards"


class NoCommittedShardsError(UncommittedShardsError):
    """No planned shard has a commit marker: there is nothing to finalize, even a partial dataset."""

    reason = "no_committed_shards"


class NothingToValidateError(UsageError):
    """The batch holds nothing the suite reads (no committed shard, no staged dataset); the message says what to run."""

    reason = "nothing_to_validate"


class EnvironmentLoadError(UsageError):
    """An environment spec or its options cannot be loaded; ``reason`` is one of :data:`ENVIRONMENT_LOAD_REASONS`."""

    def __init__(self, spec: str, reason: str, detail: str) -> None:
        super().__init__(f"environment {spec!r}: {detail} [{reason}]")
        self.spec, self.reason = spec, reason


ENVIRONMENT_LOAD_REASONS = (
    "unknown_environment",
    "bad_import_path",
    "module_not_found",
    "import_failed",
    "attribute_missing",
    "not_an_environment",
    "bad_options",
    "bad_prompt_file",
    "bad_task_file",
)


class PromptFileError(UsageError):
    """A prompt file that cannot be used: unreadable, malformed, changed, or too short."""

    reason = "bad_prompt_file"


class TaskFileError(PromptFileError):
    """An agent environment's task file that cannot be used: unreadable, malformed, changed, or too short."""

    reason = "bad_task_file"


class TriggerPolicyError(ConfigError):
    """A triggered run asks for what the trigger policy does not allow (tasks/trigger_policy.py); the message names
    the field and the rule."""

    reason = "refused_by_trigger_policy"


class AgentCommandError(UsageError):
    """An agent command that cannot run where generate runs (its executable is not found); the message says why."""

    reason = "bad_agent_command"


class SandboxUnavailableError(UsageError):
    """Agents must run in an OS sandbox and none can start on this host (no bwrap, no user namespaces)."""

    reason = "sandbox_unavailable"


class ModelReferenceError(UsageError):
    """A model reference that names nothing this worker can load."""

    reason = "bad_model_reference"


class ModelFolderError(UsageError):
    """A model path is not a usable local Hugging Face folder; ``reason`` names what is missing."""

    def __init__(self, path: object, reason: str, detail: str) -> None:
        super().__init__(f"model folder {path}: {reason}: {detail}")
        self.path = path
        self.reason = reason


class ReviewInputError(UsageError):
    """A decision from a person breaks a rule (empty reason, unknown choice, ...); the message names which."""

    reason = "bad_review_input"


class ProfileError(UsageError):
    """A periodic-batch profile file or one of its fields is invalid (the message names which)."""

    reason = "bad_profile"


# --- conflicts with storage -----------------------------------------------------------------


class ObjectConflictError(ConflictError, FileExistsError):
    """An object already exists under this name with different content."""

    reason = "object_conflict"


class PlanConflictError(ObjectConflictError):
    """The batch id was already planned with a different config; the message names the differing fields."""

    reason = "plan_conflict"


class ReviewConflictError(ObjectConflictError):
    """A decision that contradicts what the batch already holds (an earlier decision, a published dataset)."""

    reason = "review_conflict"


class ModelMismatchError(ConflictError, ValueError):
    """The model a worker resolved is not the one the batch was planned with (hashes differ)."""

    reason = "model_mismatch"


class StorageIntegrityError(ConflictError):
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


class LedgerConflictError(StorageIntegrityError):
    """The same call id was recorded twice with differing content."""

    reason = "ledger_conflict"


class CorruptLedgerFileError(StorageIntegrityError):
    """A ledger object that cannot be parsed or contradicts where it is stored."""

    reason = "corrupt_ledger_file"


class DuplicateReceiptError(StorageIntegrityError):
    """Two receipts for one rollout among the files a shard commits or adopts."""

    reason = "duplicate_receipt"


class UncommittedShardError(StorageIntegrityError):
    """A reader asked for a shard that has no commit marker (generate it first)."""

    reason = "uncommitted_shard"
    exit_code = EXIT_USAGE


class MalformedMarkerError(StorageIntegrityError, ValueError):
    """A commit marker that cannot be trusted: bad JSON, wrong version, missing or odd fields."""

    reason = "malformed_marker"


class MalformedDatasetMarkerError(MalformedMarkerError):
    """A dataset manifest (not a shard marker) that cannot be trusted."""


class MalformedClaimError(StorageIntegrityError):
    """An attempt claim that cannot be read as one."""

    reason = "malformed_claim"


class MalformedReviewError(StorageIntegrityError):
    """``reports/review.json`` cannot be trusted; the message names the file and the field."""

    reason = "malformed_review"


class MalformedSummaryError(StorageIntegrityError, ValueError):
    """A suite's ``summary.json`` that cannot be trusted; the message names the file and the field."""

    reason = "malformed_summary"


class SchemaMismatchError(LedgerError, ValueError):
    """A table does not have exactly the columns and types its record class declares."""

    reason = "schema_mismatch"


# --- failures: the batch's content, or the machinery under it -------------------------------


class ValidationFailedError(RefusedError):
    """A suite failed the batch: its failing expectations and report are in the message."""

    reason = "validation_failed"


PUBLISH_REFUSALS = ("not_staged", "not_validated", "validation_failed", "review_required", "rejected")


class PublishRefusedError(RefusedError):
    """The staged dataset may not be published (yet); ``reason`` is one of :data:`PUBLISH_REFUSALS`."""

    def __init__(self, message: str, *, reason: str) -> None:
        if reason not in PUBLISH_REFUSALS:
            raise ValueError(f"unknown publish refusal {reason!r}; known: {PUBLISH_REFUSALS}")
        super().__init__(message)
        self.reason = reason


class StorageUnavailableError(LedgerError):
    """A storage operation kept failing with transient errors until its retries ran out.

    Not an integrity problem, and never a :class:`StorageIntegrityError`: each object is complete
    or absent, the operation committed nothing a marker names, and running the stage again on
    healthy storage completes it. ``operation``, ``path``, ``attempts`` and ``last_error`` (also
    the ``__cause__``) say what failed.
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


class EngineError(LedgerError, RuntimeError):
    """The engine failed one request; the call is recorded as the failure row ``engine_error``."""

    reason = "engine_error"


class EngineDeadError(EngineError):
    """The engine itself is gone (its process died, it was closed, a refit left it unusable).

    Not a failure of the request in hand: the shard attempt ends without a commit marker and the
    rollouts in flight are re-run by the retry (docs/architecture.md, "Recovery").
    """

    reason = "engine_dead"


class ShardAlreadyCommittedError(LedgerError, RuntimeError):
    """Recovery was asked for a shard whose marker exists: there is nothing left to adopt."""

    reason = "shard_already_committed"


class GenerateInterrupted(LedgerError):
    """A signal stopped generation; completed rollouts were flushed, no shard marker was written."""

    reason = "interrupted"

    def __init__(self, signum: int, shards: Sequence[int]) -> None:
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name}: receipts of completed rollouts were flushed and no shard marker was written "
            f"(shards {list(shards)} stay uncommitted); run generate again to adopt them and re-run the rest"
        )
        self.signum = signum
        self.exit_code = EXIT_SIGNAL_BASE + signum


def exit_code(error: BaseException) -> int:
    """How ``rollout-ledger`` exits on ``error``: its class's code, 128 + 2 for Ctrl-C, else failed."""
    if isinstance(error, KeyboardInterrupt):
        return EXIT_SIGNAL_BASE + signal.SIGINT
    return error.exit_code if isinstance(error, LedgerError) else EXIT_FAILED


def is_retryable(error: BaseException) -> bool:
    """Whether running the same command again can succeed (unknown errors: yes)."""
    return not isinstance(error, LedgerError) or error.retryable
