"""Ragged arrays: index arithmetic over variable-length runs of items laid end to end in one flat array.

Run ``k`` of a flat array is ``items[starts[k]:starts[k + 1]]``; ``starts`` (int64) holds every
run's start plus the total at the end. Chains of calls, calls of tokens and rows of a table are
all runs over one flat column, so finalization gathers and reduces them without a loop per run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa


def offsets(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Start offsets of consecutive runs of ``lengths``, plus the total at the end (int64)."""
    lengths = np.asarray(lengths, np.int64)
    starts = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    return starts


def owners(starts: np.ndarray) -> np.ndarray:
    """The run (of ``starts``) of every item, items laid end to end."""
    return np.repeat(np.arange(starts.size - 1), np.diff(starts))


def owners_of(starts: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The run (of ``starts``) holding each of the given item positions."""
    return np.searchsorted(starts, positions, side="right") - 1


def gather(starts: np.ndarray, runs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the items of the given runs (of ``starts``) laid end to end, and the new runs' starts."""
    lo = starts[runs]
    return ranges(lo, starts[runs + 1] - lo)


def ranges(lo: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``lo[k]:lo[k] + lengths[k]`` of every run laid end to end, and the runs' new starts."""
    new_starts = offsets(lengths)
    return np.arange(new_starts[-1], dtype=np.int64) + np.repeat(lo - new_starts[:-1], lengths), new_starts


def run_sums(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The sum of each run ``values[starts[k]:starts[k + 1]]`` (int64; 0 for an empty run)."""
    sums = np.zeros(starts.size - 1, np.int64)
    nonempty = starts[1:] > starts[:-1]
    if nonempty.any():
        sums[nonempty] = np.add.reduceat(values[: starts[-1]], starts[:-1][nonempty], dtype=np.int64)
    return sums


def take_rows(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """The given rows of ``table`` in that order; the table itself when that is every row in order."""
    if rows.size == table.num_rows and np.array_equal(rows, np.arange(rows.size)):
        return table
    return table.take(pa.array(rows, pa.int64()))
