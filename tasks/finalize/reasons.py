"""Stable reason strings of finalization (docs/architecture.md §8): why a rollout is not trainable.

Every reason a verdict (:class:`~tasks.finalize.verify.verdicts.VerifiedRollouts`) can carry is a constant here,
listed in :data:`ALL_REASONS` and described in :data:`DESCRIPTIONS` (one line each, for the docs
and reports). Storage reasons reuse the ``reason`` of :mod:`tasks.errors`; terminal
selection reasons reuse :mod:`tasks.capture.terminal`. The strings are a contract: tests assert
them and dashboards count them, so a reason is never renamed, only added.
"""

from __future__ import annotations

from tasks import errors
from tasks.capture import faults, terminal
from tasks.storage import ledger_files, marker, rollout_manifest

# --- guards: the receipt and the manifest, before any token is read ----------------------
MISSING_RECEIPT = "missing_receipt"
INVALID_RECEIPT = "invalid_receipt"
ROLLOUT_FAILED = "rollout_failed"
CAPTURE_POISONED = "capture_poisoned"
NO_REWARD = "no_reward"
DUPLICATE_STAGING_KEY = errors.DuplicateStagingKeyError.reason
DUPLICATE_MANIFEST_CALL_ID = "duplicate_manifest_call_id"

# --- storage: the committed objects --------------------------------------------------------
SEGMENT_CHECKSUM_MISMATCH = errors.SegmentChecksumMismatchError.reason
MISSING_STAGING_ROW = errors.MissingStagingRowError.reason
STAGING_KEY_MISMATCH = errors.StagingKeyMismatchError.reason
CALL_ID_MISMATCH = errors.CallIdMismatchError.reason
CORRUPT_LEDGER_FILE = ledger_files.CorruptLedgerFileError.reason
MALFORMED_MARKER = marker.MalformedMarkerError.reason
DUPLICATE_RECEIPT = ledger_files.DuplicateReceiptError.reason
STORAGE_INTEGRITY = errors.StorageIntegrityError.reason

# --- versions ------------------------------------------------------------------------------
UNSUPPORTED_SCHEMA = "unsupported_schema"
UNSUPPORTED_DIGEST = "unsupported_digest"

# --- staged row against its manifest record and the batch config -------------------------
# Manifest (call record) fields that the staged row repeats, in the order they are compared.
# rollout_id and call_id are the staging key: a row holding others is a fetch failure
# (staging_key_mismatch, call_id_mismatch), found before any field is compared.
MANIFEST_FIELDS = (
    "batch_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
    "finish_reason",
)
# Sampling columns of the staged row, compared with the batch config's sampling settings.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "logprobs_mode")


def wrong(field: str) -> str:
    """The reason for a staged row whose ``field`` differs from the manifest or the batch config."""
    if field not in MANIFEST_FIELDS and field not in SAMPLING_FIELDS:
        raise ValueError(f"{field!r} is not a compared field")
    return f"wrong_{field}"


INVALID_STAGED_ROW = "invalid_staged_row"
CORRUPT_DIGEST = "corrupt_digest"
CORRUPT_EXTRAS = "corrupt_extras"

# --- graph: the chain root→terminal in the manifest ----------------------------------------
MISSING_PARENT = "missing_parent"
MISSING_REPLAYED_CALL = rollout_manifest.MISSING_REPLAYED_CALL  # the one manifest rule's policy
PARENT_LENGTH_MISMATCH = "parent_length_mismatch"
LINEAGE_CYCLE = "lineage_cycle"
MISSING_TERMINAL = "missing_terminal"

# --- walk: the staged deltas root→terminal --------------------------------------------------
CHAIN_HASH_MISMATCH = "chain_hash_mismatch"
INVALID_MASK_ORDER = "invalid_mask_order"
EMPTY_GENERATION = "empty_generation"
CUMULATIVE_HASH_MISMATCH = "cumulative_hash_mismatch"

# --- sampling masks: each call's kept sets (tasks.records.sampling_mask) ------------------------
SAMPLING_MASK_MISSING = faults.SAMPLING_MASK_MISSING  # the capture's own name for the same fault
INVALID_SAMPLING_MASK = "invalid_sampling_mask"
CORRUPT_SAMPLING_MASK = "corrupt_sampling_mask"

# Terminal selection reasons a poisoned receipt may carry, or that re-attribution finds.
TERMINAL_REASONS = tuple(r for r in terminal.ATTRIBUTION_REASONS if r != terminal.SELECTED)

DESCRIPTIONS: dict[str, str] = {
    MISSING_RECEIPT: "a planned rollout of a committed shard has no receipt",
    INVALID_RECEIPT: "the receipt contradicts the plan or its manifest (group, call count, attribution)",
    ROLLOUT_FAILED: "the receipt says the rollout failed (an environment error)",
    CAPTURE_POISONED: "a capture failure row or a poisoned receipt: the tokens cannot be proven",
    NO_REWARD: "the receipt names a terminal call but the environment gave no reward",
    DUPLICATE_STAGING_KEY: "two call records of the rollout point at the same staged row",
    DUPLICATE_MANIFEST_CALL_ID: "a call id appears twice in the rollout's manifest",
    SEGMENT_CHECKSUM_MISMATCH: "a committed object's bytes differ from the sha256 its marker recorded",
    MISSING_STAGING_ROW: "commit coordinates point at a missing segment or past its rows",
    STAGING_KEY_MISMATCH: "the staged row at the coordinates belongs to another rollout",
    CALL_ID_MISMATCH: "the staged row at the coordinates is another call of the rollout",
    CORRUPT_LEDGER_FILE: "a committed ledger file cannot be parsed or contradicts its location",
    MALFORMED_MARKER: "the shard's commit marker cannot be trusted",
    DUPLICATE_RECEIPT: "the shard commits two receipts for one rollout",
    STORAGE_INTEGRITY: "stored data contradicts what was committed",
    UNSUPPORTED_SCHEMA: "the staged row's schema_version is not one this code reads",
    UNSUPPORTED_DIGEST: "the staged row's digest_version or extras_digest_version is not supported",
    **{
        wrong(f): f"the staged row's {f} differs from its call record in the ledger"
        + (" and the batch config" if f == "batch_id" else "")
        for f in MANIFEST_FIELDS
    },
    **{wrong(f): f"the staged row's {f} differs from the batch config's sampling settings" for f in SAMPLING_FIELDS},
    INVALID_STAGED_ROW: "a malformed staged row: list lengths, lengths rule, NaN, mask values, id range, hex",
    CORRUPT_DIGEST: "the recomputed call digest differs from the stored one",
    CORRUPT_EXTRAS: "extras_json does not parse, is not canonical, or does not match extras_digest",
    MISSING_PARENT: "a call on the chain names a parent that has no call record",
    MISSING_REPLAYED_CALL: "the receipt replays a call that no earlier attempt of its rollout recorded",
    PARENT_LENGTH_MISMATCH: "a child's prev_len differs from its parent's cum_len",
    LINEAGE_CYCLE: "following parents from the terminal comes back to a call already seen",
    MISSING_TERMINAL: "the receipt names no terminal call, or one without a call record",
    CHAIN_HASH_MISMATCH: "a call's chain hash differs from its parent's chain hash plus its delta ids",
    INVALID_MASK_ORDER: "a delta's mask is not carried (0) tokens followed by sampled (1) tokens",
    EMPTY_GENERATION: "a call on the chain sampled no token",
    CUMULATIVE_HASH_MISMATCH: "the terminal's cumulative hash differs from the hash of the linearized tokens",
    SAMPLING_MASK_MISSING: "a call sampled with top-p / top-k has no kept sets (staged by code that did not record "
    "them): its tokens cannot be renormalized as sampled",
    INVALID_SAMPLING_MASK: "a call's kept sets do not fit its sampled tokens (one set per token, ascending, the "
    "token in its set), or it holds kept sets while its sampling does not truncate",
    CORRUPT_SAMPLING_MASK: "a call's kept sets are not the ones its extras name (sampling.kept_sha256, which the "
    "call digest covers)",
    terminal.NO_RECORDS: "terminal selection: the rollout has no call records",
    terminal.DUPLICATE_CALL_ID: "terminal selection: a call id appears twice in the manifest",
    terminal.ORPHANED_ROW: "terminal selection: a call's parent is not in the manifest",
    terminal.NO_ROOT: "terminal selection: no call without a parent",
    terminal.AMBIGUOUS_TERMINAL: "terminal selection: the chain forks into several continuations",
    terminal.DECLARED_TERMINAL_NOT_CAPTURED: "terminal selection: the declared terminal has no call record",
    terminal.DECLARED_AMBIGUOUS: "terminal selection: the declaration matches several differing rows",
    terminal.WITNESS_DISAGREEMENT: "terminal selection: witnesses (or re-attribution) name different calls",
}

ALL_REASONS: tuple[str, ...] = tuple(DESCRIPTIONS)
