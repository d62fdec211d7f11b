"""Every check of section 8 over the staged rows of many chains at once, and their linearization.

Staged rows are checked as Arrow columns and numpy arrays, never as :class:`StagedDelta`
objects (whose constructor raises on exactly the malformed rows this module must name). The
rows of many chains are checked together, chain after chain in one table: columns are converted
once, field comparisons and token checks are vectorized, digests hash slices of one big-endian
buffer (:mod:`tasks.records.digest_batch`), and each chain's reason is the earliest check any of
its rows fails, exactly as if the chain were checked alone. Python loops run per row only to hash.

The work is split in two: :meth:`ChainRows.of` converts (flattens and checks the token lists:
Arrow and numpy work that a caller may run in a background thread), and :meth:`ChainRows.verify`
compares, hashes and records each check in order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.config import BatchConfig
from tasks.finalize import reasons as r
from tasks.finalize.ragged import gather, offsets, owners_of, ranges, run_sums
from tasks.finalize.verify.verdicts import Linearized
from tasks.records import digest as dg
from tasks.records import digest_batch as db
from tasks.records.ledger import StagedDelta, canonical_json
from tasks.records.sampling_mask import KEPT_DIGEST_KEY, KEPT_NOTE, KeptSets

_STAGED_SCHEMA = StagedDelta.arrow_schema()
_LIST_COLUMNS = ("token_ids_delta", "token_mask_delta", "logprobs_delta")
_KEPT_COLUMNS = ("kept_counts", "kept_token_ids")
_CORRUPT = object()  # extras that do not parse, are not canonical or do not match their digest
_PASSING = np.iinfo(np.int32).max  # the check index of a row that has not failed yet
_I32_MAX = np.iinfo(np.int32).max
_NULL_EXTRAS_DIGEST = dg.compute_extras_digest(None)
# Call-record fields read row by row: what the call digest covers, and the digest itself.
_RECORDED = (*db.CALL_DIGEST_FIELDS, "digest")


@dataclass(frozen=True)
class ChainVerdicts:
    """Per chain: the index of its linearization in ``linearized``, or the first reason its rows fail.

    ``epoch_span_counts`` counts, per linearized chain, its calls that spanned a refit.
    """

    verdicts: list[int | str]
    linearized: Linearized
    epoch_span_counts: np.ndarray

    @classmethod
    def empty(cls) -> ChainVerdicts:
        """The verdicts of no chain."""
        return cls([], Linearized.empty(), np.zeros(0, np.int64))


@dataclass(frozen=True)
class ChainRows:
    """The staged rows of many chains with their call records, converted for :meth:`verify`.

    ``calls`` (call records) and ``table`` (staged rows with the staged-delta schema and no null
    where it forbids one, as the staged reader returns them) hold the rows of every chain, chain
    after chain, each root→terminal; chain ``k`` has ``lengths[k]`` rows. ``tokens`` are the
    rows' token lists, flattened and checked (None without chains).
    """

    calls: pa.Table
    lengths: np.ndarray
    table: pa.Table
    tokens: _Tokens | None

    @classmethod
    def of(cls, calls: pa.Table, table: pa.Table, lengths: np.ndarray) -> ChainRows:
        """Convert the staged rows of chains of ``lengths`` rows; ValueError when the counts or the schema disagree."""
        lengths = np.asarray(lengths, np.int64)
        if table.num_rows != int(lengths.sum()) or calls.num_rows != table.num_rows or (lengths == 0).any():
            raise ValueError(
                f"{table.num_rows} staged rows for chains of {lengths[:10].tolist()} calls (each at least one)"
            )
        StagedDelta.check_table(table, source="staged rows")  # the staged reader refuses any other segment
        return cls(calls=calls, lengths=lengths, table=table, tokens=_Tokens(table) if lengths.size else None)

    def verify(self, config: BatchConfig) -> ChainVerdicts:
        """Per chain, its linearization or the first reason (in the module's order) any of its rows fails."""
        if self.tokens is None:
            return ChainVerdicts.empty()
        first_rows = offsets(self.lengths)[:-1]
        checks = _check_rows(self.table, self.calls, first_rows, self.tokens, config)
        failing = np.minimum.reduceat(checks.first, first_rows)
        verdicts: list[int | str] = [checks.reasons[c] if c != _PASSING else -1 for c in failing.tolist()]
        cumulative = self.calls.column("cumulative_hash")
        linearized: list[int] = []
        for chain in np.flatnonzero(failing == _PASSING).tolist():
            first = int(self.tokens.position[first_rows[chain]])
            terminal = int(first_rows[chain] + self.lengths[chain] - 1)
            recomputed = db.cumulative_hash(self.tokens.flat, first, first + int(self.lengths[chain]))
            if recomputed != cumulative[terminal].as_py():
                verdicts[chain] = r.CUMULATIVE_HASH_MISMATCH
            else:
                verdicts[chain] = len(linearized)
                linearized.append(chain)
        chains = np.array(linearized, np.int64)
        epoch_span = self.calls.column("epoch_span").to_numpy(zero_copy_only=False)
        epoch_spans = np.add.reduceat(epoch_span, first_rows, dtype=np.int64)[chains]
        linearized = self.tokens.linearize(
            chains, first_rows, self.lengths, self.calls, self.table.column("extras_json")
        )
        return ChainVerdicts(verdicts, linearized, epoch_spans)


class _Checks:
    """The first failing check of every row; checks are recorded in the order they are defined."""

    def __init__(self, rows: int) -> None:
        self.first = np.full(rows, _PASSING, dtype=np.int32)
        self.reasons: list[str] = []

    def record(self, reason: str, failing: np.ndarray) -> None:
        """Record the next check; ``failing`` is a boolean mask over rows or an array of row indices."""
        index = len(self.reasons)
        self.reasons.append(reason)
        if failing.dtype == bool:
            failing = np.flatnonzero(failing)
        self.first[failing] = np.minimum(self.first[failing], index)

    def passing(self) -> np.ndarray:
        """Indices of the rows that passed every check so far."""
        return np.flatnonzero(self.first == _PASSING)


class _Tokens:
    """The token lists of staged rows, flattened once and checked where no other field is needed.

    ``rows`` are the table rows whose three lists are null-free and ``delta_len`` long (the
    others are ``bad_lists``); their tokens lie end to end (row ``k``: ``starts[k]:starts[k + 1]``)
    in ``ids``, ``mask``, ``logprobs`` and, in wire byte order for hashing, ``flat``.
    ``position`` maps a table row to its index in ``rows`` (-1: none). ``bad_values`` (ids outside
    [0, int32], masks not exactly 0/1, logprobs not finite or nonzero where carried) and
    ``bad_mask_order`` (a sampled token before a carried one) list table rows; ``sampled``
    counts each of ``rows``' sampled tokens. The kept sets of table row ``i`` are
    ``kept_counts[kept_count_starts[i]:kept_count_starts[i + 1]]`` and ``kept_token_ids[kept_id_starts[i]:...]``;
    ``bad_kept`` lists the table rows whose kept lists hold a null.
    """

    def __init__(self, table: pa.Table) -> None:
        delta_len = pc.fill_null(table.column("delta_len"), -1).to_numpy(zero_copy_only=False)
        lists = {name: table.column(name) for name in _LIST_COLUMNS}
        bad = np.zeros(table.num_rows, dtype=bool)
        for column in lists.values():
            lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
            bad |= lengths != delta_len
            values = pc.list_flatten(column)
            if values.null_count:
                null_tokens = np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))
                bad[owners_of(offsets(lengths), null_tokens)] = True
        self.bad_lists = bad
        self.rows = np.flatnonzero(~bad)
        if self.rows.size != table.num_rows:
            lists = {name: column.take(pa.array(self.rows)) for name, column in lists.items()}
        self.ids, self.mask, self.logprobs = (_flat_values(lists[name]) for name in _LIST_COLUMNS)
        self.starts = offsets(delta_len[self.rows])
        self.position = np.full(table.num_rows, -1, dtype=np.int64)
        self.position[self.rows] = np.arange(self.rows.size)
        self._check_values()
        self.flat = db.FlatTokens.of(self.ids.view(np.uint64), self.mask, self.logprobs, self.starts)
        descending = np.flatnonzero(self.mask[1:] < self.mask[:-1]) + 1
        inside = descending[np.isin(descending, self.starts, invert=True)]
        self.bad_mask_order = self.rows[owners_of(self.starts, inside)]
        self.sampled = run_sums(self.mask == 1.0, self.starts)
        (self.kept_counts, self.kept_count_starts, bad_counts), (self.kept_token_ids, self.kept_id_starts, bad_ids) = (
            _flat_ints(table.column(name)) for name in _KEPT_COLUMNS
        )
        self.bad_kept = np.union1d(bad_counts, bad_ids)

    def kept(self, row: int) -> KeptSets:
        """The kept sets table row ``row`` stores."""
        counts = self.kept_counts[self.kept_count_starts[row] : self.kept_count_starts[row + 1]]
        ids = self.kept_token_ids[self.kept_id_starts[row] : self.kept_id_starts[row + 1]]
        return KeptSets(counts, ids)

    def sampled_ids(self, row: int) -> np.ndarray:
        """The ids table row ``row`` sampled (one of :attr:`rows`)."""
        position = int(self.position[row])
        lo, hi = int(self.starts[position]), int(self.starts[position + 1])
        return self.ids[lo:hi][self.mask[lo:hi] == 1.0]

    def _check_values(self) -> None:
        ids, mask, logprobs = self.ids, self.mask, self.logprobs
        carried = mask == 0.0
        bad = ids.view(np.uint64) > _I32_MAX  # a negative id wraps past it too
        bad |= (mask != 1.0) & ~carried
        bad |= ~np.isfinite(logprobs)
        bad |= carried & (logprobs != 0.0)
        self.bad_values = self.rows[owners_of(self.starts, np.flatnonzero(bad))]

    def linearize(
        self,
        chains: np.ndarray,
        first_rows: np.ndarray,
        lengths: np.ndarray,
        calls: pa.Table,
        extras_json: pa.ChunkedArray,
    ) -> Linearized:
        """The given chains (every row of which passed every check) root→terminal, as flat columns.

        ``calls`` are the rows' call records and ``extras_json`` the rows' own (checked against their digests).
        """
        rows, call_starts = ranges(first_rows[chains], lengths[chains])
        positions = self.position[rows]
        first = self.position[first_rows[chains]]
        token_lo = self.starts[first]
        token_counts = self.starts[first + lengths[chains]] - token_lo
        ids, mask, logprobs = self.ids, self.mask, self.logprobs
        if int(token_counts.sum()) != ids.size:  # not every token in order: gather the chains' tokens
            tokens, _ = ranges(token_lo, token_counts)
            ids, mask, logprobs = ids[tokens], mask[tokens], logprobs[tokens]
        gen = self.sampled[positions]
        ends = pc.equal(calls.column("finish_reason"), "length").to_numpy(zero_copy_only=False)
        # Each chain's kept sets: its rows' root→terminal, so one per sampled token in token order.
        counts, count_row_starts = gather(self.kept_count_starts, rows)
        kept_ids, id_row_starts = gather(self.kept_id_starts, rows)
        return Linearized(
            input_ids=ids.astype(np.int32),
            loss_mask=mask.astype(np.uint8),
            logprobs=logprobs,
            token_starts=offsets(token_counts),
            call_ids=calls.column("call_id").take(pa.array(rows)).combine_chunks(),
            carry_len=self.starts[positions + 1] - self.starts[positions] - gen,
            gen_len=gen,
            weight_version=calls.column("weight_version").to_numpy()[rows],
            extras_json=extras_json.take(pa.array(rows)).combine_chunks(),
            call_starts=call_starts,
            truncated=ends[first_rows[chains] + lengths[chains] - 1],
            kept_counts=self.kept_counts[counts],
            kept_token_ids=self.kept_token_ids[kept_ids],
            kept_count_starts=count_row_starts[call_starts],
            kept_id_starts=id_row_starts[call_starts],
        )


def _check_rows(
    table: pa.Table, calls: pa.Table, first_rows: np.ndarray, tokens: _Tokens, config: BatchConfig
) -> _Checks:
    """Record every check of section 8 in order over the rows (one chain starts at each of ``first_rows``)."""
    checks = _Checks(table.num_rows)
    for name, reason in (("rollout_id", r.STAGING_KEY_MISMATCH), ("call_id", r.CALL_ID_MISMATCH)):
        checks.record(reason, _differs(table.column(name), calls.column(name)))
    for name, expected, reason in (
        ("schema_version", dg.SCHEMA_VERSION, r.UNSUPPORTED_SCHEMA),
        ("digest_version", dg.DIGEST_VERSION, r.UNSUPPORTED_DIGEST),
        ("extras_digest_version", dg.EXTRAS_DIGEST_VERSION, r.UNSUPPORTED_DIGEST),
    ):
        checks.record(reason, _differs_from(table.column(name), expected))
    for name in r.MANIFEST_FIELDS:
        checks.record(r.wrong(name), _differs(table.column(name), calls.column(name)))
    checks.record(r.wrong("batch_id"), _differs_from(table.column("batch_id"), config.batch_id))
    for name in r.SAMPLING_FIELDS:
        checks.record(r.wrong(name), _differs_from(table.column(name), getattr(config.sampling, name)))
    checks.record(r.INVALID_STAGED_ROW, tokens.bad_lists)
    checks.record(r.INVALID_STAGED_ROW, tokens.bad_values)
    recorded = {name: calls.column(name).to_pylist() for name in _RECORDED}
    _check_digests(checks, tokens, recorded)
    extras = _check_extras(checks, table.column("extras_json"), recorded["extras_digest"])
    chain_start = np.zeros(table.num_rows, dtype=bool)
    chain_start[first_rows] = True
    _check_links(checks, table, tokens, chain_start, recorded["chain_hash"])
    checks.record(r.INVALID_MASK_ORDER, tokens.bad_mask_order)
    checks.record(r.EMPTY_GENERATION, tokens.rows[tokens.sampled == 0])
    _check_kept(checks, tokens, extras, truncating=config.sampling.truncates)
    return checks


def _check_digests(checks: _Checks, tokens: _Tokens, recorded: dict[str, list]) -> None:
    """The call digest recomputed over the stored row equals the stored digest."""
    todo = checks.passing()
    if tokens.rows.size != tokens.position.size:  # index the scalars like the token rows
        recorded = {name: [values[i] for i in tokens.rows] for name, values in recorded.items()}
    positions = tokens.position[todo]
    recomputed = db.call_digests(tokens.flat, recorded, positions.tolist())
    stored = recorded["digest"]
    wrong = [row for row, i, digest in zip(todo, positions, recomputed, strict=True) if digest != stored[i]]
    checks.record(r.CORRUPT_DIGEST, np.array(wrong, dtype=np.int64))


def _check_extras(checks: _Checks, extras_json: pa.ChunkedArray, stored: list[str]) -> dict[int, object]:
    """extras_json parses, is canonical, and its digest is the stored extras digest; the parsed extras of each row
    that passes."""
    todo = checks.passing()
    texts = extras_json.take(pa.array(todo, type=pa.int64())).to_pylist()
    parsed = {row: _parsed_extras(text, stored[row]) for row, text in zip(todo.tolist(), texts, strict=True)}
    wrong = [row for row, extras in parsed.items() if extras is _CORRUPT]
    checks.record(r.CORRUPT_EXTRAS, np.array(wrong, dtype=np.int64))
    return {row: extras for row, extras in parsed.items() if extras is not _CORRUPT}


def _check_kept(checks: _Checks, tokens: _Tokens, extras: dict[int, object], *, truncating: bool) -> None:
    """Each row's sampling mask: present when its sampling truncates (every row still passing sampled with the
    batch's settings), well-formed over its sampled tokens (:meth:`KeptSets.check`, the one rule), and the one its
    extras name (which the call digest covers).

    A truncating row without kept sets was staged by code that did not record them (or lost them): its chain
    cannot be renormalized as sampled, so it never trains (``sampling_mask_missing``).
    """
    todo = checks.passing()
    holds = (np.diff(tokens.kept_count_starts)[todo] > 0) | (np.diff(tokens.kept_id_starts)[todo] > 0)
    sampled = tokens.sampled[tokens.position[todo]]
    checks.record(r.SAMPLING_MASK_MISSING, todo[~holds & (sampled > 0)] if truncating else todo[:0])
    invalid = np.intersect1d(tokens.bad_kept, todo).tolist()  # a null among its kept ids
    invalid += [row for row in np.setdiff1d(todo[holds], invalid).tolist() if not (truncating and _fits(tokens, row))]
    checks.record(r.INVALID_SAMPLING_MASK, np.array(invalid, dtype=np.int64))
    corrupt = []
    for row in checks.passing().tolist():
        kept = tokens.kept(row)
        note = extras[row].get(KEPT_NOTE) if isinstance(extras[row], dict) else None
        named = note.get(KEPT_DIGEST_KEY) if isinstance(note, dict) else None
        if named != (kept.digest() if kept else None):
            corrupt.append(row)
    checks.record(r.CORRUPT_SAMPLING_MASK, np.array(corrupt, dtype=np.int64))


def _fits(tokens: _Tokens, row: int) -> bool:
    """Whether the kept sets of table row ``row`` hold its sampled tokens as :meth:`KeptSets.check` requires."""
    try:
        tokens.kept(row).check(tokens.sampled_ids(row))
    except ValueError:
        return False
    return True


def _check_links(checks: _Checks, table: pa.Table, tokens: _Tokens, chain_start: np.ndarray, stored: list[str]) -> None:
    """Parent lengths, then the chain-hash walk from each root (a failed parent already failed the chain)."""
    prev_len = pc.fill_null(table.column("prev_len"), 0).to_numpy(zero_copy_only=False)
    cum_len = pc.fill_null(table.column("cum_len"), 0).to_numpy(zero_copy_only=False)
    child = np.flatnonzero(~chain_start)
    checks.record(r.PARENT_LENGTH_MISMATCH, child[prev_len[child] != cum_len[child - 1]])
    todo = checks.passing()
    walkable = todo[chain_start[todo] | np.isin(todo - 1, todo)]
    rows = walkable.tolist()
    parents = [None if chain_start[i] else stored[i - 1] for i in rows]
    walked = db.chain_hashes(tokens.flat, parents, tokens.position[walkable].tolist())
    wrong = [i for i, recomputed in zip(rows, walked, strict=True) if recomputed != stored[i]]
    checks.record(r.CHAIN_HASH_MISMATCH, np.array(wrong, dtype=np.int64))


def _flat_values(lists: pa.ChunkedArray) -> np.ndarray:
    """The values of every list cell, end to end, as one numpy array (copied only across chunks)."""
    chunks = [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in lists.chunks]
    if len(chunks) == 1:
        return chunks[0]
    return np.concatenate([np.zeros(0, lists.type.value_type.to_pandas_dtype()), *chunks])


def _differs(column: pa.ChunkedArray, expected: pa.ChunkedArray) -> np.ndarray:
    """Rows where the column's value != the expected column's (null equals only null)."""
    same = pc.or_(pc.fill_null(pc.equal(column, expected), False), pc.and_(pc.is_null(column), pc.is_null(expected)))
    return ~same.to_numpy(zero_copy_only=False)


def _differs_from(column: pa.ChunkedArray, expected: object) -> np.ndarray:
    """Rows where the column's value != ``expected`` (Python comparison, over the distinct values first)."""
    if all(value == expected for value in column.unique().to_pylist()):
        return np.zeros(len(column), dtype=bool)
    return np.array([value != expected for value in column.to_pylist()], dtype=bool)


def _parsed_extras(text: str, stored: str) -> object:
    """The extras of extras_json when it parses, is canonical and its digest is ``stored``; else :data:`_CORRUPT`."""
    if text == "null" and stored == _NULL_EXTRAS_DIGEST:
        return None
    try:
        extras = json.loads(text)
        if canonical_json(extras) == text and dg.compute_extras_digest(extras) == stored:
            return extras
    except (ValueError, TypeError):  # invalid JSON, NaN, values the extras encoding refuses
        pass
    return _CORRUPT


def _flat_ints(lists: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An int32 list column (no null cell) flattened: its values (a null read as 0), each cell's start offset plus
    the total, and the cells holding a null value."""
    lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = offsets(lengths)
    values = pc.list_flatten(lists)
    bad = np.zeros(0, np.int64)
    if values.null_count:
        bad = np.unique(owners_of(starts, np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))))
        values = pc.fill_null(values, 0)
    return values.to_numpy().astype(np.int32, copy=False), starts, bad
