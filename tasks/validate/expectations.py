"""Row-wise rules Great Expectations has no built-in for, as custom expectations over profile tables.

Each rule is a metric provider (the row-wise condition, on pandas: the profiles are small tables
of scalars) and a ``MulticolumnMapExpectation`` that names it; defining the classes registers them
with GX under their snake_case type (``expect_cum_len_to_equal_prev_len_plus_delta_len``).
Importing this module imports GX, so only :mod:`tasks.validate.gx_run` imports it, inside a run.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pandas as pd
from great_expectations.execution_engine import PandasExecutionEngine
from great_expectations.expectations.expectation import MulticolumnMapExpectation
from great_expectations.expectations.metrics.map_metric_provider import MulticolumnMapMetricProvider
from great_expectations.expectations.metrics.map_metric_provider.multicolumn_condition_partial import (
    multicolumn_condition_partial,
)

_DOMAIN_KEYS = ("batch_id", "table", "column_list", "row_condition", "condition_parser", "ignore_row_if")


class CumLenIsPrevLenPlusDeltaLen(MulticolumnMapMetricProvider):
    """Row holds when its first column equals the sum of the other two (cum_len, prev_len, delta_len)."""

    condition_metric_name = "rollout_ledger.cum_len_is_prev_len_plus_delta_len"
    condition_domain_keys = _DOMAIN_KEYS

    @multicolumn_condition_partial(engine=PandasExecutionEngine)
    def _pandas(cls, column_list: pd.DataFrame, **kwargs: Any) -> pd.Series:
        cum_len, prev_len, delta_len = (column_list.iloc[:, i] for i in range(3))
        return cum_len == prev_len + delta_len


class ExpectCumLenToEqualPrevLenPlusDeltaLen(MulticolumnMapExpectation):
    """Every call's cum_len equals its prev_len plus its delta_len (column_list: cum_len, prev_len, delta_len)."""

    map_metric = CumLenIsPrevLenPlusDeltaLen.condition_metric_name
    success_keys: ClassVar[tuple[str, ...]] = ("mostly",)
    args_keys: ClassVar[tuple[str, ...]] = ("column_list",)


class FollowsRootRules(MulticolumnMapMetricProvider):
    """Row holds when it is a root (no parent, prev_len 0, mode text) or a child (parent, prev_len > 0, token_in)."""

    condition_metric_name = "rollout_ledger.follows_root_rules"
    condition_domain_keys = _DOMAIN_KEYS

    @multicolumn_condition_partial(engine=PandasExecutionEngine)
    def _pandas(cls, column_list: pd.DataFrame, **kwargs: Any) -> pd.Series:
        has_parent, prev_len, mode = (column_list.iloc[:, i] for i in range(3))
        root = ~has_parent & (prev_len == 0) & (mode == "text")
        child = has_parent & (prev_len > 0) & (mode == "token_in")
        return root | child


class ExpectCallsToFollowRootRules(MulticolumnMapExpectation):
    """A call is a root or a token_in child, never a mix (column_list: has_parent, prev_len, mode)."""

    map_metric = FollowsRootRules.condition_metric_name
    success_keys: ClassVar[tuple[str, ...]] = ("mostly",)
    args_keys: ClassVar[tuple[str, ...]] = ("column_list",)


class TrainableHasSampledTokens(MulticolumnMapMetricProvider):
    """Row holds when it is not trainable or has at least one sampled token (sample_mask, sampled_tokens)."""

    condition_metric_name = "rollout_ledger.trainable_has_sampled_tokens"
    condition_domain_keys = _DOMAIN_KEYS

    @multicolumn_condition_partial(engine=PandasExecutionEngine)
    def _pandas(cls, column_list: pd.DataFrame, **kwargs: Any) -> pd.Series:
        sample_mask, sampled = column_list.iloc[:, 0], column_list.iloc[:, 1]
        return (sample_mask != 1) | (sampled >= 1)


class ExpectTrainableRowsToHaveSampledTokens(MulticolumnMapExpectation):
    """Every trainable row has a token to train on (column_list: sample_mask, sampled_tokens)."""

    map_metric = TrainableHasSampledTokens.condition_metric_name
    success_keys: ClassVar[tuple[str, ...]] = ("mostly",)
    args_keys: ClassVar[tuple[str, ...]] = ("column_list",)


class MaskedHasZeroAdvantage(MulticolumnMapMetricProvider):
    """Row holds when it is trainable or its advantage is exactly 0 (sample_mask, advantage)."""

    condition_metric_name = "rollout_ledger.masked_has_zero_advantage"
    condition_domain_keys = _DOMAIN_KEYS

    @multicolumn_condition_partial(engine=PandasExecutionEngine)
    def _pandas(cls, column_list: pd.DataFrame, **kwargs: Any) -> pd.Series:
        sample_mask, advantage = column_list.iloc[:, 0], column_list.iloc[:, 1]
        return (sample_mask != 0) | (advantage == 0)


class ExpectMaskedRowsToHaveZeroAdvantage(MulticolumnMapExpectation):
    """Every masked row has advantage exactly 0 (column_list: sample_mask, advantage)."""

    map_metric = MaskedHasZeroAdvantage.condition_metric_name
    success_keys: ClassVar[tuple[str, ...]] = ("mostly",)
    args_keys: ClassVar[tuple[str, ...]] = ("column_list",)


class MaskReasonExactlyWhenMasked(MulticolumnMapMetricProvider):
    """Row holds when sample_mask is 1 without a mask_reason, or 0 with one (sample_mask, mask_reason)."""

    condition_metric_name = "rollout_ledger.mask_reason_exactly_when_masked"
    condition_domain_keys = _DOMAIN_KEYS

    @multicolumn_condition_partial(engine=PandasExecutionEngine)
    def _pandas(cls, column_list: pd.DataFrame, **kwargs: Any) -> pd.Series:
        sample_mask, reason = column_list.iloc[:, 0], column_list.iloc[:, 1]
        return ((sample_mask == 1) & reason.isna()) | ((sample_mask == 0) & reason.notna())


class ExpectMaskReasonExactlyOnMaskedRows(MulticolumnMapExpectation):
    """A row has a mask_reason exactly when it is masked (column_list: sample_mask, mask_reason)."""

    map_metric = MaskReasonExactlyWhenMasked.condition_metric_name
    success_keys: ClassVar[tuple[str, ...]] = ("mostly",)
    args_keys: ClassVar[tuple[str, ...]] = ("column_list",)


class ReplayedCallsStagedOnce(MulticolumnMapMetricProvider):
    """Row holds when every replayed call was found in an earlier attempt and none was restaged
    (replayed, replayed_found, restaged)."""

    condition_metric_name = "rollout_ledger.replayed_calls_staged_once"
    condition_domain_keys = _DOMAIN_KEYS

    @multicolumn_condition_partial(engine=PandasExecutionEngine)
    def _pandas(cls, column_list: pd.DataFrame, **kwargs: Any) -> pd.Series:
        replayed, found, restaged = (column_list.iloc[:, i] for i in range(3))
        return (found == replayed) & (restaged == 0)


class ExpectReplayedCallsToBeStagedOnce(MulticolumnMapExpectation):
    """Every call a receipt replayed is an earlier attempt's call record of its rollout, and no call of the
    receipt's own attempt staged it again (column_list: replayed, replayed_found, restaged)."""

    map_metric = ReplayedCallsStagedOnce.condition_metric_name
    success_keys: ClassVar[tuple[str, ...]] = ("mostly",)
    args_keys: ClassVar[tuple[str, ...]] = ("column_list",)
