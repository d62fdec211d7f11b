"""The two validation suites as data (docs/architecture.md §1 and §8): which expectation checks which profile table.

A suite is a list of :class:`ExpectationSpec`: a stable name, the profile table it reads, a Great
Expectations expectation type with its arguments, a severity and the rule in one sentence. A
suite fails only when a ``fail`` expectation fails; a failing ``warn`` expectation makes it
``warned``. Thresholds come from :class:`~tasks.config.ValidationSpec` (the field each one reads
is named, with its value), so the suites are built per run, one function per suite. Nothing here
imports Great Expectations: :mod:`tasks.validate.gx_run` turns the specs into GX objects.

Rates are written as GX's ``mostly``: a rate ``<= max`` over a flag column is "the flag is clear
on at least ``1 - max`` of the rows", which names the flagged rows as the unexpected ones.
Null flags are not counted (GX leaves missing values out of map expectations), which is how a
rate picks its denominator (``poisoned`` is null for a rollout without a receipt).

``max_poisoned_rate`` bounds the receipts that failed or were poisoned, together, in two
expectations that name which: ``failed_rollout_rate`` (failed receipts, at most
``max_poisoned_rate``; its examples are the failure reasons, ``agent_exit``...) and
``poisoned_rollout_rate`` (poisoned receipts, at most ``max_poisoned_rate`` less the failed share
the profile found, so the two fail together exactly when failed and poisoned receipts exceed the
bound, and a batch whose rollouts only failed fails ``failed_rollout_rate`` alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks.batch_fields import ON_INVALID
from tasks.checks import check_choice
from tasks.config import ValidationSpec
from tasks.records.suite_summary import DATASET, LINEAGE, SEVERITIES

# What ``observed`` reports: the share of checked rows that broke the rule, or that kept it.
OBSERVED = ("unexpected_rate", "expected_rate")
# What ``examples`` are: ids of offending rows (the table's id column), or their offending values.
EXAMPLES = ("ids", "values")


@dataclass(frozen=True)
class TableSpec:
    """A profile table a suite reads: its name and the id column that names offending rows."""

    name: str
    index_column: str
    description: str


@dataclass(frozen=True)
class ExpectationSpec:
    """One expectation of a suite; ``expectation`` is the GX type (``expect_column_values_to_be_unique``).

    ``threshold_field`` names where a bound comes from (a :class:`ValidationSpec` field, or
    ``batch.weight_version``) and ``threshold`` holds the value used; both None for a rule
    without a tunable bound. ``examples``: ``ids`` of offending rows, or their offending ``values``.
    """

    name: str
    table: str
    expectation: str
    kwargs: Mapping[str, Any]
    severity: str
    rule: str
    threshold_field: str | None = None
    threshold: Any = None
    observed: str = "unexpected_rate"
    examples: str = "ids"

    def __post_init__(self) -> None:
        check_choice(self.severity, SEVERITIES, field=f"expectation {self.name}: severity")
        check_choice(self.observed, OBSERVED, field=f"expectation {self.name}: observed")
        check_choice(self.examples, EXAMPLES, field=f"expectation {self.name}: examples")


@dataclass(frozen=True)
class SuiteSpec:
    """A suite: its tables, its expectations in report order, and the table whose rows ``counts.rows`` gives."""

    name: str
    tables: tuple[TableSpec, ...]
    expectations: tuple[ExpectationSpec, ...]
    rows_table: str
    tables_by_name: dict[str, TableSpec] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables_by_name", {t.name: t for t in self.tables})
        names = [e.name for e in self.expectations]
        if len(set(names)) != len(names):
            raise ValueError(f"suite {self.name}: expectation names repeat: {names}")
        unknown = sorted({e.table for e in self.expectations} - set(self.tables_by_name))
        if unknown or self.rows_table not in self.tables_by_name:
            raise ValueError(f"suite {self.name}: expectations read undeclared tables {unknown or [self.rows_table]}")


def _rate_at_most(flag: str, bad: object, maximum: float) -> dict[str, Any]:
    """Arguments of "the share of rows whose ``flag`` is ``bad`` is at most ``maximum``" (``mostly``)."""
    return {"column": flag, "value_set": [not bad], "mostly": 1.0 - maximum}


def _hex(name: str, column: str) -> ExpectationSpec:
    """Every call record's ``column`` is well formed: its ``{column}_well_formed`` flag (the profile's regex match)."""
    return ExpectationSpec(
        name=name,
        table="calls",
        expectation="expect_column_values_to_be_in_set",
        kwargs={"column": f"{column}_well_formed", "value_set": [True]},
        severity="fail",
        rule=f"Every call record's {column} is a SHA-256 digest: 64 lowercase hex digits.",
    )


LINEAGE_TABLES = (
    TableSpec("shards", "shard", "one row per planned shard: committed? ledger verified?"),
    TableSpec("call_keys", "call_id", "one row per call record of the committed shards: its ids and staged row"),
    TableSpec(
        "calls", "call_id", "one row per call record: lengths, mode, weight version, its parent's, digests well formed?"
    ),
    TableSpec("model_calls", "call_id", "one row per model call (call records and failure rows): failed?"),
    TableSpec(
        "rollouts",
        "rollout_id",
        "one row per planned rollout of the committed shards and per receipt: receipts, flags, calls replayed",
    ),
)
# The rollouts table's counts of what its receipts replayed (tasks.validate.lineage_profile's docstring).
REPLAY_COUNTS = ("replayed", "replayed_found", "restaged")


def poisoned_bound(max_poisoned_rate: float, failed_share: float) -> float:
    """The poisoned receipts' share allowed beside ``failed_share`` failed ones: ``max_poisoned_rate`` less it, at
    least 0 (rounded to 12 places, so that a rate exactly at the bound passes)."""
    return round(max(0.0, max_poisoned_rate - failed_share), 12)


def lineage_suite(thresholds: ValidationSpec, *, weight_version: int, failed_share: float = 0.0) -> SuiteSpec:
    """The lineage suite over the committed ledger (token-free); ``weight_version`` is the batch's (planned) one,
    ``failed_share`` the share of receipts that failed (:func:`tasks.validate.lineage_profile.failed_share`)."""
    t = thresholds
    poisoned_max = poisoned_bound(t.max_poisoned_rate, failed_share)
    specs = (
        ExpectationSpec(
            name="all_shards_committed",
            table="shards",
            expectation="expect_column_values_to_be_in_set",
            kwargs={"column": "committed", "value_set": [True]},
            severity="warn",
            rule="Every planned shard has a commit marker; a batch validated with shards missing is flagged.",
        ),
        ExpectationSpec(
            name="committed_ledgers_verified",
            table="shards",
            expectation="expect_column_values_to_be_in_set",
            kwargs={"column": "ledger_verified", "value_set": [True]},
            severity="fail",
            rule="Every committed shard's marker and ledger files pass their size, sha256 and record checks.",
        ),
        ExpectationSpec(
            name="call_ids_unique",
            table="call_keys",
            expectation="expect_column_values_to_be_unique",
            kwargs={"column": "call_id"},
            severity="fail",
            rule="No call id is recorded twice in the batch.",
        ),
        ExpectationSpec(
            name="staging_keys_unique",
            table="call_keys",
            expectation="expect_column_values_to_be_unique",
            kwargs={"column": "staging_key"},
            severity="fail",
            rule="No staging key ({rollout_id}/{call_id}) is recorded twice in the batch.",
        ),
        ExpectationSpec(
            name="staged_rows_unique",
            table="call_keys",
            expectation="expect_compound_columns_to_be_unique",
            kwargs={"column_list": ["staging_segment", "staging_row"]},
            severity="fail",
            rule="No two call records point at the same staged row (segment and row).",
        ),
        ExpectationSpec(
            name="parents_resolve",
            table="calls",
            expectation="expect_column_values_to_be_in_set",
            kwargs={"column": "parent_resolves", "value_set": [True]},
            severity="fail",
            rule="Every parent_call_id names a call record of the same rollout (failure rows never resolve).",
        ),
        ExpectationSpec(
            name="cum_len_is_prev_len_plus_delta_len",
            table="calls",
            expectation="expect_cum_len_to_equal_prev_len_plus_delta_len",
            kwargs={"column_list": ["cum_len", "prev_len", "delta_len"]},
            severity="fail",
            rule="Every call's cum_len equals its prev_len plus its delta_len.",
        ),
        ExpectationSpec(
            name="prev_len_is_parent_cum_len",
            table="calls",
            expectation="expect_column_pair_values_to_be_equal",
            kwargs={"column_A": "prev_len", "column_B": "parent_cum_len", "ignore_row_if": "either_value_is_missing"},
            severity="fail",
            rule="Every child's prev_len equals its parent's cum_len.",
        ),
        ExpectationSpec(
            name="root_iff_no_parent",
            table="calls",
            expectation="expect_calls_to_follow_root_rules",
            kwargs={"column_list": ["has_parent", "prev_len", "mode"]},
            severity="fail",
            rule="A call is a root (mode text, prev_len 0, no parent) or a token_in child (a parent, prev_len > 0).",
        ),
        _hex("digests_well_formed", "digest"),
        _hex("extras_digests_well_formed", "extras_digest"),
        _hex("chain_hashes_well_formed", "chain_hash"),
        _hex("cumulative_hashes_well_formed", "cumulative_hash"),
        ExpectationSpec(
            name="weight_versions_at_least_planned",
            table="calls",
            expectation="expect_column_values_to_be_between",
            kwargs={"column": "weight_version", "min_value": weight_version},
            severity="fail",
            rule="No call was admitted at a weight version older than the batch's weight_version.",
            threshold_field="batch.weight_version",
            threshold=weight_version,
        ),
        ExpectationSpec(
            name="weight_versions_non_decreasing",
            table="calls",
            expectation="expect_column_pair_values_a_to_be_greater_than_b",
            kwargs={
                "column_A": "weight_version",
                "column_B": "parent_weight_version",
                "or_equal": True,
                "ignore_row_if": "either_value_is_missing",
            },
            severity="warn",
            rule="No child call was admitted at an older weight version than its parent.",
        ),
        ExpectationSpec(
            name="failure_row_rate",
            table="model_calls",
            expectation="expect_column_values_to_be_in_set",
            kwargs=_rate_at_most("failed", True, t.max_failure_row_rate),
            severity="warn",
            rule="At most max_failure_row_rate of the model calls have a failure row.",
            threshold_field="max_failure_row_rate",
            threshold=t.max_failure_row_rate,
        ),
        ExpectationSpec(
            name="one_receipt_per_planned_rollout",
            table="rollouts",
            expectation="expect_column_values_to_be_between",
            kwargs={"column": "receipts", "min_value": 1, "max_value": 1},
            severity="fail",
            rule="Every planned rollout of a committed shard has exactly one receipt.",
        ),
        ExpectationSpec(
            name="receipts_are_planned",
            table="rollouts",
            expectation="expect_column_values_to_be_in_set",
            kwargs={"column": "planned", "value_set": [True]},
            severity="fail",
            rule="Every receipt is of a rollout that the plan of its shard lists.",
        ),
        ExpectationSpec(
            name="replayed_calls_staged_once",
            table="rollouts",
            expectation="expect_replayed_calls_to_be_staged_once",
            kwargs={"column_list": list(REPLAY_COUNTS), "ignore_row_if": "any_value_is_missing"},
            severity="fail",
            rule="Every call a receipt replayed (replayed_calls) is a call record of its rollout in an earlier "
            "attempt, and no call of the receipt's own attempt has the chain_hash of one it replayed (a committed "
            "call sampled and staged again).",
        ),
        ExpectationSpec(
            name="poisoned_rollout_rate",
            table="rollouts",
            expectation="expect_column_values_to_be_in_set",
            kwargs=_rate_at_most("poisoned", True, poisoned_max),
            severity="fail",
            rule="At most max_poisoned_rate of the receipts are poisoned or failed: the poisoned ones at most "
            "max_poisoned_rate less the share that failed (failed_rollout_rate).",
            threshold_field="max_poisoned_rate - failed share",
            threshold=poisoned_max,
        ),
        ExpectationSpec(
            name="failed_rollout_rate",
            table="rollouts",
            expectation="expect_column_values_to_be_in_set",
            kwargs={"column": "failed_reason", "value_set": [""], "mostly": 1.0 - t.max_poisoned_rate},
            severity="fail",
            rule="At most max_poisoned_rate of the receipts failed (their agent or environment gave no reward: "
            "agent_exit, agent_timeout, environment_error...); the examples are the failure reasons.",
            threshold_field="max_poisoned_rate",
            threshold=t.max_poisoned_rate,
            examples="values",
        ),
        ExpectationSpec(
            name="capture_poisoned_rate",
            table="rollouts",
            expectation="expect_column_values_to_be_in_set",
            kwargs=_rate_at_most("capture_poisoned", True, t.max_capture_poisoned_rate),
            severity="fail",
            rule="At most max_capture_poisoned_rate of the planned rollouts are capture-poisoned "
            "(a capture failure row, or a receipt poisoned for a capture reason).",
            threshold_field="max_capture_poisoned_rate",
            threshold=t.max_capture_poisoned_rate,
        ),
        ExpectationSpec(
            name="declared_terminal_rate",
            table="rollouts",
            expectation="expect_column_values_to_be_in_set",
            kwargs={"column": "declared_terminal", "value_set": [True], "mostly": t.min_declared_terminal_rate},
            severity="warn",
            rule="At least min_declared_terminal_rate of the ok receipts name a terminal the runner declared.",
            threshold_field="min_declared_terminal_rate",
            threshold=t.min_declared_terminal_rate,
            observed="expected_rate",
        ),
    )
    return SuiteSpec(name=LINEAGE, tables=LINEAGE_TABLES, expectations=specs, rows_table="calls")


DATASET_TABLES = (
    TableSpec("shards", "shard", "one row per planned shard: in the staged dataset?"),
    TableSpec("rows", "rollout_id", "one row per dataset row: list lengths, token counts, flags, scalars"),
    TableSpec("groups", "group_id", "one row per group: rollouts with rows, group_size, mean advantage"),
    TableSpec("rollouts", "rollout_id", "one row per planned rollout of the dataset's shards: trainable?"),
    TableSpec("off_policy", "batch_id", "one row: the off-policy gate's measures from the logprob audit (null: none)"),
)


def _at_most(column: str, maximum: float) -> dict[str, Any]:
    return {"column": column, "max_value": maximum}


def off_policy_expectations(t: ValidationSpec) -> list[ExpectationSpec]:
    """The off-policy gate (docs/finalization.md, "The off-policy gate"): NaN logprobs and missing sampling masks
    fail; ratios away from 1, tokens out of bounds and stale tokens warn (the batch waits for review). Every
    measure is null, so every expectation passes, when finalize ran without the logprob audit."""
    return [
        ExpectationSpec(
            name="off_policy_no_nan_logprobs",
            table="off_policy",
            expectation="expect_column_values_to_be_between",
            kwargs=_at_most("nan_tokens", 0),
            severity="fail",
            rule="No audited token has a NaN stored or recomputed logprob.",
            examples="values",
        ),
        ExpectationSpec(
            name="off_policy_masks_present",
            table="off_policy",
            expectation="expect_column_values_to_be_between",
            kwargs=_at_most("missing_mask_tokens", 0),
            severity="fail",
            rule="Every audited token sampled with top-p / top-k has its kept set (sampling mask).",
            examples="values",
        ),
        ExpectationSpec(
            name="off_policy_kept_ratio_mean",
            table="off_policy",
            expectation="expect_column_values_to_be_between",
            kwargs=_at_most("kept_ratio_mean_deviation", t.off_policy_max_ratio_deviation),
            severity="warn",
            rule="The audited tokens' trainer-over-sampler ratio over their kept sets averages to 1 within "
            "off_policy_max_ratio_deviation.",
            threshold_field="off_policy_max_ratio_deviation",
            threshold=t.off_policy_max_ratio_deviation,
            examples="values",
        ),
        ExpectationSpec(
            name="off_policy_kept_geometric_mean",
            table="off_policy",
            expectation="expect_column_values_to_be_between",
            kwargs=_at_most("kept_geometric_mean_deviation", t.off_policy_max_ratio_deviation),
            severity="warn",
            rule="The audited rows' geometric-mean kept-set ratios (exp of the mean log ratio: below 1 by about the "
            "sampler-to-trainer KL) average to 1 within off_policy_max_ratio_deviation.",
            threshold_field="off_policy_max_ratio_deviation",
            threshold=t.off_policy_max_ratio_deviation,
            examples="values",
        ),
        ExpectationSpec(
            name="off_policy_tokens_within_bound",
            table="off_policy",
            expectation="expect_column_values_to_be_between",
            kwargs=_at_most("outside_bound_rate", t.off_policy_max_outside_rate),
            severity="warn",
            rule="At most off_policy_max_outside_rate of the audited tokens have a kept-set ratio outside "
            "[1/off_policy_ratio_bound, off_policy_ratio_bound] (the bound finalize applied).",
            threshold_field="off_policy_max_outside_rate",
            threshold=t.off_policy_max_outside_rate,
            examples="values",
        ),
        ExpectationSpec(
            name="off_policy_rows_explained",
            table="off_policy",
            expectation="expect_column_values_to_be_between",
            kwargs=_at_most("unexplained_rows", 0),
            severity="warn",
            rule="Every audited row's stored logprobs are what its recorded sampling gives: none is diagnosed as raw "
            "logprobs, sampled at another temperature, or holding a token outside its own kept set.",
            examples="values",
        ),
        ExpectationSpec(
            name="off_policy_staleness",
            table="off_policy",
            expectation="expect_column_values_to_be_between",
            kwargs=_at_most("staleness_max", t.off_policy_max_staleness),
            severity="warn",
            rule="No audited token was sampled more than off_policy_max_staleness weight versions away from the "
            "batch's weight_version.",
            threshold_field="off_policy_max_staleness",
            threshold=t.off_policy_max_staleness,
            examples="values",
        ),
    ]


def dataset_suite(thresholds: ValidationSpec, *, on_invalid: str) -> SuiteSpec:
    """The dataset suite over the staged dataset's profile; ``on_invalid`` is the policy finalize applied."""
    t = thresholds
    check_choice(on_invalid, ON_INVALID, field="on_invalid")
    if on_invalid == "mask":
        group_rollouts = ExpectationSpec(
            name="group_rollouts_equal_group_size",
            table="groups",
            expectation="expect_column_pair_values_to_be_equal",
            kwargs={"column_A": "rollouts", "column_B": "group_size"},
            severity="fail",
            rule="With on_invalid mask, every group has rows of exactly group_size rollouts.",
        )
    else:
        group_rollouts = ExpectationSpec(
            name="group_rollouts_within_group_size",
            table="groups",
            expectation="expect_column_pair_values_a_to_be_greater_than_b",
            kwargs={"column_A": "group_size", "column_B": "rollouts", "or_equal": True},
            severity="fail",
            rule="With on_invalid drop, no group has rows of more than group_size rollouts.",
        )
    specs = [
        ExpectationSpec(
            name="dataset_complete",
            table="shards",
            expectation="expect_column_values_to_be_in_set",
            kwargs={"column": "in_dataset", "value_set": [True]},
            severity="warn",
            rule="The dataset covers every planned shard; a partial dataset (--allow-partial) is flagged.",
        ),
        ExpectationSpec(
            name="token_list_lengths_equal",
            table="rows",
            expectation="expect_multicolumn_values_to_be_equal",
            kwargs={"column_list": ["input_ids_len", "loss_mask_len", "logprobs_len"]},
            severity="fail",
            rule="Every row's input_ids, loss_mask and logprobs have the same length.",
        ),
        ExpectationSpec(
            name="trainable_rows_have_sampled_tokens",
            table="rows",
            expectation="expect_trainable_rows_to_have_sampled_tokens",
            kwargs={"column_list": ["sample_mask", "sampled_tokens"], "ignore_row_if": "any_value_is_missing"},
            severity="fail",
            rule="Every trainable row has at least one token with loss_mask 1 (rows whose lists differ in length "
            "are left to token_list_lengths_equal).",
        ),
        ExpectationSpec(
            name="logprobs_finite",
            table="rows",
            expectation="expect_column_values_to_be_between",
            kwargs={"column": "nonfinite_logprobs", "max_value": 0},
            severity="fail",
            rule="No logprob is NaN or infinite.",
        ),
        ExpectationSpec(
            name="sampled_logprobs_not_positive",
            table="rows",
            expectation="expect_column_values_to_be_between",
            kwargs={"column": "positive_sampled_logprobs", "max_value": 0},
            severity="fail",
            rule="Every logprob where loss_mask is 1 is at most 0.",
        ),
        ExpectationSpec(
            name="carried_logprobs_zero",
            table="rows",
            expectation="expect_column_values_to_be_between",
            kwargs={"column": "nonzero_carried_logprobs", "max_value": 0},
            severity="fail",
            rule="Every logprob where loss_mask is 0 is exactly 0.",
        ),
        ExpectationSpec(
            name="advantages_finite",
            table="rows",
            expectation="expect_column_values_to_be_in_set",
            kwargs={"column": "advantage_finite", "value_set": [True]},
            severity="fail",
            rule="Every row's advantage is a finite number.",
        ),
        ExpectationSpec(
            name="masked_rows_have_zero_advantage",
            table="rows",
            expectation="expect_masked_rows_to_have_zero_advantage",
            kwargs={"column_list": ["sample_mask", "advantage"]},
            severity="fail",
            rule="Every masked row (sample_mask 0) has advantage exactly 0.",
        ),
        ExpectationSpec(
            name="mask_reason_iff_masked",
            table="rows",
            expectation="expect_mask_reason_exactly_on_masked_rows",
            kwargs={"column_list": ["sample_mask", "mask_reason"]},
            severity="fail",
            rule="sample_mask is 1 with a null mask_reason, or 0 with a mask_reason.",
        ),
        ExpectationSpec(
            name="row_weights_within_batch",
            table="rows",
            expectation="expect_column_values_to_be_in_set",
            kwargs={"column": "weights_within_batch", "value_set": [True]},
            severity="warn",
            rule="A row names a sha256 in weights_by_version only for a weight version the batch verified with that "
            "sha256 (metrics weights_by_version): a row whose calls agree on weights the batch judged declared, "
            "not verified (other calls of that version named others, or none) is flagged for review.",
        ),
        group_rollouts,
        ExpectationSpec(
            name="group_advantage_mean_near_zero",
            table="groups",
            expectation="expect_column_values_to_be_between",
            kwargs={
                "column": "advantage_mean",
                "min_value": -t.max_group_advantage_mean,
                "max_value": t.max_group_advantage_mean,
            },
            severity="fail",
            rule="The advantages of a group's trainable rollouts average to 0 within max_group_advantage_mean "
            "(groups with one trainable rollout or equal rewards are not checked: their advantages are 0).",
            threshold_field="max_group_advantage_mean",
            threshold=t.max_group_advantage_mean,
        ),
        ExpectationSpec(
            name="invalid_row_rate",
            table="rollouts",
            expectation="expect_column_values_to_be_in_set",
            kwargs=_rate_at_most("trainable", False, t.max_invalid_row_rate),
            severity="fail",
            rule="At most max_invalid_row_rate of the planned rollouts are masked or dropped.",
            threshold_field="max_invalid_row_rate",
            threshold=t.max_invalid_row_rate,
        ),
    ]
    if t.reward_min is not None or t.reward_max is not None:
        specs.insert(
            -1,
            ExpectationSpec(
                name="rewards_within_bounds",
                table="rows",
                expectation="expect_column_values_to_be_between",
                kwargs={"column": "reward", "min_value": t.reward_min, "max_value": t.reward_max},
                severity="fail",
                rule="Every reward lies within [reward_min, reward_max] (checked only when one is set).",
                threshold_field="reward_min, reward_max",
                threshold=[t.reward_min, t.reward_max],
            ),
        )
    specs.extend(off_policy_expectations(t))
    return SuiteSpec(name=DATASET, tables=DATASET_TABLES, expectations=tuple(specs), rows_table="rows")


def all_expectation_names() -> dict[str, tuple[str, ...]]:
    """Every expectation name each suite can hold, whatever the batch (for the docs)."""
    thresholds = ValidationSpec(reward_min=0.0, reward_max=1.0)
    dataset = [
        e.name for on_invalid in ON_INVALID for e in dataset_suite(thresholds, on_invalid=on_invalid).expectations
    ]
    return {
        LINEAGE: tuple(e.name for e in lineage_suite(thresholds, weight_version=0).expectations),
        DATASET: tuple(dict.fromkeys(dataset)),
    }
