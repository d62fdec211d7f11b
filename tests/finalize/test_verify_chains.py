"""Rollouts verified together (one shard, one segment) get exactly the verdicts each gets alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest

from tasks.finalize import reasons as r
from tasks.records.ledger import StagedDelta

from .hand_built import Chain, build_chain, bundle_of, verify_one, verify_rollouts
from .verdicts import VerifiedRollout

Row = dict


def tampered(chain: Chain, row: int, change: Callable[[Row], None]) -> pa.Table:
    rows = chain.table().to_pylist()
    change(rows[row])
    return pa.Table.from_pylist(rows, schema=StagedDelta.arrow_schema())


def set_item(column: str, index: int, value: object) -> Callable[[Row], None]:
    def change(row: Row) -> None:
        row[column][index] = value

    return change


def set_value(column: str, value: object) -> Callable[[Row], None]:
    def change(row: Row) -> None:
        row[column] = value

    return change


def drop_last(column: str) -> Callable[[Row], None]:
    def change(row: Row) -> None:
        row[column] = row[column][:-1]

    return change


TAMPERS = {
    "carried_logprob": (set_item("logprobs_delta", 0, -0.5), r.INVALID_STAGED_ROW),
    "sampled_logprob": (set_item("logprobs_delta", -1, -0.123), r.CORRUPT_DIGEST),
    "short_mask_list": (drop_last("token_mask_delta"), r.INVALID_STAGED_ROW),
    "null_token_id": (set_item("token_ids_delta", 0, None), r.INVALID_STAGED_ROW),
    "other_call_id": (set_value("call_id", "r000001-00.a00.c009"), r.CALL_ID_MISMATCH),
    "chain_hash": (set_value("chain_hash", "ab" * 32), r.wrong("chain_hash")),
    "extras_json": (set_value("extras_json", "{}"), r.CORRUPT_EXTRAS),
    "temperature": (set_value("temperature", 0.5), r.wrong("temperature")),
    "digest_version": (set_value("digest_version", 3), r.UNSUPPORTED_DIGEST),
    "token_past_int32": (set_item("token_ids_delta", -1, 2**31), r.INVALID_STAGED_ROW),
}


TURNS = [(3, 2), (1, 3), (2, 2)]


def chains() -> list[Chain]:
    """Three rollouts whose rows lie end to end in one segment."""
    return [
        build_chain(TURNS, rollout_id=f"r00000{i}-00", first_id=100 * (i + 1), first_row=len(TURNS) * i)
        for i in range(3)
    ]


def alone(chain: Chain) -> Chain:
    """The chain's records re-pointed at rows 0.. of a segment of its own rows."""
    first = chain.records[0].staging_row
    records = [dataclasses.replace(c, staging_row=c.staging_row - first) for c in chain.records]
    return Chain(chain.deltas, records)


def same(a: VerifiedRollout, b: VerifiedRollout) -> bool:
    tokens = all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "loss_mask", "logprobs"))
    return tokens and (a.reason, a.call_spans, a.weight_spans, a.prompt_len) == (
        b.reason,
        b.call_spans,
        b.weight_spans,
        b.prompt_len,
    )


@pytest.mark.parametrize("row", [0, 1, 2])
@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_a_tampered_chain_among_clean_ones_gets_its_own_reason_alone(tamper: str, row: int) -> None:
    change, expected = TAMPERS[tamper]
    first, middle, last = chains()
    tables = [first.table(), tampered(middle, row, change), last.table()]
    together = verify_rollouts([bundle_of(c) for c in (first, middle, last)], pa.concat_tables(tables))
    each = [verify_one(bundle_of(alone(c)), t) for c, t in zip((first, middle, last), tables, strict=True)]
    assert together[1].reason == each[1].reason == expected
    assert together[0].valid and together[2].valid
    assert all(same(a, b) for a, b in zip(together, each, strict=True))


def test_a_broken_parent_link_names_chain_hash_mismatch_only_for_its_chain() -> None:
    first, middle = chains()[:2]
    other = build_chain(TURNS, rollout_id="r000001-00", first_id=999, first_row=middle.records[0].staging_row)
    spliced = Chain([*middle.deltas[:2], other.deltas[2]], [*middle.records[:2], other.records[2]])
    staged = pa.concat_tables([first.table(), spliced.table()])  # row 5 hashes onto another parent
    together = verify_rollouts([bundle_of(first), bundle_of(spliced)], staged)
    assert together[0].valid
    assert together[1].reason == r.CHAIN_HASH_MISMATCH
    assert verify_one(bundle_of(alone(spliced)), spliced.table()).reason == r.CHAIN_HASH_MISMATCH


def test_a_null_where_the_schema_forbids_one_refuses_the_whole_segment() -> None:
    first, middle, last = chains()
    rows = pa.concat_tables([first.table(), middle.table(), last.table()]).to_pylist()
    rows[4]["rollout_id"] = None
    relaxed = pa.schema([f.with_nullable(True) for f in StagedDelta.arrow_schema()])
    verified = verify_rollouts(
        [bundle_of(c) for c in (first, middle, last)], pa.Table.from_pylist(rows, schema=relaxed)
    )
    assert [v.reason for v in verified] == [r.INVALID_STAGED_ROW] * 3
