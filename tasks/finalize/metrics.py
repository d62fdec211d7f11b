"""Batch metrics of a finalized dataset (docs/architecture.md §8), accumulated group by group.

:class:`DatasetMetrics` is fed assembled groups (:class:`~tasks.finalize.assemble.AssembledRows`: their
rows, stats and counts of the verified rollouts behind them) plus, per shard, the ledger-level counts
that no rollout carries (:meth:`DatasetMetrics.add_ledger`, and the weights the calls of the rows
name per version: :attr:`DatasetMetrics.weights`). It holds only counters and running sums, so memory
does not grow with the batch. :meth:`DatasetMetrics.result` is a JSON-ready
dict; a rate whose denominator is 0 is None, never NaN.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tasks.checks import check_int
from tasks.finalize import reasons
from tasks.finalize.assemble import AssembledRows
from tasks.finalize.ragged import run_sums
from tasks.finalize.weights import BatchWeights
from tasks.records.ledger import TERMINAL_SELECTIONS

METRICS_VERSION = 1


@dataclass
class _Running:
    """Count, mean, spread (Welford), min and max of a stream of numbers."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    low: float = math.inf
    high: float = -math.inf

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)
        self.low = min(self.low, value)
        self.high = max(self.high, value)

    def summary(self) -> dict[str, float | int | None]:
        """Count, mean, population std, min and max; None statistics when nothing was added."""
        if not self.count:
            return {"count": 0, "mean": None, "std": None, "min": None, "max": None}
        return {
            "count": self.count,
            "mean": self.mean,
            "std": math.sqrt(self.m2 / self.count),
            "min": self.low,
            "max": self.high,
        }


def reason_prefix(reason: str) -> str:
    """The family of a reason: its text before the first ``_`` (``staging_write_failed`` → ``staging``)."""
    return reason.split("_", 1)[0]


@dataclass
class DatasetMetrics:
    """Accumulator of the batch metrics; see the module docstring."""

    planned_rollouts: int = 0
    receipts: int = 0
    rows: int = 0
    trainable_rows: int = 0
    tokens: int = 0
    sampled_tokens: int = 0
    truncated_rows: int = 0
    epoch_span_count: int = 0
    groups: int = 0
    ledger_calls: int = 0
    ledger_token_in_calls: int = 0
    ledger_shards: int = 0
    invalid_reasons: Counter[str] = field(default_factory=Counter)
    failure_reasons: Counter[str] = field(default_factory=Counter)
    terminal_selections: Counter[str] = field(default_factory=Counter)
    advantage_outcomes: Counter[str] = field(default_factory=Counter)
    group_weight_versions: Counter[int] = field(default_factory=Counter)
    weights: BatchWeights = field(default_factory=BatchWeights)  # per version, which weights sampled it
    rewards: _Running = field(default_factory=_Running)
    row_lengths: _Running = field(default_factory=_Running)
    turns: _Running = field(default_factory=_Running)

    def add_groups(self, assembled: AssembledRows) -> None:
        """Count assembled groups: planned rollouts and outcomes, the verified rollouts behind them, rows."""
        for stats in assembled.groups:
            self.groups += 1
            self.planned_rollouts += stats.planned
            self.invalid_reasons.update(dict(stats.invalid_reasons))
            self.advantage_outcomes[stats.advantage_outcome] += 1
            if stats.weight_version is not None:
                self.group_weight_versions[stats.weight_version] += 1
        self.receipts += assembled.receipts
        self.epoch_span_count += assembled.epoch_span_count
        self.terminal_selections.update(dict(assembled.terminal_selections))
        table = assembled.table
        mask = table.column("loss_mask").combine_chunks()
        starts = mask.offsets.to_numpy()  # into mask.values, which a sliced array holds in full
        lengths = np.diff(starts)
        sampled = run_sums(mask.values.to_numpy()[starts[0] :], starts - starts[0])  # loss_mask sum per row
        trainable = table.column("sample_mask").to_numpy() == 1
        self.rows += table.num_rows
        self.tokens += int(lengths.sum())
        for length in lengths.tolist():
            self.row_lengths.add(length)
        self.trainable_rows += int(trainable.sum())
        self.sampled_tokens += int(sampled[trainable].sum())
        self.truncated_rows += int(table.column("truncated").to_numpy()[trainable].sum())
        for reward in table.column("reward").filter(trainable).to_pylist():
            self.rewards.add(float(reward))
        for turns in table.column("num_turns").filter(trainable).to_pylist():
            self.turns.add(turns)

    def add_ledger(self, *, calls: int, token_in_calls: int, failure_reasons: Mapping[str, int]) -> None:
        """Count one committed shard's ledger: all call records, those admitted ``token_in``, failure rows by reason."""
        for name, value in (("calls", calls), ("token_in_calls", token_in_calls)):
            check_int(value, field=name, error=ValueError)
        if token_in_calls > calls:
            raise ValueError(f"token_in_calls ({token_in_calls}) exceeds calls ({calls})")
        self.ledger_shards += 1
        self.ledger_calls += calls
        self.ledger_token_in_calls += token_in_calls
        self.failure_reasons.update(failure_reasons)

    def result(self) -> dict[str, Any]:
        """The metrics as a JSON-ready dict (sorted keys when dumped); see docs for each name."""
        invalid = sum(self.invalid_reasons.values())
        ledger_known = self.ledger_shards > 0
        prefixes: Counter[str] = Counter()
        for reason, count in self.failure_reasons.items():
            prefixes[reason_prefix(reason)] += count
        return {
            "metrics_version": METRICS_VERSION,
            "planned_rollouts": self.planned_rollouts,
            "receipts": self.receipts,
            "missing_receipts": self.invalid_reasons[reasons.MISSING_RECEIPT],
            "rows": self.rows,
            "trainable_rows": self.trainable_rows,
            "masked_rows": self.rows - self.trainable_rows,
            "invalid_rollouts": invalid,
            "invalid_row_rate": _rate(invalid, self.planned_rollouts),
            "invalid_reasons": dict(sorted(self.invalid_reasons.items())),
            "capture_poisoned_rollouts": self.invalid_reasons[reasons.CAPTURE_POISONED],
            "calls_per_rollout": _rate(self.ledger_calls, self.receipts) if ledger_known else None,
            "token_in_rate": _rate(self.ledger_token_in_calls, self.ledger_calls) if ledger_known else None,
            "ledger_calls": self.ledger_calls if ledger_known else None,
            "failure_reasons": dict(sorted(self.failure_reasons.items())),
            "failure_reasons_by_prefix": dict(sorted(prefixes.items())),
            **{
                f"terminal_selection_{name}": _rate(self.terminal_selections[name], self.receipts)
                for name in (*TERMINAL_SELECTIONS, "none")
            },
            "epoch_span_count": self.epoch_span_count,
            "groups": self.groups,
            "groups_dropped": self.advantage_outcomes["no_valid"],
            "groups_zero_variance": self.advantage_outcomes["zero_variance"],
            "groups_single_valid": self.advantage_outcomes["single_valid"],
            "group_weight_versions": {str(v): n for v, n in sorted(self.group_weight_versions.items())},
            "weights_by_version": self.weights.result(),
            "tokens": self.tokens,
            "sampled_tokens": self.sampled_tokens,
            "truncated_rate": _rate(self.truncated_rows, self.trainable_rows),
            "reward": self.rewards.summary(),
            "row_length": self.row_lengths.summary(),
            "turns": self.turns.summary(),
        }


def _rate(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None
