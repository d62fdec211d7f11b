"""Fetch the staged rows of a shard's chains, each committed segment read once (docs/architecture.md §5, §8).

A segment that cannot be trusted as a whole (checksum, schema, not Parquet, absent) rejects every
chain that reads it; a row-level failure (coordinates past the segment's rows, a row holding
another rollout or call than its staging key) rejects only the chain of that row. A chain's
reason is its first failure in the order the segments are first read, and within one segment a
missing row before a key mismatch, key mismatches in chain order: the verdicts of fetching each
chain's rows on its own, segment by segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.errors import StorageIntegrityError
from tasks.finalize import reasons as r
from tasks.finalize.ragged import owners, take_rows
from tasks.records.ledger import StagedDelta
from tasks.storage.staged_reader import StagedReader


@dataclass(frozen=True)
class FetchedChains:
    """The staged rows of every chain that could be read, chain after chain, each root→terminal.

    ``fetched`` lists those chains (ascending) and ``table`` holds their rows in that order;
    ``failed`` maps every other chain to the storage reason its rows cannot be read.
    """

    table: pa.Table
    fetched: np.ndarray
    failed: dict[int, str]


def fetch_chains(reader: StagedReader, calls: pa.Table, starts: np.ndarray) -> FetchedChains:
    """The staged rows of chains given as call records: chain ``k`` is rows ``starts[k]:starts[k + 1]`` of ``calls``.

    ``calls`` needs the record's ``rollout_id``, ``call_id``, ``staging_segment`` and ``staging_row``.
    """
    chains = starts.size - 1
    owner = owners(starts)
    position = np.arange(calls.num_rows) - starts[owner]
    encoded = calls.column("staging_segment").combine_chunks().dictionary_encode()
    segment_of = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    rows = calls.column("staging_row").to_numpy()
    # (segment order, check order, position in the chain, reason) of each failing request
    failures: list[tuple[int, int, int, int, str]] = []
    tables: list[pa.Table] = []
    base = np.zeros(len(encoded.dictionary), np.int64)
    held = np.full(len(encoded.dictionary), -1, np.int64)  # rows of each loaded segment (-1: not loaded)
    total = 0
    for segment, path in enumerate(encoded.dictionary.to_pylist()):
        reason = _load(reader, path, tables)
        if reason is not None:
            failures += [(segment, 0, 0, int(chain), reason) for chain in np.unique(owner[segment_of == segment])]
            continue
        base[segment], held[segment] = total, tables[-1].num_rows
        total += tables[-1].num_rows
    loaded = held[segment_of] >= 0
    in_bounds = loaded & (rows >= 0) & (rows < held[segment_of])
    for i in np.flatnonzero(loaded & ~in_bounds).tolist():
        failures.append((int(segment_of[i]), 1, 0, int(owner[i]), r.MISSING_STAGING_ROW))
    combined = pa.concat_tables(tables) if tables else StagedDelta.arrow_schema().empty_table()
    index = base[segment_of] + rows
    checked = np.flatnonzero(in_bounds)
    picked = pa.array(index[checked])
    requested = take_rows(calls, checked)
    same_rollout = _same(combined.column("rollout_id").take(picked), requested.column("rollout_id"))
    same_call = _same(combined.column("call_id").take(picked), requested.column("call_id"))
    for k in np.flatnonzero(~(same_rollout & same_call)).tolist():
        i = int(checked[k])
        reason = r.STAGING_KEY_MISMATCH if not same_rollout[k] else r.CALL_ID_MISMATCH
        failures.append((int(segment_of[i]), 2, int(position[i]), int(owner[i]), reason))
    failed: dict[int, str] = {}
    for *_, chain, reason in sorted(failures):
        failed.setdefault(chain, reason)
    fetched = np.setdiff1d(np.arange(chains), np.fromiter(failed, np.int64, len(failed)))
    order = index[np.isin(owner, fetched)]
    if order.size != combined.num_rows or (order != np.arange(order.size)).any():
        combined = combined.take(pa.array(order))  # one take, only when the chains are not the segments' rows in order
    return FetchedChains(table=combined, fetched=fetched, failed=failed)


def _load(reader: StagedReader, path: str, tables: list[pa.Table]) -> str | None:
    """Append the verified segment to ``tables``, or return the reason no row of it can be trusted."""
    try:
        tables.append(reader.segment(path))
    except pa.ArrowInvalid:
        return r.INVALID_STAGED_ROW  # re-sealed bytes that are not a Parquet file
    except StorageIntegrityError as exc:  # checksum, a schema that is not the staged-delta schema, absent
        return exc.reason
    return None


def _same(staged: pa.ChunkedArray, requested: pa.ChunkedArray) -> np.ndarray:
    """Per row: whether the staged value is the requested one (a null staged value is left to verification)."""
    return pc.fill_null(pc.equal(staged, requested), True).to_numpy(zero_copy_only=False)
