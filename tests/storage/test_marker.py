"""A shard's commit marker: canonical JSON, every rule refused by name, written once (docs/architecture.md §2, §10)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tasks import layout
from tasks.errors import MalformedMarkerError, ObjectConflictError
from tasks.storage.marker import ShardCounts, ShardMarker, ShardObject, parse_shard_object, read_marker, write_marker
from tasks.storage.objects import ObjectStore

from .markers import SHARD, marked_file, marker_of


def test_marker_json_is_canonical_and_round_trips() -> None:
    marker = marker_of((marked_file("receipts"), marked_file("calls", rows=2), marked_file("staging", rows=2)))
    text = marker.to_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert [f.kind for f in marker.files] == ["staging", "calls", "receipts"]
    assert ShardMarker.from_json(text) == marker


@settings(max_examples=50, deadline=None)
@given(
    attempt=st.integers(0, 120),
    files=st.lists(
        st.tuples(
            st.sampled_from(("staging", "calls", "failures", "receipts")),
            st.integers(0, 120),
            st.integers(0, 2_000_000),
            st.integers(0, 10_000),
            st.booleans(),
        ),
        max_size=12,
        unique_by=lambda f: (f[0], f[1], f[2], f[4]),
    ),
)
def test_any_valid_marker_round_trips_in_ledger_order(
    attempt: int, files: list[tuple[str, int, int, int, bool]]
) -> None:
    marked = tuple(
        marked_file(kind, attempt if compacted else min(a, attempt), index, rows, compacted=compacted)
        if kind != "staging"
        else marked_file(kind, min(a, attempt), index, rows)
        for kind, a, index, rows, compacted in files
    )
    assume(len({f.path for f in marked}) == len(marked))
    marker = marker_of(marked, attempt=attempt)
    parsed = ShardMarker.from_json(marker.to_json())
    assert parsed == marker
    calls = parsed.files_of("calls")
    keys = [(layout.attempt_of(f.path), f.path) for f in calls]
    assert [k[0] for k in keys] == sorted(k[0] for k in keys)


def _bad_marker_json(**changes: Any) -> str:
    raw = json.loads(marker_of((marked_file("calls", rows=2), marked_file("staging", rows=2))).to_json())
    for key, value in changes.items():
        if value is None:
            del raw[key]
        else:
            raw[key] = value
    return json.dumps(raw)


def _bad_file(**changes: Any) -> str:
    raw = json.loads(marker_of((marked_file("calls", rows=2),)).to_json())
    raw["files"][0] |= changes
    return json.dumps(raw)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        (_bad_marker_json(marker_version=3), "marker_version 3 is not supported (this code reads [1, 2]); it was"),
        (_bad_marker_json(marker_version=True), "marker_version True is not supported"),
        (_bad_marker_json(counts=None), "missing field(s) ['counts']"),
        (_bad_marker_json(extra=1), "unknown field(s) ['extra']"),
        (_bad_marker_json(batch_id="../x"), "batch_id"),
        (_bad_marker_json(committed_at="yesterday"), "committed_at"),
        (_bad_marker_json(files={}), "files must be a list"),
        (_bad_file(path="ledger/shard-00004/attempt-00/calls-000000.parquet"), "outside the staging and ledger"),
        (_bad_file(path="ledger/shard-00003/attempt-00/calls-0.parquet"), "does not match the layout name"),
        (_bad_file(path="ledger/shard-00003/calls-000000.parquet"), "not inside an attempt directory"),
        (_bad_file(path="ledger/shard-00003/attempt-00/extra-000000.parquet"), "not a ledger file"),
        (_bad_file(path="ledger/shard-00003/attempt-01/calls-000000.parquet"), "after committing attempt 0"),
        (_bad_file(path="ledger/shard-00003/attempt-00/calls-compacted-0.parquet"), "does not match the layout name"),
        (_bad_file(path="ledger/shard-00003/attempt-00/calls-compact-000000.parquet"), "does not match the layout"),
        (_bad_file(path="staging/shard-00003/attempt-00/seg-compacted-000000.parquet"), "does not match the layout"),
        (_bad_file(kind="receipts"), "is a calls object, marked as receipts"),
        (_bad_file(kind="tokens"), "kind must be one of"),
        (_bad_file(sha256="AB" * 32), "64 lowercase hex"),
        (_bad_file(size=-1), "size must be an int >= 0"),
        (_bad_file(rows=3), "counts.calls_recorded is 2, the named files hold 3 rows"),
        (_bad_file(owner="x"), "m.json.files[0]: unknown field(s) ['owner']"),
    ],
)
def test_malformed_marker_is_refused_with_named_problem(text: str, fragment: str) -> None:
    with pytest.raises(MalformedMarkerError) as raised:
        ShardMarker.from_json(text, source="m.json")
    assert raised.value.reason == "malformed_marker"
    assert fragment in str(raised.value)
    assert str(raised.value).startswith("m.json")


NO_COUNTS: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(ShardCounts)}


def test_marker_counts_must_agree_by_status_and_adoption() -> None:
    with pytest.raises(MalformedMarkerError, match=r"ok 1 \+ poisoned 1 \+ failed 0 != rollouts 1"):
        ShardCounts(**NO_COUNTS | {"rollouts": 1, "ok": 1, "poisoned": 1})
    adopted_counts = ShardCounts(**NO_COUNTS | {"rollouts": 1, "ok": 1})
    with pytest.raises(MalformedMarkerError, match=r"counts\.adopted_rollouts is 0, the named files hold 1"):
        marker_of((marked_file("receipts", attempt=0),), attempt=1, counts=adopted_counts)


def test_calls_used_is_at_most_calls_recorded_and_known_exactly_from_version_2() -> None:
    files = (marked_file("calls", rows=3), marked_file("receipts"))
    marker = marker_of(files, counts=ShardCounts(**NO_COUNTS | {"rollouts": 1, "ok": 1, "calls_recorded": 3}))
    assert (marker.marker_version, marker.counts.calls_recorded, marker.counts.calls_used) == (2, 3, 0)
    with pytest.raises(MalformedMarkerError, match="calls_used 4 exceeds calls_recorded 3"):
        ShardCounts(**NO_COUNTS | {"calls_recorded": 3, "calls_used": 4})
    unknown = dataclasses.replace(marker.counts, calls_used=None)
    with pytest.raises(MalformedMarkerError, match="a version-2 marker records it"):
        marker_of(files, counts=unknown)
    with pytest.raises(MalformedMarkerError, match="a version-1 marker does not record it"):
        marker_of(files, marker_version=1)
    raw = json.loads(marker.to_json())
    assert raw["counts"]["calls_used"] == 0 and "calls" not in raw["counts"]
    raw["counts"]["calls_used"] = None
    with pytest.raises(MalformedMarkerError, match=r"^m\.json: counts\.calls_used is None"):
        ShardMarker.from_json(json.dumps(raw), source="m.json")


def test_a_version_1_marker_reads_its_calls_as_recorded_with_the_used_ones_unknown() -> None:
    v1 = marker_of(
        (marked_file("calls", rows=3),),
        marker_version=1,
        counts=ShardCounts(**NO_COUNTS | {"calls_recorded": 3, "calls_used": None}),
    )
    raw = json.loads(v1.to_json())
    assert raw["marker_version"] == 1 and raw["counts"]["calls"] == 3
    assert not {"calls_recorded", "calls_used"} & set(raw["counts"])  # as version 1 wrote it
    assert ShardMarker.from_json(v1.to_json()) == v1
    for wrong, fragment in (
        ({"calls_used": 3}, "unknown field(s) ['calls_used'] in a version-1 marker"),
        ({"calls_recorded": 3}, "unknown field(s) ['calls_recorded'] in a version-1 marker"),
    ):
        with pytest.raises(MalformedMarkerError, match=re.escape(f"m.json.counts: {fragment}")):
            ShardMarker.from_json(json.dumps(raw | {"counts": raw["counts"] | wrong}), source="m.json")
    del raw["counts"]["calls"]
    with pytest.raises(MalformedMarkerError, match=re.escape("m.json.counts: missing field(s) ['calls']")):
        ShardMarker.from_json(json.dumps(raw), source="m.json")


def test_marker_naming_a_path_twice_is_refused() -> None:
    with pytest.raises(MalformedMarkerError, match="named twice"):
        marker_of((marked_file("calls"), marked_file("calls")))


def test_write_marker_is_create_once(batch: ObjectStore) -> None:
    marker = marker_of()
    assert write_marker(batch, marker).created
    assert not write_marker(batch, marker).created
    with pytest.raises(ObjectConflictError):
        write_marker(batch, marker_of(committed_at=2.5))
    assert read_marker(batch, SHARD) == marker


def test_read_marker_is_none_for_uncommitted_shard_and_refuses_another_shards_marker(mem_batch: ObjectStore) -> None:
    assert read_marker(mem_batch, SHARD) is None
    mem_batch.write_once(layout.shard_marker(SHARD + 1), marker_of().to_json().encode())
    with pytest.raises(MalformedMarkerError, match="marker of shard 3, not 4"):
        read_marker(mem_batch, SHARD + 1)


def test_compacted_file_names_parse_as_their_kind_attempt_and_index() -> None:
    path = layout.ledger_file(SHARD, 2, "receipts", 7, compacted=True)
    assert path == "ledger/shard-00003/attempt-02/receipts-compacted-000007.parquet"
    assert parse_shard_object(path, SHARD) == ShardObject(kind="receipts", attempt=2, index=7, compacted=True)
    assert layout.attempt_of(path) == 2
    small = layout.ledger_file(SHARD, 2, "receipts", 7)
    assert parse_shard_object(small, SHARD) == ShardObject(kind="receipts", attempt=2, index=7, compacted=False)


def test_marker_puts_an_attempts_compacted_files_before_its_small_ones_in_ledger_order() -> None:
    files = (
        marked_file("calls", attempt=1, index=0),
        marked_file("calls", attempt=1, index=1, compacted=True),
        marked_file("calls", attempt=1, index=0, compacted=True),
        marked_file("calls", attempt=0, index=3),
    )
    marker = ShardMarker.from_json(marker_of(files, attempt=1).to_json())
    assert [f.path for f in marker.files_of("calls")] == [
        layout.ledger_file(SHARD, 0, "calls", 3),
        layout.ledger_file(SHARD, 1, "calls", 0, compacted=True),
        layout.ledger_file(SHARD, 1, "calls", 1, compacted=True),
        layout.ledger_file(SHARD, 1, "calls", 0),
    ]


def test_marker_naming_an_earlier_attempts_compacted_file_is_refused() -> None:
    """Only its own attempt's marker makes a compacted file valid: recovery never read it."""
    with pytest.raises(MalformedMarkerError, match="compacted file of attempt 0; only that attempt's own marker"):
        marker_of((marked_file("calls", attempt=0, compacted=True),), attempt=1)
