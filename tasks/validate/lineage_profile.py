"""The lineage suite's profile: the committed ledger as small tables of scalars, computed with Arrow.

Only what the shards' ``_COMMITTED.json`` name is read, through :class:`LedgerReader` (sizes,
sha256 and record rules checked); a shard whose marker or ledger fails those checks is a row of
the ``shards`` table with its error, and contributes no other row. Tables (see
:data:`tasks.validate.suites.LINEAGE_TABLES`):

* ``shards``: every planned shard: ``committed``, ``ledger_verified`` (null when not committed), ``error``;
* ``call_keys``, ``calls``: every call record of the committed shards, in two narrow tables: its
  ``staging_key`` and staged row; its lengths, mode, weight version and ``has_parent``, with
  ``parent_resolves`` (a root, or its parent is a call record of its rollout), the parent's
  ``cum_len`` / ``weight_version`` (null for a root or an unresolved parent), and per digest
  ``{digest}_well_formed`` (:data:`HEX_DIGEST_REGEX`, matched with Arrow: the 64-character digests
  themselves never reach pandas, where GX's batch fingerprint hashed every one of them);
* ``model_calls``: every call id of the call records and failure rows, ``failed`` when a failure row names it;
* ``rollouts``: every planned rollout of the committed shards and every receipted one: ``planned``,
  ``receipts`` (count), ``poisoned`` (status poisoned; null without a receipt), ``failed_reason`` (the
  failure reason of a failed receipt, ``""`` for a receipt that did not fail, null without a receipt:
  :func:`failed_share`), ``capture_poisoned`` (finalize's rule, below; null for an unplanned receipt),
  ``declared_terminal`` (ok receipts only), and what its receipts replayed (null without a receipt;
  summed over its receipts, below): ``replayed``, ``replayed_found`` and ``restaged``. Before the
  lineage suite told failed receipts apart (``failed_rollout_rate``), ``poisoned`` was "status not ok".

A resumed rollout's receipt names the calls of earlier attempts it replayed (``replayed_calls``,
:mod:`tasks.capture.replay`); its manifest is those calls, then its own attempt's (the one rule:
:mod:`tasks.storage.rollout_manifest`). Per receipt, ``replayed`` counts them, ``replayed_found``
those the rule found (finalize's ``missing_replayed_call`` otherwise), and
``restaged`` the call records of its rollout in its own attempt whose ``chain_hash`` is one of
those calls' (a re-sampled copy of a committed call: the same parent chain and the same tokens).

A rollout is capture-poisoned, as finalize's guards decide (:mod:`tasks.finalize.verify.guards`),
when its receipt is poisoned for a reason other than terminal selection or a missing reward, or
when its attempt left a failure row on it, except a tolerated one on a call without a call record
(off the chain: the chain is made of call records).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks import layout
from tasks.batch import Batch
from tasks.errors import StorageIntegrityError
from tasks.finalize.verify.guards import OFF_CHAIN_TOLERATED_FAILURE, RECEIPT_REASONS
from tasks.ids import shard_name
from tasks.records.ledger import CallRecord, FailureRow, Receipt
from tasks.storage.ledger_reader import LedgerTables
from tasks.storage.objects import sha256_hex
from tasks.storage.rollout_manifest import rollout_manifests
from tasks.training_signal import FAILED
from tasks.validate.suites import REPLAY_COUNTS

PARALLEL_SHARDS = 2
HEX_DIGEST_REGEX = r"^[0-9a-f]{64}$"
DIGESTS = ("digest", "extras_digest", "chain_hash", "cumulative_hash")
# The columns of each call-record table the suite reads (see the module docstring).
_CALL_TABLES = {
    "call_keys": ("call_id", "staging_key", "staging_segment", "staging_row"),
    "calls": (
        "call_id",
        "has_parent",
        "mode",
        "prev_len",
        "delta_len",
        "cum_len",
        "parent_resolves",
        "parent_cum_len",
        "weight_version",
        "parent_weight_version",
        *(f"{name}_well_formed" for name in DIGESTS),
    ),
}


@dataclass(frozen=True)
class LedgerInputs:
    """What a lineage run reads: the committed shards and the sha256 of the config and of each shard marker."""

    committed: tuple[int, ...]
    digests: dict[str, str]


def lineage_inputs(batch: Batch) -> LedgerInputs:
    """The committed shards of the batch (those with a marker object) and the digests that identify the run's input."""
    store, config = batch.store, batch.config
    digests = {layout.plan_config(): sha256_hex(store.read_bytes(layout.plan_config()))}
    committed = []
    for shard in range(config.shards):
        try:
            digests[layout.shard_marker(shard)] = sha256_hex(store.read_bytes(layout.shard_marker(shard)))
        except FileNotFoundError:
            continue
        committed.append(shard)
    return LedgerInputs(committed=tuple(committed), digests=digests)


def profile_lineage(batch: Batch, inputs: LedgerInputs) -> dict[str, pa.Table]:
    """The six profile tables of the batch's committed shards.

    Shards are read :data:`PARALLEL_SHARDS` at a time (Parquet and Arrow work, mostly outside the GIL).
    """
    with ThreadPoolExecutor(PARALLEL_SHARDS, thread_name_prefix="lineage-profile") as pool:
        profiled = pool.map(functools.partial(_shard, batch), inputs.committed)
        read = dict(zip(inputs.committed, profiled, strict=True))
    profiles = [p for p in read.values() if isinstance(p, _ShardProfile)]
    config = batch.config
    numbers = range(config.shards)
    shards = pa.table(
        {
            "shard": [shard_name(s) for s in numbers],
            "committed": [s in read for s in numbers],
            "ledger_verified": [isinstance(read[s], _ShardProfile) if s in read else None for s in numbers],
            "error": [read[s] if isinstance(read.get(s), str) else None for s in numbers],
        },
        schema=_SHARDS_SCHEMA,
    )
    empty = _empty()
    return {
        "shards": shards,
        **_split_calls(_concat([p.calls for p in profiles], _calls(empty))),
        "model_calls": _concat([p.model_calls for p in profiles], _model_calls(empty)),
        "rollouts": _rollouts(
            pa.chunked_array([p.planned for p in profiles], pa.string()),
            _concat([p.receipts for p in profiles], _receipts(empty)),
        ),
    }


@dataclass(frozen=True)
class _ShardProfile:
    """One committed shard's rows of the calls, model_calls and receipts tables, and its planned rollout ids."""

    calls: pa.Table
    model_calls: pa.Table
    receipts: pa.Table
    planned: pa.Array


def _shard(batch: Batch, shard: int) -> _ShardProfile | str:
    """The profile of a committed shard, or why its marker or ledger cannot be trusted (reason: message)."""
    try:
        tables = batch.ledger(shard).tables
    except StorageIntegrityError as exc:
        return f"{exc.reason}: {exc}"
    plan = batch.shard_plan(shard)
    return _ShardProfile(
        calls=_calls(tables),
        model_calls=_model_calls(tables),
        receipts=_receipts(tables),
        planned=pa.array([p.rollout_id for p in plan], pa.string()),
    )


_SHARDS_SCHEMA = pa.schema(
    [("shard", pa.string()), ("committed", pa.bool_()), ("ledger_verified", pa.bool_()), ("error", pa.string())]
)


def _calls(tables: LedgerTables) -> pa.Table:
    """One shard's call records as the columns of :data:`_CALL_TABLES`: keys, lengths, parents, digest flags."""
    calls = tables.calls
    keys = pc.binary_join_element_wise(calls["rollout_id"], calls["call_id"], "/")
    parent_keys = pc.binary_join_element_wise(calls["rollout_id"], calls["parent_call_id"], "/")
    parent = pc.index_in(parent_keys, value_set=keys)
    has_parent = pc.is_valid(calls["parent_call_id"])
    columns = {name: calls[name] for name in ("call_id", "staging_segment", "staging_row", "mode")}
    columns |= {name: calls[name] for name in ("prev_len", "delta_len", "cum_len", "weight_version")}
    columns |= {
        "staging_key": keys,
        "has_parent": has_parent,
        "parent_resolves": pc.or_(pc.invert(has_parent), pc.is_valid(parent)),
        "parent_cum_len": pc.take(calls["cum_len"], parent),
        "parent_weight_version": pc.take(calls["weight_version"], parent),
    }
    columns |= {f"{name}_well_formed": pc.match_substring_regex(calls[name], HEX_DIGEST_REGEX) for name in DIGESTS}
    return pa.table(columns)


def _split_calls(calls: pa.Table) -> dict[str, pa.Table]:
    """The call records as the two narrow tables of :data:`_CALL_TABLES`, low-cardinality text dictionary-encoded.

    GX filters whole frames per expectation: narrow frames, and categories instead of strings, keep that cheap.
    """
    for name in ("staging_segment", "mode"):
        calls = calls.set_column(calls.schema.get_field_index(name), name, pc.dictionary_encode(calls[name]))
    return {name: calls.select(list(columns)) for name, columns in _CALL_TABLES.items()}


def _model_calls(tables: LedgerTables) -> pa.Table:
    """Every call id of one shard's call records and failure rows; ``failed`` when a failure row names it."""
    failed_ids = tables.failures["call_id"]
    ids = pc.unique(pa.chunked_array([*tables.calls["call_id"].chunks, *failed_ids.chunks], pa.string()))
    return pa.table({"call_id": ids, "failed": pc.is_in(ids, value_set=failed_ids)})


def _receipts(tables: LedgerTables) -> pa.Table:
    """One shard's receipts with their flags: poisoned, capture-poisoned (module docstring), declared terminal."""
    receipts = tables.receipts
    failures = tables.failures
    attempts = pa.array(tables.failure_attempts, pa.int64()).cast(pa.string())
    poisoning = pc.or_(
        pc.not_equal(failures["reason"], OFF_CHAIN_TOLERATED_FAILURE),
        pc.is_in(failures["call_id"], value_set=tables.calls["call_id"]),
    )
    poisoned_keys = pc.filter(pc.binary_join_element_wise(attempts, failures["rollout_id"], "/"), poisoning)
    receipt_keys = pc.binary_join_element_wise(receipts["attempt"].cast(pa.string()), receipts["rollout_id"], "/")
    status = receipts["status"]
    capture_reason = pc.and_(
        pc.equal(status, "poisoned"),
        pc.invert(
            pc.fill_null(pc.is_in(receipts["failure_reason"], value_set=pa.array(sorted(RECEIPT_REASONS))), False)
        ),
    )
    ok = pc.equal(status, "ok")
    failed = pc.equal(status, FAILED)
    failed_reason = pc.if_else(failed, pc.fill_null(receipts["failure_reason"], FAILED), "")
    declared = pc.if_else(
        ok, pc.fill_null(pc.equal(receipts["terminal_selection"], "declared"), False), pa.scalar(None, pa.bool_())
    )
    return pa.table(
        {
            "rollout_id": receipts["rollout_id"],
            "poisoned": pc.equal(status, "poisoned"),
            "failed_reason": failed_reason,
            "capture_poisoned": pc.or_(capture_reason, pc.is_in(receipt_keys, value_set=poisoned_keys)),
            "declared_terminal": declared,
            **_replays(tables, receipt_keys),
        }
    )


def _replays(tables: LedgerTables, receipt_keys: pa.ChunkedArray) -> dict[str, np.ndarray]:
    """Per receipt (``receipt_keys``: ``{attempt}/{rollout_id}``): ``replayed``, ``replayed_found``, ``restaged``.

    See the module docstring. What a receipt replayed and found is the one manifest rule's
    (:func:`tasks.storage.rollout_manifest.rollout_manifests`); a restaged copy is a call record whose
    ``{attempt}/{rollout_id}/{chain_hash}`` is a found replayed call's with the receipt's attempt.
    """
    receipts, calls = tables.receipts, tables.calls
    manifests = rollout_manifests(calls, tables.call_attempts, receipts)
    owner = pa.array(manifests.replayed_owner, pa.int64())
    found_hashes = pc.binary_join_element_wise(
        pc.take(receipts["attempt"], owner).cast(pa.string()),
        pc.take(receipts["rollout_id"], owner),
        pc.take(calls["chain_hash"], pa.array(manifests.replayed_rows, pa.int64())),
        "/",
    )
    call_attempt_keys = pc.binary_join_element_wise(
        pa.array(tables.call_attempts, pa.int64()).cast(pa.string()), calls["rollout_id"], "/"
    )
    restaged = pc.is_in(
        pc.binary_join_element_wise(call_attempt_keys, calls["chain_hash"], "/"), value_set=found_hashes
    )
    restaging_receipt = pc.index_in(pc.filter(call_attempt_keys, restaged), value_set=receipt_keys)
    return {
        "replayed": manifests.replayed,
        "replayed_found": manifests.replayed_found,
        "restaged": np.bincount(restaging_receipt.drop_null().to_numpy(), minlength=receipts.num_rows),
    }


def _rollouts(planned: pa.ChunkedArray, receipts: pa.Table) -> pa.Table:
    """Planned rollouts and receipted ones, one row each, with receipt counts and the flags of their receipt."""
    ids = pc.unique(pa.chunked_array([*planned.chunks, *receipts["rollout_id"].chunks], pa.string()))
    per_rollout = receipts.group_by("rollout_id", use_threads=False).aggregate(
        [
            ("rollout_id", "count"),
            ("poisoned", "first"),
            ("failed_reason", "first"),
            ("capture_poisoned", "first"),
            ("declared_terminal", "first"),
            *((name, "sum") for name in REPLAY_COUNTS),
        ]
    )
    found = pc.index_in(ids, value_set=per_rollout["rollout_id"])
    is_planned = pc.is_in(ids, value_set=planned)
    capture = pc.take(per_rollout["capture_poisoned_first"], found)
    return pa.table(
        {
            "rollout_id": ids,
            "planned": is_planned,
            "receipts": pc.fill_null(pc.take(per_rollout["rollout_id_count"], found), 0),
            "poisoned": pc.take(per_rollout["poisoned_first"], found),
            "failed_reason": pc.take(per_rollout["failed_reason_first"], found),
            # Over planned rollouts: one without a receipt is not capture-poisoned, an unplanned one is left out.
            "capture_poisoned": pc.if_else(is_planned, pc.fill_null(capture, False), pa.scalar(None, pa.bool_())),
            "declared_terminal": pc.take(per_rollout["declared_terminal_first"], found),
            **{name: pc.take(per_rollout[f"{name}_sum"], found) for name in REPLAY_COUNTS},
        }
    )


def failed_share(rollouts: pa.Table) -> float:
    """The share of the receipted rollouts (``failed_reason`` not null) whose receipt failed; 0 without receipts."""
    reasons = rollouts["failed_reason"]
    receipted = len(reasons) - reasons.null_count
    failed = pc.sum(pc.not_equal(reasons, "")).as_py() or 0
    return failed / receipted if receipted else 0.0


def _concat(tables: list[pa.Table], empty: pa.Table) -> pa.Table:
    return pa.concat_tables(tables) if tables else empty


@functools.cache
def _empty() -> LedgerTables:
    """A ledger without rows: the shape of each profile table when no shard could be read."""
    return LedgerTables(
        calls=CallRecord.arrow_schema().empty_table(),
        call_attempts=np.zeros(0, np.int64),
        failures=FailureRow.arrow_schema().empty_table(),
        failure_attempts=np.zeros(0, np.int64),
        receipts=Receipt.arrow_schema().empty_table(),
    )
