"""Terminal attribution (docs/architecture.md §7): every reason, every witness, and the survivors rule."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.capture.terminal import (
    ATTRIBUTION_REASONS,
    TerminalAttribution,
    TerminalSelection,
    attribute_terminal,
    fingerprint_content,
    select_terminal_call,
)
from tasks.records.ledger import CallRecord, StagedDelta


@dataclass(frozen=True)
class Row:
    """A plain manifest row: only the attributes terminal selection reads."""

    call_id: str
    parent_call_id: str | None = None
    admitted_at: float | None = None
    response_id: str | None = None
    output_fingerprint: str | None = None


def _linear(n: int) -> list[Row]:
    return [Row(f"c{i}", f"c{i - 1}" if i else None, float(i)) for i in range(n)]


# --- heuristic reasons ----------------------------------------------------------------------


def test_empty_manifest_is_no_records() -> None:
    assert select_terminal_call([]) == TerminalSelection(None, "no_records")


def test_repeated_call_id_is_duplicate_call_id() -> None:
    assert select_terminal_call([Row("c0"), Row("c1", "c0"), Row("c1", "c0")]).reason == "duplicate_call_id"


def test_parent_outside_the_manifest_is_orphaned_row() -> None:
    assert select_terminal_call([Row("c0"), Row("c2", "c1")]) == TerminalSelection(None, "orphaned_row")


def test_manifest_without_a_root_is_no_root() -> None:
    assert select_terminal_call([Row("a", "b"), Row("b", "a")]) == TerminalSelection(None, "no_root")


def test_checks_run_in_the_documented_order() -> None:
    # duplicate before orphan, orphan before no root
    assert select_terminal_call([Row("a", "x"), Row("a", "x")]).reason == "duplicate_call_id"
    assert select_terminal_call([Row("a", "b"), Row("b", "a"), Row("c", "x")]).reason == "orphaned_row"


def test_single_root_is_selected() -> None:
    assert select_terminal_call([Row("c0")]) == TerminalSelection("c0", "selected")


def test_linear_chain_selects_its_leaf_whatever_the_manifest_order() -> None:
    rows = _linear(4)
    assert select_terminal_call(rows) == TerminalSelection("c3", "selected")
    assert select_terminal_call(rows[::-1]) == TerminalSelection("c3", "selected")


def test_abandoned_retry_beside_the_continued_call_is_ignored() -> None:
    # c1 failed and was retried as c1b; the episode went on from c1b.
    rows = [Row("c0"), Row("c1", "c0", 1.0), Row("c1b", "c0", 2.0), Row("c2", "c1b", 3.0)]
    assert select_terminal_call(rows) == TerminalSelection("c2", "selected")


def test_two_childless_children_of_the_last_call_are_ambiguous() -> None:
    rows = [*_linear(2), Row("c2", "c1", 2.0), Row("c2b", "c1", 3.0)]
    assert select_terminal_call(rows) == TerminalSelection(None, "ambiguous_terminal")


def test_two_continued_branches_are_ambiguous() -> None:
    rows = [Row("c0"), Row("a1", "c0"), Row("a2", "a1"), Row("b1", "c0"), Row("b2", "b1")]
    assert select_terminal_call(rows).reason == "ambiguous_terminal"


def test_root_with_children_wins_over_an_earlier_childless_root() -> None:
    rows = [Row("lone", None, 0.0), Row("c0", None, 5.0), Row("c1", "c0", 6.0)]
    assert select_terminal_call(rows) == TerminalSelection("c1", "selected")


def test_earliest_admitted_root_is_the_start_among_surviving_roots() -> None:
    rows = [Row("late", None, 9.0), Row("late1", "late", 10.0), Row("early", None, 1.0), Row("early1", "early", 2.0)]
    assert select_terminal_call(rows) == TerminalSelection("early1", "selected")


def test_stamped_roots_come_before_unstamped_ones() -> None:
    rows = [Row("unstamped"), Row("stamped", None, 1e9)]
    assert select_terminal_call(rows) == TerminalSelection("stamped", "selected")


def test_tied_or_unstamped_roots_are_ordered_by_manifest_position() -> None:
    assert select_terminal_call([Row("first", None, 3.0), Row("second", None, 3.0)]).terminal_call_id == "first"
    assert select_terminal_call([Row("first"), Row("second")]).terminal_call_id == "first"


def test_non_finite_stamp_counts_as_unstamped() -> None:
    rows = [Row("nan", None, float("nan")), Row("stamped", None, 2.0)]
    assert select_terminal_call(rows).terminal_call_id == "stamped"


# --- witnesses ------------------------------------------------------------------------------


def _scored_manifest() -> list[Row]:
    """c0 -> c1 -> c2, each with its response id and content fingerprint."""
    return [
        Row(f"c{i}", f"c{i - 1}" if i else None, float(i), f"resp-{i}", fingerprint_content(f"answer {i}"))
        for i in range(3)
    ]


def test_declared_terminal_is_authoritative() -> None:
    assert attribute_terminal(_scored_manifest(), declared_call_ids=("c1",)) == TerminalAttribution(
        "c1", "declared", "selected"
    )


def test_declarations_from_two_channels_must_name_the_same_call() -> None:
    rows = _scored_manifest()
    assert attribute_terminal(rows, declared_call_ids=("c1", "c1")) == TerminalAttribution("c1", "declared", "selected")
    assert attribute_terminal(rows, declared_call_ids=("c1", "c2")) == TerminalAttribution(
        None, None, "witness_disagreement"
    )
    assert attribute_terminal(rows, declared_call_ids=("c1", "c9")).reason == "declared_terminal_not_captured"


def test_declared_terminal_not_captured_does_not_fall_back() -> None:
    result = attribute_terminal(_scored_manifest(), declared_call_ids=("c9",), response_id="resp-2")
    assert result == TerminalAttribution(None, None, "declared_terminal_not_captured")


def test_declared_terminal_with_differing_rows_is_declared_ambiguous() -> None:
    rows = [*_scored_manifest(), Row("c2", "c0", 7.0)]
    assert attribute_terminal(rows, declared_call_ids=("c2",)) == TerminalAttribution(None, None, "declared_ambiguous")


def test_declared_terminal_with_identical_repeated_rows_is_selected() -> None:
    rows = _scored_manifest()
    assert attribute_terminal([*rows, rows[2]], declared_call_ids=("c2",)).terminal_call_id == "c2"


def test_response_id_names_the_scored_call() -> None:
    assert attribute_terminal(_scored_manifest(), response_id="resp-1") == TerminalAttribution(
        "c1", "response_id", "selected"
    )


def test_content_fingerprint_names_the_scored_call() -> None:
    result = attribute_terminal(_scored_manifest(), content_fingerprint=fingerprint_content("answer 0"))
    assert result == TerminalAttribution("c0", "content", "selected")


def test_unmatched_witnesses_abstain_and_the_heuristic_decides() -> None:
    result = attribute_terminal(
        _scored_manifest(), response_id="resp-unknown", content_fingerprint=fingerprint_content("never served")
    )
    assert result == TerminalAttribution("c2", "heuristic", "selected")


def test_content_shared_by_two_calls_abstains_instead_of_guessing() -> None:
    same = fingerprint_content("42")
    rows = [Row("c0", None, 0.0, None, same), Row("c1", "c0", 1.0, None, same), Row("c2", "c1", 2.0)]
    assert attribute_terminal(rows, content_fingerprint=same) == TerminalAttribution("c2", "heuristic", "selected")


def test_witnesses_naming_different_calls_disagree() -> None:
    rows = _scored_manifest()
    expected = TerminalAttribution(None, None, "witness_disagreement")
    assert attribute_terminal(rows, declared_call_ids=("c2",), response_id="resp-1") == expected
    assert (
        attribute_terminal(rows, response_id="resp-2", content_fingerprint=fingerprint_content("answer 0")) == expected
    )


def test_agreeing_witnesses_report_the_strongest_method() -> None:
    rows = _scored_manifest()
    content = fingerprint_content("answer 2")
    both = attribute_terminal(rows, declared_call_ids=("c2",), response_id="resp-2", content_fingerprint=content)
    assert both == TerminalAttribution("c2", "declared", "selected")
    assert attribute_terminal(rows, response_id="resp-2", content_fingerprint=content).selection_method == "response_id"


def test_heuristic_failure_reports_its_reason_without_method() -> None:
    rows = [*_linear(2), Row("c2", "c1", 2.0), Row("c2b", "c1", 3.0)]
    assert attribute_terminal(rows) == TerminalAttribution(None, None, "ambiguous_terminal")


def test_malformed_content_fingerprint_is_refused() -> None:
    with pytest.raises(ValueError, match="content_fingerprint"):
        attribute_terminal(_scored_manifest(), content_fingerprint="answer 2")


def test_fingerprint_is_sha256_of_the_utf8_content() -> None:
    assert fingerprint_content("hello") == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert fingerprint_content("é") != fingerprint_content("e")
    with pytest.raises(TypeError):
        fingerprint_content(b"hello")  # type: ignore[arg-type]


def test_plain_objects_without_witness_attributes_work() -> None:
    rows = [SimpleNamespace(call_id="c0", parent_call_id=None, admitted_at=None)]
    assert attribute_terminal(rows, response_id="resp-0") == TerminalAttribution("c0", "heuristic", "selected")


# --- the real CallRecord --------------------------------------------------------------------


def _call_records() -> list[CallRecord]:
    records: list[CallRecord] = []
    prefix: list[int] = []
    parent: StagedDelta | None = None
    for ordinal in range(3):
        delta = StagedDelta.build(
            batch_id="b0",
            rollout_id="r000000-00",
            call_id=f"r000000-00.a00.c{ordinal:03d}",
            parent_call_id=parent.call_id if parent else None,
            parent_chain_hash=parent.chain_hash if parent else None,
            prefix_token_ids=prefix,
            prompt_token_ids=[*prefix, 5, 6],
            generated_token_ids=[7, 2],
            generated_logprobs=[-0.5, -0.1],
            weight_version=0,
            finish_reason="stop",
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
        )
        records.append(
            CallRecord.for_staged(
                delta,
                staging_segment="staging/shard-00000/attempt-00/seg-000000.parquet",
                staging_row=ordinal,
                admitted_at=100.0 + ordinal,
                output_fingerprint=fingerprint_content(f"turn {ordinal}"),
                response_id=f"chatcmpl-{ordinal}",
            )
        )
        prefix, parent = [*prefix, 5, 6, 7, 2], delta
    return records


def test_real_call_records_work_with_every_method() -> None:
    records = _call_records()
    leaf = records[-1].call_id
    assert select_terminal_call(records) == TerminalSelection(leaf, "selected")
    assert attribute_terminal(records, declared_call_ids=(leaf,)).selection_method == "declared"
    assert attribute_terminal(records, response_id="chatcmpl-1") == TerminalAttribution(
        records[1].call_id, "response_id", "selected"
    )
    assert attribute_terminal(records, content_fingerprint=fingerprint_content("turn 2")).terminal_call_id == leaf


def test_real_call_records_repeated_with_a_difference_are_declared_ambiguous() -> None:
    records = _call_records()
    leaf = records[-1]
    assert attribute_terminal([*records, leaf], declared_call_ids=(leaf.call_id,)).terminal_call_id == leaf.call_id
    moved = dataclasses.replace(leaf, staging_row=leaf.staging_row + 10)
    result = attribute_terminal([*records, moved], declared_call_ids=(leaf.call_id,))
    assert result == TerminalAttribution(None, None, "declared_ambiguous")


# --- properties -----------------------------------------------------------------------------

_stamps = st.one_of(st.none(), st.floats(min_value=0, max_value=1e9, allow_nan=False))


@given(n=st.integers(min_value=1, max_value=8), data=st.data())
def test_property_linear_chain_in_any_order_selects_its_leaf(n: int, data: st.DataObject) -> None:
    rows = [Row(f"c{i}", f"c{i - 1}" if i else None, data.draw(_stamps)) for i in range(n)]
    shuffled = data.draw(st.permutations(rows))
    assert select_terminal_call(shuffled) == TerminalSelection(f"c{n - 1}", "selected")


@given(n=st.integers(min_value=2, max_value=8), data=st.data())
def test_property_extra_leaf_child_is_ignored_only_beside_a_continued_call(n: int, data: st.DataObject) -> None:
    """A childless sibling survives only when its sibling is childless too: the survivors rule.

    Attached above the parent of the leaf, the extra leaf is a non-survivor and changes nothing;
    attached to the parent of the leaf, two childless siblings are ambiguous; attached to the
    leaf, it is the new leaf.
    """
    at = data.draw(st.integers(min_value=0, max_value=n - 1))
    rows = [*(Row(f"c{i}", f"c{i - 1}" if i else None, data.draw(_stamps)) for i in range(n)), Row("x", f"c{at}")]
    result = select_terminal_call(data.draw(st.permutations(rows)))
    if at <= n - 3:
        assert result == TerminalSelection(f"c{n - 1}", "selected")
    elif at == n - 2:
        assert result == TerminalSelection(None, "ambiguous_terminal")
    else:
        assert result == TerminalSelection("x", "selected")


@st.composite
def forests(draw: st.DrawFn) -> list[Row]:
    """Call trees: each call's parent is an earlier call or none, with distinct stamps."""
    n = draw(st.integers(min_value=1, max_value=10))
    stamps = draw(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=n, max_size=n, unique=True))
    rows = []
    for i in range(n):
        parent = draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None
        rows.append(Row(f"c{i}", None if parent is None else f"c{parent}", stamps[i]))
    return rows


@given(forests(), st.data())
def test_property_selection_ignores_manifest_order_when_stamps_are_distinct(
    rows: list[Row], data: st.DataObject
) -> None:
    assert select_terminal_call(data.draw(st.permutations(rows))) == select_terminal_call(rows)


@given(forests())
def test_property_selected_call_is_a_leaf_reached_from_a_root(rows: list[Row]) -> None:
    result = select_terminal_call(rows)
    assert result.reason in ("selected", "ambiguous_terminal")
    if result.terminal_call_id is not None:
        by_id = {row.call_id: row for row in rows}
        assert not any(row.parent_call_id == result.terminal_call_id for row in rows)
        node = by_id[result.terminal_call_id]
        while node.parent_call_id is not None:
            node = by_id[node.parent_call_id]
        assert node.parent_call_id is None


@given(forests(), st.data())
def test_property_childless_root_never_displaces_a_tree(rows: list[Row], data: st.DataObject) -> None:
    if not any(row.parent_call_id is not None for row in rows):
        return
    lone = Row("lone", None, data.draw(_stamps))
    position = data.draw(st.integers(0, len(rows)))
    assert select_terminal_call([*rows[:position], lone, *rows[position:]]) == select_terminal_call(rows)


def test_every_reason_is_documented() -> None:
    assert set(ATTRIBUTION_REASONS) == {
        "selected",
        "no_records",
        "duplicate_call_id",
        "orphaned_row",
        "no_root",
        "ambiguous_terminal",
        "declared_terminal_not_captured",
        "declared_ambiguous",
        "witness_disagreement",
    }
