"""The off-policy gate's figures: how far a trainer's logprobs of the audited tokens are from the stored ones.

The logprob audit (:mod:`tasks.finalize.logprob_audit`) recomputes, for each audited sampled token,
the trainer's logprob two ways (:mod:`tasks.models.logprobs`, the definitions the trainer uses):
over the whole vocabulary, and over the token's recorded kept set (its sampling mask; the same as
the whole vocabulary when the row's sampling does not truncate). :func:`off_policy_figures` turns
them into the ``off_policy`` object of the audit report (the contract in
``docs/finalization.md#the-off-policy-gate``): ratios trainer over sampler (token, sequence,
geometric mean), the share of tokens and sequences each peer trainer's default rule would mask or
truncate, weight-version staleness against the batch's planned version, NaN and missing-mask
counts, and the rows to look at first, each with the reasons it was flagged.

Invariants: a token whose stored or recomputed logprob is NaN (or whose stored logprob is not
finite) is counted in ``nan_tokens`` and left out of every ratio; a token of a truncating row
without a kept set is counted in ``missing_mask_tokens`` and left out of the kept-set ratios
(its full-vocabulary ratio is still measured); a sampled token outside its own kept set has
kept-set ratio 0 (the mask says it could not have been drawn). Every float of the output is
finite or None.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_FLAGGED_ROWS = 32
LOG_RATIO_CLIP = 20.0  # log ratios (and sequence sums) are clipped to +-20 in the figures, so they stay finite
MAX_FLAGGED_TOKENS = 512  # tokens listed per flagged row (its first ones)

# The peers' default rules, each over the kept-set ratio r (trainer / sampler). Sources: docs/finalization.md.
VERL_TOKEN_TIS_CAP = 2.0  # verl rollout_correction: rollout_is=token, rollout_is_threshold 2.0 (truncate r > 2)
TRL_SEQUENCE_CAP = 3.0  # TRL GRPO: vllm_importance_sampling_mode sequence_mask, clip_max 3.0 (exp(sum log r) > 3)
PRIME_RL_TOKEN_MASK = (0.125, 8.0)  # prime-rl token_mask_low / token_mask_high (mask r outside)
AREAL_TOKEN_CAP = 5.0  # AReaL behave_imp_weight_cap 5.0, token_mask mode (mask r > 5)
NEMO_RL_SEQ_MASK_TIS = (0.999, 1.002)  # NeMo RL seq-mask-tis reference bounds on exp(mean log r) per sequence

PEERS = ("verl_token_tis_2", "trl_sequence_3", "prime_rl_mask_0.125_8", "areal_token_5", "nemo_rl_seq_mask_tis")
RATIO_KINDS = ("kept_set", "full_vocab")
# Why a row is flagged, worst first.
REASONS = (
    "nan_logprob",
    "missing_mask",
    "raw_logprobs",
    "temperature_mismatch",
    "outside_kept_set",
    "ratio_outside_bounds",
    "stale_tokens",
)


@dataclass(frozen=True)
class OffPolicyThresholds:
    """The gate's lines, from the batch config (:class:`~tasks.config.ValidationSpec`, fields ``off_policy_*``)."""

    max_ratio_deviation: float = 0.02  # |mean kept-set ratio - 1| and |geometric mean - 1|, at most
    ratio_bound: float = 2.0  # a token's kept-set ratio outside [1 / bound, bound] is out of bounds
    max_outside_rate: float = 0.01  # share of scored tokens out of bounds, at most
    max_staleness: int = 0  # weight versions a token's is behind the planned one, at most

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_ratio_deviation) and self.max_ratio_deviation >= 0):
            raise ValueError(f"max_ratio_deviation must be finite and >= 0, got {self.max_ratio_deviation!r}")
        if not (math.isfinite(self.ratio_bound) and self.ratio_bound > 1):
            raise ValueError(f"ratio_bound must be finite and > 1, got {self.ratio_bound!r}")
        if not 0 <= self.max_outside_rate <= 1:
            raise ValueError(f"max_outside_rate must be in [0, 1], got {self.max_outside_rate!r}")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {self.max_staleness!r}")

    @classmethod
    def of(cls, validation: Any) -> OffPolicyThresholds:
        """The thresholds a :class:`~tasks.config.ValidationSpec` (its ``off_policy_*`` fields) sets."""
        return cls(
            max_ratio_deviation=float(validation.off_policy_max_ratio_deviation),
            ratio_bound=float(validation.off_policy_ratio_bound),
            max_outside_rate=float(validation.off_policy_max_outside_rate),
            max_staleness=int(validation.off_policy_max_staleness),
        )

    def as_fields(self) -> dict[str, float | int]:
        """The thresholds under the names of their batch-config fields."""
        return {
            "off_policy_max_ratio_deviation": self.max_ratio_deviation,
            "off_policy_ratio_bound": self.ratio_bound,
            "off_policy_max_outside_rate": self.max_outside_rate,
            "off_policy_max_staleness": self.max_staleness,
        }


@dataclass(frozen=True)
class ScoredRow:
    """One audited row's sampled tokens, in order, with the stored and the trainer's logprobs (float64).

    ``kept_set`` is None when the row truncates but carries no kept set (``missing_mask``);
    ``kept_counts`` is None when the row does not truncate or has no mask; ``versions`` is the
    weight version that sampled each token. ``raw_logprobs`` and ``sampled_temperature`` are the
    audit's diagnosis of a row whose stored logprobs its recorded sampling does not explain.
    """

    rollout_id: str
    token_ids: np.ndarray
    stored: np.ndarray
    full_vocab: np.ndarray
    kept_set: np.ndarray | None
    kept_counts: np.ndarray | None
    versions: np.ndarray
    missing_mask: bool = False
    raw_logprobs: bool = False  # the stored logprobs are the raw ones (temperature 1, whole vocabulary)
    sampled_temperature: float | None = None  # a temperature other than the recorded one explains them


def off_policy_figures(
    rows: Sequence[ScoredRow],
    *,
    planned_weight_version: int,
    thresholds: OffPolicyThresholds,
    text: Callable[[int], str] = lambda token: "",
) -> dict[str, Any]:
    """The ``off_policy`` object of the audit report for ``rows`` (module docstring; JSON-ready)."""
    per_row = [_RowFigures.of(row, planned_weight_version) for row in rows]
    tokens = sum(r.row.token_ids.size for r in per_row)
    kept_log = [r.log_ratio["kept_set"] for r in per_row]
    staleness = np.concatenate([r.staleness for r in per_row]) if per_row else np.zeros(0, np.int64)
    mass = np.concatenate([r.kept_mass for r in per_row]) if per_row else np.zeros(0)
    mass = mass[np.isfinite(mass)]
    low, high = 1.0 / thresholds.ratio_bound, thresholds.ratio_bound
    outside = [_outside(log, low, high) for log in kept_log]
    flagged = [(r, _reasons(r, o, thresholds)) for r, o in zip(per_row, outside, strict=True)]
    flagged = [(r, reasons) for r, reasons in flagged if reasons]
    flagged.sort(key=lambda item: (min(REASONS.index(x) for x in item[1]), -len(item[1]), -item[0].worst))
    return {
        "planned_weight_version": int(planned_weight_version),
        "tokens": int(tokens),
        "sequences": len(per_row),
        "nan_tokens": int(sum(int(r.nan.sum()) for r in per_row)),
        "missing_mask_tokens": int(sum(r.row.token_ids.size for r in per_row if r.row.missing_mask)),
        "kept_mass_mean": _num(np.mean(mass)) if mass.size else None,
        "ratios": {kind: _ratio_figures([r.log_ratio[kind] for r in per_row]) for kind in RATIO_KINDS},
        "tokens_outside_bound": int(sum(int(o.sum()) for o in outside)),
        "sequences_outside_bound": int(sum(bool(o.any()) for o in outside)),
        "peers": _peers(kept_log),
        "staleness": {
            "max": int(staleness.max()) if staleness.size else None,
            "mean": _num(np.mean(staleness)) if staleness.size else None,
            "tokens_by_versions_behind": {
                str(int(v)): int(n) for v, n in zip(*np.unique(staleness, return_counts=True), strict=True)
            },
        },
        "flagged_rows": [_flagged(r, reasons, text) for r, reasons in flagged[:MAX_FLAGGED_ROWS]],
        "thresholds": thresholds.as_fields(),
    }


# What the dataset suite bounds (tasks.validate.suites, table ``off_policy``): name -> what it is.
GATE_MEASURES = {
    "nan_tokens": "audited tokens whose stored or recomputed logprob is NaN",
    "missing_mask_tokens": "audited tokens of truncating rows without their kept sets",
    "kept_ratio_mean_deviation": "|mean kept-set token ratio - 1|",
    "kept_geometric_mean_deviation": "|mean of the rows' geometric-mean kept-set ratios - 1|",
    "outside_bound_rate": "audited tokens whose kept-set ratio is outside [1/bound, bound] / audited tokens",
    "staleness_max": "most weight versions an audited token's is behind the planned one",
    "unexplained_rows": "audited rows whose stored logprobs their recorded sampling does not explain, diagnosed",
}
# The diagnoses that make a row unexplained: raw logprobs, another temperature, a token outside its own kept set.
DIAGNOSES = ("raw_logprobs", "temperature_mismatch", "outside_kept_set")


def gate_measures(off_policy: Mapping[str, Any] | None) -> dict[str, float | None]:
    """The :data:`GATE_MEASURES` of an audit report's ``off_policy`` object; all None without one (no audit)."""
    if not off_policy:
        return dict.fromkeys(GATE_MEASURES)
    kept = (off_policy.get("ratios") or {}).get("kept_set") or {}
    tokens = off_policy.get("tokens") or 0
    return {
        "nan_tokens": off_policy.get("nan_tokens"),
        "missing_mask_tokens": off_policy.get("missing_mask_tokens"),
        "kept_ratio_mean_deviation": _deviation(kept.get("token_mean")),
        "kept_geometric_mean_deviation": _deviation(kept.get("geometric_mean")),
        "outside_bound_rate": off_policy.get("tokens_outside_bound", 0) / tokens if tokens else None,
        "staleness_max": (off_policy.get("staleness") or {}).get("max"),
        "unexplained_rows": sum(
            1 for row in off_policy.get("flagged_rows") or () if set(row.get("reasons") or ()) & set(DIAGNOSES)
        ),
    }


def _deviation(ratio: float | None) -> float | None:
    return abs(ratio - 1.0) if ratio is not None else None


@dataclass(frozen=True)
class _RowFigures:
    row: ScoredRow
    nan: np.ndarray  # per token: stored or recomputed logprob is NaN (or stored not finite)
    log_ratio: Mapping[str, np.ndarray]  # per kind: log ratios of the tokens it scores (NaN ones left out)
    token_ratio: np.ndarray  # per token: kept-set ratio, NaN where not measured
    kept_mass: np.ndarray  # per token: exp(full - kept), NaN where not measured
    staleness: np.ndarray
    worst: float  # largest |log ratio| over the kept-set ratios (inf outside the kept set)

    @classmethod
    def of(cls, row: ScoredRow, planned: int) -> _RowFigures:
        stored, full = row.stored, row.full_vocab
        nan = ~np.isfinite(stored) | np.isnan(full)
        if row.kept_set is not None:
            nan |= np.isnan(row.kept_set)
        good = ~nan
        full_log = full[good] - stored[good]
        token_ratio = np.full(stored.size, np.nan)
        kept_mass = np.full(stored.size, np.nan)
        if row.kept_set is None:
            kept_log = np.zeros(0)
        else:
            kept_log = row.kept_set[good] - stored[good]
            with np.errstate(over="ignore"):
                token_ratio[good] = np.exp(kept_log)
                both = good & np.isfinite(row.kept_set)
                kept_mass[both] = np.exp(full[both] - row.kept_set[both])
        worst = float(np.max(np.abs(kept_log))) if kept_log.size else 0.0
        return cls(
            row=row,
            nan=nan,
            log_ratio={"kept_set": kept_log, "full_vocab": full_log},
            token_ratio=token_ratio,
            kept_mass=kept_mass,
            staleness=np.maximum(int(planned) - row.versions.astype(np.int64), 0),
            worst=worst,
        )


def _ratio_figures(log_ratios: list[np.ndarray]) -> dict[str, float | None]:
    """Token mean and percentiles of the ratios; per-row sequence ratio exp(sum) and geometric mean exp(mean).

    Log ratios are clipped to ``+-LOG_RATIO_CLIP`` first (a token outside its kept set counts as ratio ~0)."""
    scored = [np.clip(log, -LOG_RATIO_CLIP, LOG_RATIO_CLIP) for log in log_ratios if log.size]
    values = np.concatenate(scored) if scored else np.zeros(0)
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = np.exp(values)
        sequence = np.array([np.exp(np.clip(np.sum(log), -LOG_RATIO_CLIP, LOG_RATIO_CLIP)) for log in scored])
        geometric = np.array([np.exp(np.mean(log)) for log in scored])
    if not values.size:
        return dict.fromkeys(("token_mean", "token_p01", "token_p50", "token_p99", "sequence_mean", "geometric_mean"))
    p01, p50, p99 = np.percentile(ratio, [1, 50, 99])
    return {
        "token_mean": _num(np.mean(ratio)),
        "token_p01": _num(p01),
        "token_p50": _num(p50),
        "token_p99": _num(p99),
        "sequence_mean": _num(np.mean(sequence)),
        "geometric_mean": _num(np.mean(geometric)),
    }


def _peers(kept_log: list[np.ndarray]) -> dict[str, dict[str, float | None]]:
    """Share of scored tokens and sequences each peer's default rule masks or truncates (kept-set ratios).

    A token rule touches a sequence when it touches one of its tokens; a sequence rule touches
    every token of the sequences it masks.
    """
    scored = [log for log in kept_log if log.size]
    tokens = sum(log.size for log in scored)
    prime_low, prime_high = (math.log(x) for x in PRIME_RL_TOKEN_MASK)
    nemo_low, nemo_high = (math.log(x) for x in NEMO_RL_SEQ_MASK_TIS)
    token_rules = {
        "verl_token_tis_2": lambda log: log > math.log(VERL_TOKEN_TIS_CAP),
        "prime_rl_mask_0.125_8": lambda log: (log < prime_low) | (log > prime_high),
        "areal_token_5": lambda log: log > math.log(AREAL_TOKEN_CAP),
    }
    sequence_rules = {
        "trl_sequence_3": lambda log: np.sum(log) > math.log(TRL_SEQUENCE_CAP),
        "nemo_rl_seq_mask_tis": lambda log: not nemo_low <= np.mean(log) <= nemo_high,
    }
    figures: dict[str, dict[str, float | None]] = {}
    for name in PEERS:
        if not scored:
            figures[name] = {"tokens": None, "sequences": None}
        elif name in token_rules:
            hits = [token_rules[name](log) for log in scored]
            figures[name] = {
                "tokens": sum(int(h.sum()) for h in hits) / tokens,
                "sequences": sum(bool(h.any()) for h in hits) / len(scored),
            }
        else:
            masked = [bool(sequence_rules[name](log)) for log in scored]
            figures[name] = {
                "tokens": sum(log.size for log, m in zip(scored, masked, strict=True) if m) / tokens,
                "sequences": sum(masked) / len(scored),
            }
    return figures


def _outside(log_ratio: np.ndarray, low: float, high: float) -> np.ndarray:
    return (log_ratio < math.log(low)) | (log_ratio > math.log(high))


def _reasons(figures: _RowFigures, outside: np.ndarray, thresholds: OffPolicyThresholds) -> list[str]:
    row = figures.row
    found = {
        "nan_logprob": bool(figures.nan.any()),
        "missing_mask": row.missing_mask,
        "raw_logprobs": row.raw_logprobs,
        "temperature_mismatch": row.sampled_temperature is not None,
        "outside_kept_set": bool(np.isneginf(figures.log_ratio["kept_set"]).any()),
        "ratio_outside_bounds": bool(outside.any()),
        "stale_tokens": bool((figures.staleness > thresholds.max_staleness).any()),
    }
    return [reason for reason in REASONS if found[reason]]


def _flagged(figures: _RowFigures, reasons: list[str], text: Callable[[int], str]) -> dict[str, Any]:
    row = figures.row
    counts = row.kept_counts
    tokens = []
    for i in range(min(row.token_ids.size, MAX_FLAGGED_TOKENS)):
        token = int(row.token_ids[i])
        tokens.append(
            {
                "id": token,
                "text": text(token),
                "logprob": _num(row.stored[i]),
                "ratio": _num(figures.token_ratio[i]),  # None: not measured (NaN, no mask) or overflowing
                "kept": int(counts[i]) if counts is not None and i < counts.size else None,
                "version": int(row.versions[i]),
            }
        )
    return {"rollout_id": row.rollout_id, "reasons": list(reasons), "tokens": tokens}


def _num(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None
