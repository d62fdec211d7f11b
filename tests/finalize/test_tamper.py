"""Tampered shards produced by the REAL vLLM engine: every corruption is caught with its named reason.

One guess_number shard is generated per module (real engine, real tokenizer, local disk) and
copied per case. Two flavours, as the issue asks:

* disk rot: bytes change under a marker that still vouches for the old ones, caught by the
  marker checksum (``segment_checksum_mismatch``), or ``missing_staging_row`` for a lost segment;
* writer bugs: the same corruptions re-sealed into the marker (new size, sha256, row counts), so
  only row-level verification can catch them, each with its own reason.

Each case asserts the exact reason of every rollout it damages and that every other rollout
verifies exactly as before (no collateral damage, and never a valid row from bad data).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tasks.finalize import reasons as r
from tasks.records import digest as dg

from .conftest import CommittedBatch, fresh_copy
from .tamper import BatchFiles, Row, flip_hex, redigest
from .verdicts import VerifiedRollout

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Target:
    """The ok multi-turn rollout a case damages: its chain root→terminal, and a bystander rollout."""

    rollout_id: str
    chain: tuple[str, ...]
    other_rollout_id: str
    other_call_id: str

    @property
    def root(self) -> str:
        return self.chain[0]

    @property
    def child(self) -> str:
        return self.chain[1]

    @property
    def terminal(self) -> str:
        return self.chain[-1]


@dataclass(frozen=True)
class Base:
    batch: CommittedBatch
    results: dict[str, VerifiedRollout]
    target: Target
    segment_readers: dict[str, set[str]]  # segment -> rollouts whose chain reads it
    segment_of: dict[str, str]  # call id -> segment


@pytest.fixture(scope="module")
def base(real_batch: CommittedBatch) -> Base:
    results = real_batch.verify()
    bundles = real_batch.bundles()
    for rollout_id, bundle in bundles.items():
        if bundle.receipt.status == "ok":
            assert results[rollout_id].reason is None, f"untampered real rollout {rollout_id} must verify"
    valid = [v for v in results.values() if v.valid]
    multi = max(valid, key=lambda v: v.num_turns)
    assert multi.num_turns >= 2, "the real engine produced no multi-turn ok rollout to tamper with"
    other = next(v for v in valid if v.rollout_id != multi.rollout_id)
    segment_of = {c.call_id: c.staging_segment for b in bundles.values() for c in b.manifest}
    readers: dict[str, set[str]] = {}
    for v in results.values():
        for span in v.call_spans:
            readers.setdefault(segment_of[span.call_id], set()).add(v.rollout_id)
    target = Target(
        rollout_id=multi.rollout_id,
        chain=tuple(span.call_id for span in multi.call_spans),
        other_rollout_id=other.rollout_id,
        other_call_id=other.call_spans[-1].call_id,
    )
    return Base(real_batch, results, target, readers, segment_of)


# A case edits a private copy and returns the rollouts it damages (None: just the target).
Edit = Callable[[BatchFiles, Target, Base], set[str] | None]


def staged(edit: Callable[[Row], None], call: str = "child", *, reseal: bool = True) -> Edit:
    def apply(files: BatchFiles, target: Target, base: Base) -> set[str]:
        call_id = getattr(target, call)
        files.edit_staged(call_id, edit, reseal=reseal)
        return base.segment_readers[base.segment_of[call_id]] if not reseal else {target.rollout_id}

    return apply


def staged_and_synced(edit: Callable[[Row], None], *fields: str, call: str = "child") -> Edit:
    """A writer bug that sealed bad data consistently: the staged row and its call record agree."""

    def apply(files: BatchFiles, target: Target, base: Base) -> None:
        files.edit_staged(getattr(target, call), edit)
        files.sync_call(getattr(target, call), *fields)

    return apply


def sampled_index(row: Row) -> int:
    return int(np.flatnonzero(np.asarray(row["token_mask_delta"]) == 1.0)[0])


def flip_token(row: Row) -> None:
    i = sampled_index(row)
    row["token_ids_delta"][i] = (row["token_ids_delta"][i] + 1) % 1000


def set_field(name: str, value: object) -> Callable[[Row], None]:
    return lambda row: row.update({name: value})


def chain_of(files: BatchFiles, call_id: str) -> str | None:
    _, _, record = files.call(call_id)
    return None if record["parent_call_id"] is None else files.call(record["parent_call_id"])[2]["chain_hash"]


def rechained_terminal_token(files: BatchFiles, target: Target, base: Base) -> None:
    parent_chain = chain_of(files, target.terminal)

    def edit(row: Row) -> None:
        flip_token(row)
        ids = np.asarray(row["token_ids_delta"], np.int64).view(np.uint64)
        row["chain_hash"] = dg.chain_hash_of_checked(parent_chain, ids)
        redigest(row)

    files.edit_staged(target.terminal, edit)
    files.sync_call(target.terminal, "chain_hash", "digest")


def raw_bytes(change: Callable[[bytes], bytes], *, reseal: bool) -> Edit:
    def apply(files: BatchFiles, target: Target, base: Base) -> set[str]:
        segment = base.segment_of[target.child]
        files.write_bytes(segment, change((files.dir / segment).read_bytes()), reseal=reseal)
        return base.segment_readers[segment]

    return apply


def flip_middle_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x5A]) + data[middle + 1 :]


def delete_segment(*, reseal: bool) -> Edit:
    def apply(files: BatchFiles, target: Target, base: Base) -> set[str]:
        segment = base.segment_of[target.child]
        files.delete(segment, reseal=reseal)
        return base.segment_readers[segment]

    return apply


def ledger_file(kind: str, edit: Callable[[list[Row]], None], *, reseal: bool) -> Edit:
    def apply(files: BatchFiles, target: Target, base: Base) -> set[str]:
        files.edit_rows(files.files(kind)[0], edit, reseal=reseal)
        return set(base.results)

    return apply


def call_record(edit: Callable[[Row, BatchFiles, Target], None], call: str = "child") -> Edit:
    def apply(files: BatchFiles, target: Target, base: Base) -> None:
        files.edit_call(getattr(target, call), lambda row: edit(row, files, target))

    return apply


def receipt(edit: Callable[[Row], None]) -> Edit:
    def apply(files: BatchFiles, target: Target, base: Base) -> None:
        files.edit_receipt(target.rollout_id, edit)

    return apply


def coordinates_of(files: BatchFiles, call_id: str) -> dict[str, object]:
    _, _, record = files.call(call_id)
    return {"staging_segment": record["staging_segment"], "staging_row": record["staging_row"]}


def swap_coordinates(files: BatchFiles, target: Target, base: Base) -> None:
    root, child = coordinates_of(files, target.root), coordinates_of(files, target.child)
    files.edit_call(target.root, lambda row: row.update(child))
    files.edit_call(target.child, lambda row: row.update(root))


def swap_payloads(files: BatchFiles, target: Target, base: Base) -> None:
    payload = ("token_ids_delta", "token_mask_delta", "logprobs_delta")
    _, _, root = files.staged(target.root)
    _, _, child = files.staged(target.child)
    files.edit_staged(target.root, lambda row: row.update({k: child[k] for k in payload}))
    files.edit_staged(target.child, lambda row: row.update({k: root[k] for k in payload}))


def drop_last_staged_row(files: BatchFiles, target: Target, base: Base) -> set[str]:
    segment = base.segment_of[target.child]
    owner = files.read_rows(segment)[-1]["rollout_id"]
    files.edit_rows(segment, lambda rows: rows.pop())
    return {owner} & set(base.segment_readers[segment])


def duplicate_call_record(files: BatchFiles, target: Target, base: Base) -> None:
    path, index, _ = files.call(target.child)
    files.edit_rows(path, lambda rows: rows.append(dict(rows[index])))
    files.edit_receipt(target.rollout_id, lambda row: row.update(num_calls=row["num_calls"] + 1))


def cycle(row: Row, files: BatchFiles, target: Target) -> None:
    _, _, last = files.call(target.terminal)
    prev_len = last["cum_len"]
    row.update(parent_call_id=target.terminal, mode="token_in", prev_len=prev_len, cum_len=prev_len + row["delta_len"])


def shift_lengths(row: Row) -> None:
    row["prev_len"] += 1
    row["cum_len"] += 1
    redigest(row)


def add_failure_row(files: BatchFiles, target: Target, base: Base) -> None:
    failure = {
        "batch_id": base.batch.config.batch_id,
        "rollout_id": target.rollout_id,
        "call_id": target.terminal,
        "parent_call_id": None,
        "reason": "staging_failed",
        "detail": "injected",
    }
    files.add_file("failures", [failure])


def set_carried_logprob(row: Row) -> None:
    row["logprobs_delta"][0] = -0.5


def set_sampled_logprob(value: float) -> Callable[[Row], None]:
    return lambda row: row["logprobs_delta"].__setitem__(sampled_index(row), value)


def first_mask_sampled(row: Row) -> None:
    row["token_mask_delta"][0] = 1.0
    redigest(row)


def no_sampled_tokens(row: Row) -> None:
    row["token_mask_delta"] = [0.0] * row["delta_len"]
    row["logprobs_delta"] = [0.0] * row["delta_len"]
    redigest(row)


def flip_token_and_redigest(row: Row) -> None:
    flip_token(row)
    redigest(row)


def flip_chain_and_redigest(row: Row) -> None:
    row["chain_hash"] = flip_hex(row["chain_hash"])
    redigest(row)


DISK_ROT: dict[str, tuple[Edit, str]] = {
    "token_id": (staged(flip_token, reseal=False), r.SEGMENT_CHECKSUM_MISMATCH),
    "mask": (
        staged(lambda row: row["token_mask_delta"].__setitem__(0, 1.0), reseal=False),
        r.SEGMENT_CHECKSUM_MISMATCH,
    ),
    "logprob": (staged(set_sampled_logprob(-9.0), reseal=False), r.SEGMENT_CHECKSUM_MISMATCH),
    "digest": (
        staged(lambda row: row.update(digest=flip_hex(row["digest"])), reseal=False),
        "segment_checksum_mismatch",
    ),
    "bit_flip": (raw_bytes(flip_middle_byte, reseal=False), r.SEGMENT_CHECKSUM_MISMATCH),
    "truncated_segment": (raw_bytes(lambda d: d[: len(d) // 2], reseal=False), r.SEGMENT_CHECKSUM_MISMATCH),
    "appended_bytes": (raw_bytes(lambda d: d + b"\0" * 16, reseal=False), r.SEGMENT_CHECKSUM_MISMATCH),
    "deleted_segment": (delete_segment(reseal=False), r.MISSING_STAGING_ROW),
    "calls_file": (ledger_file("calls", lambda rows: rows.pop(), reseal=False), r.SEGMENT_CHECKSUM_MISMATCH),
    "receipts_file": (ledger_file("receipts", lambda rows: rows.pop(), reseal=False), r.SEGMENT_CHECKSUM_MISMATCH),
}

RESEALED: dict[str, tuple[Edit, str]] = {
    # payload bytes
    "token_id": (staged(flip_token), r.CORRUPT_DIGEST),
    "token_id_redigested": (staged_and_synced(flip_token_and_redigest, "digest"), r.CHAIN_HASH_MISMATCH),
    "terminal_token_rechained": (rechained_terminal_token, r.CUMULATIVE_HASH_MISMATCH),
    "negative_token_id": (staged(lambda row: row["token_ids_delta"].__setitem__(0, -5)), r.INVALID_STAGED_ROW),
    "mask_value": (staged(lambda row: row["token_mask_delta"].__setitem__(0, 0.5)), r.INVALID_STAGED_ROW),
    "mask_flip": (staged(lambda row: row["token_mask_delta"].__setitem__(0, 1.0)), r.CORRUPT_DIGEST),
    "mask_order_redigested": (staged_and_synced(first_mask_sampled, "digest"), r.INVALID_MASK_ORDER),
    "no_sampled_token_redigested": (staged_and_synced(no_sampled_tokens, "digest"), r.EMPTY_GENERATION),
    "nan_logprob": (staged(set_sampled_logprob(float("nan"))), r.INVALID_STAGED_ROW),
    "logprob": (staged(set_sampled_logprob(-9.0)), r.CORRUPT_DIGEST),
    "carried_logprob": (staged(set_carried_logprob), r.INVALID_STAGED_ROW),
    "short_token_list": (staged(lambda row: row["token_ids_delta"].pop()), r.INVALID_STAGED_ROW),
    "swapped_payloads": (swap_payloads, r.INVALID_STAGED_ROW),
    # hashes and fields against the call record
    "staged_digest": (staged(lambda row: row.update(digest=flip_hex(row["digest"]))), r.wrong("digest")),
    "digest_in_both": (
        staged_and_synced(lambda row: row.update(digest=flip_hex(row["digest"])), "digest"),
        r.CORRUPT_DIGEST,
    ),
    "chain_hash_in_both": (staged_and_synced(flip_chain_and_redigest, "chain_hash", "digest"), r.CHAIN_HASH_MISMATCH),
    "staged_chain_hash": (
        staged(lambda row: row.update(chain_hash=flip_hex(row["chain_hash"]))),
        r.wrong("chain_hash"),
    ),
    "staged_cumulative_hash": (
        staged(lambda row: row.update(cumulative_hash=flip_hex(row["cumulative_hash"]))),
        r.wrong("cumulative_hash"),
    ),
    "delta_len": (staged(lambda row: row.update(delta_len=row["delta_len"] + 1)), r.wrong("delta_len")),
    "parent": (staged(set_field("parent_call_id", "r999999-00.a00.c000")), r.wrong("parent_call_id")),
    "mode": (staged(set_field("mode", "text")), r.wrong("mode")),
    "weight_version": (
        staged(lambda row: row.update(weight_version=row["weight_version"] + 1)),
        "wrong_weight_version",
    ),
    "batch_id": (staged(set_field("batch_id", "b-someone-else")), r.wrong("batch_id")),
    "finish_reason": (staged(set_field("finish_reason", "abort")), r.wrong("finish_reason")),
    "temperature": (staged(set_field("temperature", 0.7)), r.wrong("temperature")),
    "top_p": (staged(set_field("top_p", 0.5)), r.wrong("top_p")),
    "top_k": (staged(set_field("top_k", 5)), r.wrong("top_k")),
    "logprobs_mode": (staged(set_field("logprobs_mode", "raw")), r.wrong("logprobs_mode")),
    "future_schema_version": (staged(set_field("schema_version", 3)), r.UNSUPPORTED_SCHEMA),
    "future_digest_version": (staged(set_field("digest_version", 3)), r.UNSUPPORTED_DIGEST),
    "foreign_extras": (staged(set_field("extras_json", '{"routed_experts":[[[1,2]]]}')), r.CORRUPT_EXTRAS),
    "non_canonical_extras": (staged(set_field("extras_json", "null ")), r.CORRUPT_EXTRAS),
    "parent_lengths": (staged_and_synced(shift_lengths, "prev_len", "cum_len", "digest"), r.PARENT_LENGTH_MISMATCH),
    # rows and coordinates
    "staged_call_id": (staged(set_field("call_id", "r999999-00.a00.c000")), r.CALL_ID_MISMATCH),
    "staged_rollout_id": (staged(set_field("rollout_id", "r999999-00")), r.STAGING_KEY_MISMATCH),
    "swapped_coordinates": (swap_coordinates, r.CALL_ID_MISMATCH),
    "coordinates_of_another_rollout": (
        lambda files, target, base: files.edit_call(
            target.child, lambda row: row.update(coordinates_of(files, target.other_call_id))
        ),
        r.STAGING_KEY_MISMATCH,
    ),
    "shared_coordinates": (
        lambda files, target, base: files.edit_call(
            target.child, lambda row: row.update(coordinates_of(files, target.root))
        ),
        r.DUPLICATE_STAGING_KEY,
    ),
    "row_past_segment": (call_record(lambda row, files, target: row.update(staging_row=10_000)), r.MISSING_STAGING_ROW),
    "dropped_last_row": (drop_last_staged_row, r.MISSING_STAGING_ROW),
    "duplicated_call_record": (duplicate_call_record, r.DUPLICATE_MANIFEST_CALL_ID),
    "truncated_segment": (raw_bytes(lambda d: d[: len(d) // 2], reseal=True), r.INVALID_STAGED_ROW),
    "deleted_segment": (delete_segment(reseal=True), r.MISSING_STAGING_ROW),
    # lineage graph and receipts
    "cycle": (call_record(cycle, call="root"), r.LINEAGE_CYCLE),
    "orphan": (
        call_record(lambda row, files, target: row.update(parent_call_id="r999999-00.a00.c000")),
        "missing_parent",
    ),
    "missing_terminal": (receipt(set_field("terminal_call_id", "r999999-00.a00.c000")), r.MISSING_TERMINAL),
    "wrong_num_calls": (receipt(lambda row: row.update(num_calls=row["num_calls"] + 1)), r.INVALID_RECEIPT),
    "wrong_group": (receipt(set_field("group_id", "g999999")), r.INVALID_RECEIPT),
    "failed_receipt": (
        receipt(
            lambda row: row.update(
                status="failed",
                failure_reason="environment_error",
                terminal_call_id=None,
                terminal_selection=None,
                terminal_attribution_reason=None,
            )
        ),
        r.ROLLOUT_FAILED,
    ),
    "dropped_receipt": (lambda files, target, base: files.drop_receipt(target.rollout_id), r.MISSING_RECEIPT),
    "duplicated_receipt": (
        ledger_file("receipts", lambda rows: rows.append(dict(rows[0])), reseal=True),
        r.DUPLICATE_RECEIPT,
    ),
    "foreign_batch_call_record": (
        ledger_file("calls", lambda rows: rows[0].update(batch_id="b-someone-else"), reseal=True),
        r.CORRUPT_LEDGER_FILE,
    ),
}


def run_case(base: Base, tmp_path: Path, edit: Edit, expected: str) -> dict[str, VerifiedRollout]:
    batch = fresh_copy(base.batch, tmp_path)
    damaged = edit(BatchFiles(batch.dir), base.target, base)
    damaged = {base.target.rollout_id} if damaged is None else damaged
    results = batch.verify()
    assert set(results) == set(base.results)
    for rollout_id, result in results.items():
        if rollout_id in damaged:
            assert result.reason == expected, f"{rollout_id}: expected {expected}, got {result.reason}"
        else:
            assert result.reason == base.results[rollout_id].reason, f"collateral damage on {rollout_id}"
            assert np.array_equal(result.input_ids, base.results[rollout_id].input_ids)
    return results


def test_untampered_real_shard_verifies_every_ok_rollout_token_exactly(base: Base) -> None:
    verified = [v for v in base.results.values() if v.valid]
    assert verified
    for v in verified:
        assert v.input_ids.dtype == np.int32 and v.loss_mask.dtype == np.uint8 and v.logprobs.dtype == np.float32
        assert v.input_ids.size == sum(s.carry_len + s.gen_len for s in v.call_spans) == v.weight_spans[-1].end
        assert (v.logprobs[v.loss_mask == 0] == 0).all() and (v.logprobs[v.loss_mask == 1] <= 0).all()
        assert v.prompt_len == v.call_spans[0].carry_len and v.num_turns == len(v.call_spans)


@pytest.mark.parametrize("case", sorted(DISK_ROT))
def test_disk_rot_is_caught_by_the_marker_checksum(base: Base, tmp_path: Path, case: str) -> None:
    edit, expected = DISK_ROT[case]
    run_case(base, tmp_path, edit, expected)


@pytest.mark.parametrize("case", sorted(RESEALED))
def test_resealed_corruption_is_caught_row_by_row_with_its_reason(base: Base, tmp_path: Path, case: str) -> None:
    edit, expected = RESEALED[case]
    run_case(base, tmp_path, edit, expected)


def test_a_poisoning_failure_row_keeps_the_verified_tokens(base: Base, tmp_path: Path) -> None:
    results = run_case(base, tmp_path, add_failure_row, r.CAPTURE_POISONED)
    poisoned = results[base.target.rollout_id]
    assert poisoned.linearized
    assert np.array_equal(poisoned.input_ids, base.results[base.target.rollout_id].input_ids)
