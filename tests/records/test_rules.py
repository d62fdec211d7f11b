"""Rules as data: one predicate, compiled for one record and run on Arrow columns for a table."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pytest

from tasks.records.rules import RecordRules, Rule, at_least, finite, hex_digests, ids, non_empty, one_of
from tasks.schema import ArrowRecord, column


class Name(str):
    """A str subclass: not what the compiled type test expects, still a str."""


@dataclass(frozen=True, eq=False)
class Sample(ArrowRecord):
    name: str = column(pa.string())
    parent: str | None = column(pa.string(), nullable=True)
    kind: str = column(pa.string())
    count: int = column(pa.int32())
    total: int = column(pa.int64())
    score: float | None = column(pa.float64(), nullable=True)
    digest: str = column(pa.string())
    flag: bool = column(pa.bool_())

    rules: ClassVar[RecordRules] = RecordRules(
        ids("name"),
        ids("parent", optional=True),
        one_of("kind", ("leaf", "node")),
        at_least(0, "count"),
        finite("score", optional=True),
        hex_digests("digest"),
        Rule(
            name="node_has_no_parent",
            fields=("kind", "parent"),
            predicate=lambda o, kind, parent: o.iff(o.eq(kind, "node"), o.is_null(parent)),
            message="{name}: a node has no parent and a leaf has one (kind {kind!r}, parent {parent!r})",
        ),
        Rule(
            name="total_is_count_plus_one",
            fields=("total", "count"),
            predicate=lambda o, total, count: o.eq(total, o.add(count, 1)),
            message="total {total} != count {count} + 1",
        ),
    )

    def __post_init__(self) -> None:
        self.rules.check(self)


VALID = {
    "name": "s1",
    "parent": None,
    "kind": "node",
    "count": 1,
    "total": 2,
    "score": 0.5,
    "digest": "ab" * 32,
    "flag": False,
}


def test_a_valid_record_constructs() -> None:
    assert Sample(**VALID).total == 2


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"name": 7}, TypeError, "name must be a str, got int: 7"),
        ({"flag": 1}, TypeError, "flag must be a bool, got int: 1"),
        ({"score": "high"}, TypeError, "score must be a number, got str: 'high'"),
        ({"count": 2**31}, ValueError, r"count must be an int in [-2**31, 2**31), got 2147483648"),
        ({"count": True}, TypeError, "count must be an int in"),
        ({"name": "../x"}, ValueError, "name must be an id"),
        ({"kind": "tree"}, ValueError, "kind must be one of ['leaf', 'node'], got 'tree'"),
        ({"count": -1, "total": 0}, ValueError, "count must be an int >= 0, got -1"),
        ({"score": math.nan}, ValueError, "score must be a finite number, got nan"),
        ({"digest": "AB" * 32}, ValueError, "digest must be 64 lowercase hex digits"),
        ({"parent": "p"}, ValueError, "s1: a node has no parent and a leaf has one (kind 'node', parent 'p')"),
        ({"total": 3}, ValueError, "total 3 != count 1 + 1"),
    ],
)
def test_the_first_broken_check_is_raised_with_its_message(
    change: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        Sample(**(VALID | change))


def test_values_the_compiled_test_does_not_expect_are_checked_one_by_one() -> None:
    """A str subclass or a numpy int fails the fast test; the checks one by one still accept them."""
    record = Sample(**(VALID | {"name": Name("s1"), "count": np.int32(1), "total": np.int64(2)}))
    assert record.total == 2
    with pytest.raises(ValueError, match="total 3 != count 1"):
        Sample(**(VALID | {"count": np.int32(1), "total": np.int64(3)}))


def test_an_optional_rule_holds_where_its_field_is_null() -> None:
    assert Sample(**(VALID | {"score": None})).score is None
    table = Sample.to_table([Sample(**(VALID | {"score": None}))])
    assert Sample.rules.all_hold(table)


@pytest.mark.parametrize(
    ("change", "holds"),
    [
        ({}, True),
        ({"kind": "leaf", "parent": "s0"}, True),
        ({"kind": "leaf"}, False),
        ({"total": 3}, False),
        ({"score": math.inf}, False),
        ({"name": "x" * 129}, False),
        ({"digest": "ab" * 32 + "\n"}, False),
        ({"count": 2**31 - 1, "total": 2**31}, True),
    ],
)
def test_a_table_holds_exactly_when_every_row_would_construct(change: dict[str, object], holds: bool) -> None:
    rows = [VALID, VALID | change]
    table = pa.Table.from_pylist(rows, schema=Sample.arrow_schema())
    assert Sample.rules.all_hold(table) is holds
    constructs = True
    try:
        Sample.from_table(table)
    except ValueError:
        constructs = False
    assert constructs is holds


def test_a_table_that_cannot_be_proved_column_wise_is_refused() -> None:
    """An overflow in a column-wise sum is not a proof: the caller then checks record by record."""
    row = VALID | {"count": 2**31 - 1, "total": 2**31}
    table = pa.Table.from_pylist([row], schema=Sample.arrow_schema()).set_column(
        3, "count", pa.array([2**63 - 1], pa.int64())
    )
    assert not Sample.rules.all_hold(table)


def test_rule_sets_refuse_duplicate_names_and_optional_rules_over_several_fields() -> None:
    with pytest.raises(ValueError, match="unique"):
        RecordRules(non_empty("name"), non_empty("name"))
    with pytest.raises(ValueError, match="only a rule over one field can be optional"):
        Rule("r", ("a", "b"), lambda o, a, b: o.iff(a, b), "m", optional=True)
