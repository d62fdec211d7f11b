"""The ledger records' rules against an independent statement of docs/architecture.md §4.3-4.5.

Each oracle below restates a record's section in plain Python, from the contract and not
from the code. Both forms of the rules must agree with it on every row: constructing the
record (the compiled per-record check) and ``rules.all_hold`` over the whole table (the ledger
reader's column-wise proof).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.records.ledger import CallRecord, FailureRow, Receipt

HEX = "ab" * 32
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX = re.compile(r"[0-9a-f]{64}")
_REASON = re.compile(r"[a-z][a-z0-9_]*")


def _is_id(value: str | None) -> bool:
    return value is not None and _ID.fullmatch(value) is not None


def _optional(test: Callable[[Any], bool], value: Any) -> bool:
    return value is None or test(value)


def _is_hex(value: str) -> bool:
    return _HEX.fullmatch(value) is not None


def _is_reason(value: str | None) -> bool:
    return value is not None and _REASON.fullmatch(value) is not None


def _is_canonical(text: str) -> bool:
    """Sorted keys, no spaces, and no NaN or infinity (JSON has neither)."""
    try:
        value = json.loads(text)
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False) == text
    except ValueError:
        return False


def call_is_valid(row: dict[str, Any]) -> bool:
    """4.1 / 4.3: ids; root <=> no parent <=> prev_len 0 <=> mode text; lengths add up; hex hashes; coordinates."""
    root = row["mode"] == "text"
    return (
        all(_is_id(row[k]) for k in ("batch_id", "rollout_id", "call_id"))
        and _optional(_is_id, row["parent_call_id"])
        and row["mode"] in ("text", "token_in")
        and (row["parent_call_id"] is None) == root
        and (row["prev_len"] == 0) == root
        and row["prev_len"] >= 0
        and row["delta_len"] >= 1
        and row["cum_len"] == row["prev_len"] + row["delta_len"]
        and all(_is_hex(row[k]) for k in ("digest", "extras_digest", "chain_hash", "cumulative_hash"))
        and _optional(_is_hex, row["output_fingerprint"])
        and row["staging_segment"].startswith("staging/")
        and row["staging_row"] >= 0
        and _optional(math.isfinite, row["admitted_at"])
        and row["finish_reason"] != ""
        and _optional(lambda v: v != "", row["response_id"])
    )


def failure_is_valid(row: dict[str, Any]) -> bool:
    """4.4: ids, and a named (snake_case) reason."""
    return (
        all(_is_id(row[k]) for k in ("batch_id", "rollout_id", "call_id"))
        and _optional(_is_id, row["parent_call_id"])
        and _is_reason(row["reason"])
    )


def receipt_is_valid(row: dict[str, Any]) -> bool:
    """4.5: ok => terminal call, selection, reward and calls, no reason; otherwise a named reason."""
    ok = row["status"] == "ok"
    return (
        _is_id(row["rollout_id"])
        and _is_id(row["group_id"])
        and _optional(_is_id, row["terminal_call_id"])
        and row["attempt"] >= 0
        and row["num_calls"] >= 0
        and _optional(math.isfinite, row["reward"])
        and _is_canonical(row["reward_info"])
        and row["status"] in ("ok", "poisoned", "failed")
        and _optional(lambda v: v in ("declared", "response_id", "content", "heuristic"), row["terminal_selection"])
        and (row["terminal_call_id"] is None) == (row["terminal_selection"] is None)
        and _optional(_is_reason, row["terminal_attribution_reason"])
        and row["replayed_calls"] is not None
        and all(_is_id(call) for call in row["replayed_calls"])
        and (
            (
                row["terminal_call_id"] is not None
                and row["failure_reason"] is None
                and row["reward"] is not None
                and row["num_calls"] >= 1
            )
            if ok
            else _is_reason(row["failure_reason"])
        )
    )


_CHILD = {"parent_call_id": "r000000-00.a00.c000", "mode": "token_in", "prev_len": 3, "cum_len": 6}
VALID_CALLS = [
    {
        "batch_id": "batch-test",
        "rollout_id": "r000000-00",
        "call_id": f"r000000-00.a00.c00{k}",
        "parent_call_id": None,
        "mode": "text",
        "prev_len": 0,
        "delta_len": 3,
        "cum_len": 3,
        "weight_version": 1,
        "epoch_span": False,
        "digest": HEX,
        "extras_digest": HEX,
        "chain_hash": HEX,
        "cumulative_hash": HEX,
        "staging_segment": "staging/shard-00003/attempt-00/seg-000000.parquet",
        "staging_row": k,
        "admitted_at": 1.0e9,
        "finish_reason": "stop",
        "output_fingerprint": None,
        "response_id": None,
    }
    | (_CHILD if k else {})
    for k in range(2)
]
VALID_FAILURES = [
    {
        "batch_id": "batch-test",
        "rollout_id": "r000000-00",
        "call_id": "r000000-00.a00.c002",
        "parent_call_id": None,
        "reason": "staging_failed",
        "detail": "",
    }
]
VALID_RECEIPTS = [
    {
        "rollout_id": "r000000-00",
        "group_id": "g000000",
        "attempt": 0,
        "reward": 1.0,
        "reward_info": "{}",
        "terminal_call_id": "r000000-00.a00.c001",
        "terminal_selection": "declared",
        "terminal_attribution_reason": "selected",
        "status": "ok",
        "failure_reason": None,
        "num_calls": 2,
        "replayed_calls": ["r000000-00.a00.c000"],
    },
    {
        "rollout_id": "r000000-01",
        "group_id": "g000000",
        "attempt": 0,
        "reward": None,
        "reward_info": '{"a":[1,2]}',
        "terminal_call_id": None,
        "terminal_selection": None,
        "terminal_attribution_reason": None,
        "status": "failed",
        "failure_reason": "environment_error",
        "num_calls": 0,
        "replayed_calls": [],
    },
]
CASES = {
    "calls": (CallRecord, VALID_CALLS, call_is_valid),
    "failures": (FailureRow, VALID_FAILURES, failure_is_valid),
    "receipts": (Receipt, VALID_RECEIPTS, receipt_is_valid),
}
_TEXT = [
    "",
    "a",
    "A-b.c_9",
    "-x",
    "x/y",
    "x\n",
    "é",
    "x" * 128,
    "x" * 129,
    "0" * 64,
    "g" * 64,
    "AB" * 32,
    HEX,
    "staging/x",
    "text",
    "token_in",
    "ok",
    "poisoned",
    "failed",
    "declared",
    "heuristic",
    "selected",
    "bad reason",
    "{}",
    "null",
    "NaN",
    "[Infinity]",
    '{"a":1}',
    '{"a": 1}',
    '{"b":1,"a":2}',
]
# Edge values of every column type (nulls are added for nullable columns).
_VALUES = {
    pa.string(): _TEXT,
    pa.int64(): [-1, 0, 1, 2, 3, 6, 2**62, 2**63 - 1],
    pa.int32(): [-1, 0, 1],
    pa.uint64(): [0, 2**64 - 1],
    pa.float64(): [0.0, -1.5, math.nan, math.inf, -math.inf],
    pa.bool_(): [True, False],
    pa.list_(pa.string()): [[], ["r000000-00.a00.c000", "x"], ["bad id"], [""], ["ok", "x/y"]],
}


@st.composite
def edited_rows(draw: st.DrawFn, kind: str) -> list[dict[str, Any]]:
    """The valid rows of ``kind`` with one to three fields of one row set to edge values of their type."""
    record_cls, valid, _ = CASES[kind]
    rows = [dict(row) for row in valid]
    row = draw(st.sampled_from(rows))
    for field in draw(st.lists(st.sampled_from(list(record_cls.arrow_schema())), min_size=1, max_size=3)):
        row[field.name] = draw(st.sampled_from([*_VALUES[field.type], *([None] if field.nullable else [])]))
    return rows


def _held(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` as a record holds it: list<string> cells as tuples, as tables read them."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in row.items()}


def _constructs(record_cls: type, row: dict[str, Any]) -> bool:
    try:
        record_cls(**_held(row))
    except (TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize("kind", sorted(CASES))
def test_the_valid_rows_satisfy_the_oracle_and_both_forms(kind: str) -> None:
    record_cls, rows, oracle = CASES[kind]
    assert all(oracle(row) for row in rows)
    assert all(_constructs(record_cls, row) for row in rows)
    assert record_cls.rules.all_hold(pa.Table.from_pylist(rows, schema=record_cls.arrow_schema()))


@settings(max_examples=400, deadline=None)
@given(data=st.data(), kind=st.sampled_from(sorted(CASES)))
def test_both_forms_of_the_rules_agree_with_the_contract(data: st.DataObject, kind: str) -> None:
    record_cls, _, oracle = CASES[kind]
    rows = data.draw(edited_rows(kind))
    table = pa.Table.from_pylist(rows, schema=record_cls.arrow_schema())
    for row in table.to_pylist():
        assert _constructs(record_cls, row) == oracle(row), row
    assert record_cls.rules.all_hold(table) == all(oracle(row) for row in table.to_pylist())


@pytest.mark.parametrize(
    ("kind", "change", "rule"),
    [
        ("calls", {"parent_call_id": "r000000-00.a00.c009"}, "root_has_no_parent"),
        ("calls", {"prev_len": 2, "cum_len": 5}, "root_has_no_prefix"),
        ("calls", {"cum_len": 4}, "cum_len_is_prev_len_plus_delta_len"),
        ("calls", {"delta_len": 0, "cum_len": 0}, "delta_len_at_least_1"),
        ("calls", {"staging_segment": "ledger/x"}, "staging_segment_is_staged"),
        ("calls", {"response_id": ""}, "response_id_non_empty"),
        ("failures", {"reason": "Bad"}, "reason_is_reason"),
        ("receipts", {"terminal_selection": None}, "terminal_call_and_selection_together"),
        ("receipts", {"reward": None}, "ok_has_reward"),
        ("receipts", {"num_calls": 0}, "ok_has_calls"),
        ("receipts", {"status": "failed"}, "not_ok_names_failure_reason"),
        ("receipts", {"reward_info": '{"a": 1}'}, "reward_info_is_canonical_json"),
        ("receipts", {"replayed_calls": ["r000000-00.a00.c000", "bad id"]}, "replayed_calls_are_ids"),
    ],
)
def test_each_contract_rule_is_one_named_rule(kind: str, change: dict[str, Any], rule: str) -> None:
    """Breaking one rule of the contract breaks exactly that named rule, in both forms."""
    record_cls, valid, oracle = CASES[kind]
    row = valid[0] | change
    assert not oracle(row)
    table = pa.Table.from_pylist([row], schema=record_cls.arrow_schema())
    broken = [r.name for r in record_cls.rules.rules if not r.holds_on(table)[0].as_py()]
    assert broken == [rule]
    message = next(r for r in record_cls.rules.rules if r.name == rule).error(record_cls.trusted(_held(row))).args[0]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        record_cls(**_held(row))
