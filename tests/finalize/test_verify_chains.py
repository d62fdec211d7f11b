"""Verifying many chains in one table gives each chain exactly the verdict it gets alone."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest

from tasks.capture.records import StagedDelta
from tasks.finalize import reasons as r
from tasks.finalize.verified import VerifiedRollout
from tasks.finalize.verify import verify_chains

from .test_verify import CONFIG, Chain, build_chain

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
    "null_rollout_id": (set_value("rollout_id", None), r.INVALID_STAGED_ROW),
    "other_call_id": (set_value("call_id", "r000001-00.a00.c009"), r.CALL_ID_MISMATCH),
    "chain_hash": (set_value("chain_hash", "ab" * 32), r.wrong("chain_hash")),
    "extras_json": (set_value("extras_json", "{}"), r.CORRUPT_EXTRAS),
    "temperature": (set_value("temperature", 0.5), r.wrong("temperature")),
    "digest_version": (set_value("digest_version", 3), r.UNSUPPORTED_DIGEST),
    "token_past_int32": (set_item("token_ids_delta", -1, 2**31), r.INVALID_STAGED_ROW),
}


def chains() -> list[Chain]:
    turns = [(3, 2), (1, 3), (2, 2)]
    return [build_chain(turns, rollout_id=f"r00000{i}-00", first_id=100 * (i + 1)) for i in range(3)]


def same(a: VerifiedRollout | str, b: VerifiedRollout | str) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "loss_mask", "logprobs")) and (
        a.call_spans,
        a.weight_spans,
        a.prompt_len,
    ) == (b.call_spans, b.weight_spans, b.prompt_len)


@pytest.mark.parametrize("row", [0, 1, 2])
@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_a_tampered_chain_among_clean_ones_gets_its_own_reason_alone(tamper: str, row: int) -> None:
    change, expected = TAMPERS[tamper]
    first, middle, last = chains()
    tables = [first.table(), tampered(middle, row, change), last.table()]
    records = [first.records, middle.records, last.records]
    together = verify_chains(records, pa.concat_tables(tables), CONFIG)
    alone = [verify_chains([calls], table, CONFIG)[0] for calls, table in zip(records, tables, strict=True)]
    assert together[1] == alone[1] == expected
    assert isinstance(together[0], VerifiedRollout) and isinstance(together[2], VerifiedRollout)
    assert all(same(a, b) for a, b in zip(together, alone, strict=True))


def test_a_broken_parent_link_names_chain_hash_mismatch_only_for_its_chain() -> None:
    first, middle = chains()[:2]
    other = build_chain([(3, 2), (1, 3), (2, 2)], rollout_id="r000001-00", first_id=999)
    spliced = StagedDelta.to_table([*middle.deltas[:2], other.deltas[2]])  # row 2 hashes onto another parent
    records = [first.records, [*middle.records[:2], other.records[2]]]
    together = verify_chains(records, pa.concat_tables([first.table(), spliced]), CONFIG)
    assert isinstance(together[0], VerifiedRollout)
    assert together[1] == r.CHAIN_HASH_MISMATCH
    assert together[1] == verify_chains([records[1]], spliced, CONFIG)[0]


def test_rows_for_chains_of_another_length_are_refused() -> None:
    chain = chains()[0]
    with pytest.raises(ValueError, match="staged rows for chains of"):
        verify_chains([chain.records[:2]], chain.table(), CONFIG)
