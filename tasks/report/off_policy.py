"""The off-policy gate's figures as the overview page shows them, read from the logprob audit's ``off_policy`` object.

The gate (:mod:`tasks.finalize.off_policy`, issue 46) writes ``audit.off_policy`` into
``dataset/metrics.json``. :meth:`OffPolicyFigures.of` reads it and never raises: an older batch, an
audit run without the gate, or a field of the wrong type gives None (or an empty tuple), and the
page leaves that figure out.

What the page needs beyond the gate's numbers is derived here, so the templates only print:

- whether each threshold is breached (:class:`Threshold`). The gate records the thresholds it
  applied by their batch-config names, not which were breached. A name ``max_<figure>`` or
  ``min_<figure>`` (or ``<figure>_max`` / ``<figure>_min``; an ``off_policy_`` prefix is dropped)
  whose figure is one of :meth:`OffPolicyFigures.figures` (or a name in :data:`FIGURE_ALIASES`:
  ``max_ratio_deviation`` bounds the larger of |kept-set token mean − 1| and |geometric mean − 1|,
  ``max_outside_rate`` the share of tokens outside the ratio bounds, ``max_staleness`` the most
  versions behind) is judged against it; ``…ratio_bound`` b sets the bounds [1/b, b]; any other
  threshold is listed as not judged here (the dataset suite's expectations are the verdict);
- which flagged rows stand behind a figure (:meth:`OffPolicyFigures.rows_for` with
  :func:`reason_of_figure`: the reason the gate gives each row), and why each sampled token is
  coloured (:func:`token_flags`: a ratio outside the bounds, a NaN logprob, a version more than
  the staleness threshold behind the planned one, no kept set where one was due).

Token text and rollout ids are model and user output: kept as strings, escaped by the templates;
a row's page anchor is its place in the gate's list, never its own text.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

RATIO_BASES = ("kept_set", "full_vocab")
RATIO_STATS = ("token_mean", "token_p01", "token_p50", "token_p99", "sequence_mean", "geometric_mean")
# The reason a flagged row carries for each figure that can flag it (the gate's reason strings).
NAN, MISSING_MASK, STALE, RATIO = "nan_logprob", "missing_mask", "stale_tokens", "ratio_outside_bounds"
THRESHOLD_PREFIXES = ("off_policy_", "offpolicy_", "gate_")
RATIO_BOUNDS = "ratio_bounds"  # the figure of a ``…ratio_bound`` threshold: it sets the bounds, nothing crosses it
# Other names a threshold may give a figure of :meth:`OffPolicyFigures.figures`.
FIGURE_ALIASES = {
    "staleness": "staleness_max",
    "versions_behind": "staleness_max",
    "stale_versions": "staleness_max",
    "kept_mass": "kept_mass_mean",
    "ratio_mean": "kept_set_token_mean",
    "token_ratio_mean": "kept_set_token_mean",
    "kept_set_ratio_mean": "kept_set_token_mean",
    "full_vocab_ratio_mean": "full_vocab_token_mean",
    "ratio_mean_deviation": "kept_set_token_mean_deviation",
    "ratio_deviation": "kept_set_mean_deviation",
}


@dataclass(frozen=True)
class RatioStats:
    """Trainer-over-sampler ratios on one basis (kept set or full vocabulary); a statistic is None when absent."""

    token_mean: float | None = None
    token_p01: float | None = None
    token_p50: float | None = None
    token_p99: float | None = None
    sequence_mean: float | None = None
    geometric_mean: float | None = None

    @classmethod
    def of(cls, raw: object) -> RatioStats | None:
        if not isinstance(raw, Mapping):
            return None
        return cls(**{stat: _float(raw.get(stat)) for stat in RATIO_STATS})


@dataclass(frozen=True)
class PeerShare:
    """The share of tokens and of sequences one peer trainer's default would mask or truncate."""

    name: str
    tokens: float | None
    sequences: float | None


@dataclass(frozen=True)
class Staleness:
    """Weight versions behind the planned one: the most, the mean per token, and tokens per versions behind."""

    max: int | None
    mean: float | None
    tokens_by_versions_behind: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class GateToken:
    """One sampled token of a flagged row: id, text (model output), logprob, ratio, kept-set size, weight version."""

    id: int | None
    text: str
    logprob: float | None
    ratio: float | None
    kept: int | None
    version: int | None


@dataclass(frozen=True)
class FlaggedRow:
    """A row the gate flagged, ``number`` its 1-based place in the gate's list (worst first): its page anchor."""

    number: int
    rollout_id: str
    reasons: tuple[str, ...]
    tokens: tuple[GateToken, ...]

    @property
    def anchor(self) -> str:
        """The ``id`` of the row's token view on the page (never built from the row's own strings)."""
        return f"gate-row-{self.number}"


@dataclass(frozen=True)
class Threshold:
    """A threshold the gate applied: its config name and value, the figure it bounds and whether that breached it.

    ``figure``, ``observed`` and ``breached`` are None when the name does not say which figure it bounds.
    """

    name: str
    value: object
    figure: str | None = None
    bound: str | None = None  # "max" or "min"
    observed: float | None = None
    breached: bool | None = None


@dataclass(frozen=True)
class OffPolicyFigures:
    """The gate's figures (``audit.off_policy``); each is None (or empty) when the gate did not record it."""

    planned_weight_version: int | None = None
    tokens: int | None = None
    sequences: int | None = None
    nan_tokens: int | None = None
    missing_mask_tokens: int | None = None
    kept_mass_mean: float | None = None
    tokens_outside_bound: int | None = None
    sequences_outside_bound: int | None = None
    kept_set: RatioStats | None = None
    full_vocab: RatioStats | None = None
    peers: tuple[PeerShare, ...] = ()
    staleness: Staleness | None = None
    flagged_rows: tuple[FlaggedRow, ...] = ()
    thresholds: tuple[Threshold, ...] = ()

    @classmethod
    def of(cls, raw: object) -> OffPolicyFigures | None:
        """From the audit's ``off_policy`` object; None when there is none."""
        if not isinstance(raw, Mapping):
            return None
        ratios = raw.get("ratios") if isinstance(raw.get("ratios"), Mapping) else {}
        peers = raw.get("peers") if isinstance(raw.get("peers"), Mapping) else {}
        rows = raw.get("flagged_rows") if isinstance(raw.get("flagged_rows"), Sequence) else ()
        figures = cls(
            planned_weight_version=_int(raw.get("planned_weight_version")),
            tokens=_int(raw.get("tokens")),
            sequences=_int(raw.get("sequences")),
            nan_tokens=_int(raw.get("nan_tokens")),
            missing_mask_tokens=_int(raw.get("missing_mask_tokens")),
            kept_mass_mean=_float(raw.get("kept_mass_mean")),
            tokens_outside_bound=_int(raw.get("tokens_outside_bound")),
            sequences_outside_bound=_int(raw.get("sequences_outside_bound")),
            kept_set=RatioStats.of(ratios.get("kept_set")),
            full_vocab=RatioStats.of(ratios.get("full_vocab")),
            peers=tuple(
                PeerShare(str(name), _float(share.get("tokens")), _float(share.get("sequences")))
                for name, share in peers.items()
                if isinstance(share, Mapping)
            ),
            staleness=_staleness(raw.get("staleness")),
            flagged_rows=tuple(
                _flagged_row(number, row)
                for number, row in enumerate((r for r in rows if isinstance(r, Mapping)), start=1)
            ),
        )
        thresholds = raw.get("thresholds") if isinstance(raw.get("thresholds"), Mapping) else {}
        observed = figures.figures()
        judged = tuple(_threshold(str(name), value, observed) for name, value in thresholds.items())
        return dataclasses.replace(figures, thresholds=judged)

    def figures(self) -> dict[str, float | None]:
        """The gate's scalar figures by flat name: ``kept_set_token_mean``, ``staleness_max``, ``outside_rate``…"""
        flat: dict[str, float | None] = {
            "tokens": self.tokens,
            "sequences": self.sequences,
            "nan_tokens": self.nan_tokens,
            "missing_mask_tokens": self.missing_mask_tokens,
            "kept_mass_mean": self.kept_mass_mean,
            "tokens_outside_bound": self.tokens_outside_bound,
            "sequences_outside_bound": self.sequences_outside_bound,
            "outside_rate": _share(self.tokens_outside_bound, self.tokens),
        }
        for basis in RATIO_BASES:
            stats = getattr(self, basis)
            for stat in RATIO_STATS:
                value = getattr(stats, stat) if stats is not None else None
                flat[f"{basis}_{stat}"] = flat[f"{basis}_ratio_{stat}"] = value
            deviations = [_deviation(flat[f"{basis}_{stat}"]) for stat in ("token_mean", "geometric_mean")]
            flat[f"{basis}_token_mean_deviation"], flat[f"{basis}_geometric_mean_deviation"] = deviations
            flat[f"{basis}_mean_deviation"] = max((d for d in deviations if d is not None), default=None)
        if self.staleness is not None:
            flat["staleness_max"], flat["staleness_mean"] = self.staleness.max, self.staleness.mean
        for peer in self.peers:
            flat[f"peer_{peer.name}_tokens"], flat[f"peer_{peer.name}_sequences"] = peer.tokens, peer.sequences
            flat[f"{peer.name}_tokens"], flat[f"{peer.name}_sequences"] = peer.tokens, peer.sequences
        return flat

    def rows_for(self, reason: str) -> tuple[FlaggedRow, ...]:
        """The flagged rows that carry ``reason``, worst first."""
        return tuple(row for row in self.flagged_rows if reason in row.reasons)

    @property
    def reasons(self) -> tuple[str, ...]:
        """Every reason some flagged row carries, in the order first met."""
        return tuple(dict.fromkeys(reason for row in self.flagged_rows for reason in row.reasons))

    @property
    def breached(self) -> tuple[Threshold, ...]:
        return tuple(t for t in self.thresholds if t.breached)

    def ratio_bounds(self, fallback: tuple[float | None, float | None]) -> tuple[float | None, float | None]:
        """The bounds a token's ratio is judged against: ``[1 / b, b]`` of the gate's ``…ratio_bound`` threshold
        ``b``, else ``fallback`` (the audit's clip range)."""
        for threshold in self.thresholds:
            bound = _float(threshold.value)
            if threshold.figure == RATIO_BOUNDS and bound is not None and math.isfinite(bound) and bound > 1:
                return (1 / bound, bound)
        return fallback

    @property
    def stale_after(self) -> int:
        """A token more weight versions behind the planned one than this is stale: the gate's staleness threshold,
        else 0."""
        for threshold in self.thresholds:
            limit = _int(threshold.value)
            if threshold.figure == "staleness_max" and threshold.bound == "max" and limit is not None:
                return limit
        return 0


def reason_of_figure(figure: str | None) -> str | None:
    """The flagged-row reason behind a flat figure name (None: no row is flagged for it)."""
    if figure is None:
        return None
    if figure in (RATIO_BOUNDS, "outside_rate"):
        return RATIO
    if figure == "nan_tokens":
        return NAN
    if figure == "missing_mask_tokens":
        return MISSING_MASK
    if figure.startswith("staleness"):
        return STALE
    if figure.startswith(RATIO_BASES) or figure == "kept_mass_mean" or figure.endswith(("_tokens", "_sequences")):
        return None if figure in ("tokens", "sequences") else RATIO
    return None


def token_flags(
    token: GateToken,
    *,
    bounds: tuple[float | None, float | None],
    planned: int | None,
    mask_expected: bool,
    stale_after: int = 0,
) -> tuple[str, ...]:
    """Why a token is coloured: ``nan`` (logprob NaN or absent), ``ratio-out`` (outside ``bounds``), ``no-ratio``
    (none computed), ``stale`` (more than ``stale_after`` versions behind ``planned``), ``no-mask`` (no kept set
    where one was due).
    """
    flags = []
    if token.logprob is None or not math.isfinite(token.logprob):
        flags.append("nan")
    low, high = bounds
    if token.ratio is None:
        flags.append("no-ratio")
    elif (
        not math.isfinite(token.ratio)
        or (low is not None and token.ratio < low)
        or (high is not None and token.ratio > high)
    ):
        flags.append("ratio-out")
    if planned is not None and token.version is not None and planned - token.version > stale_after:
        flags.append("stale")
    if mask_expected and token.kept is None:
        flags.append("no-mask")
    return tuple(flags)


def _threshold(name: str, value: object, observed: Mapping[str, float | None]) -> Threshold:
    """The threshold ``name`` judged against the figure its name bounds (see the module docstring)."""
    key = _unprefixed(name.lower())
    if key.endswith("ratio_bound"):  # not a line a figure crosses: the bounds [1 / b, b] of a token's ratio
        return Threshold(name, value, RATIO_BOUNDS)
    candidates = []
    for bound in ("max", "min"):
        if key.startswith(f"{bound}_"):
            candidates.append((bound, _unprefixed(key.removeprefix(f"{bound}_"))))
        if key.endswith(f"_{bound}"):
            candidates.append((bound, _unprefixed(key.removesuffix(f"_{bound}"))))
    for bound, named in candidates:
        figure = FIGURE_ALIASES.get(named, named)
        if figure not in observed:
            continue
        seen, limit = observed[figure], _float(value)
        if seen is None or limit is None or math.isnan(seen):
            return Threshold(name, value, figure, bound, seen)
        return Threshold(name, value, figure, bound, seen, seen > limit if bound == "max" else seen < limit)
    return Threshold(name, value)


def _unprefixed(name: str) -> str:
    for prefix in THRESHOLD_PREFIXES:
        name = name.removeprefix(prefix)
    return name


def _staleness(raw: object) -> Staleness | None:
    if not isinstance(raw, Mapping):
        return None
    by_behind = raw.get("tokens_by_versions_behind")
    counts = []
    for behind, count in by_behind.items() if isinstance(by_behind, Mapping) else ():
        behind_n, count_n = _int(behind), _int(count)
        if behind_n is not None and count_n is not None:
            counts.append((behind_n, count_n))
    return Staleness(_int(raw.get("max")), _float(raw.get("mean")), tuple(sorted(counts)))


def _flagged_row(number: int, raw: Mapping[str, Any]) -> FlaggedRow:
    reasons = raw.get("reasons")
    tokens = raw.get("tokens")
    return FlaggedRow(
        number=number,
        rollout_id=str(raw.get("rollout_id", "")),
        reasons=tuple(str(r) for r in reasons)
        if isinstance(reasons, Sequence) and not isinstance(reasons, str)
        else (),
        tokens=tuple(
            GateToken(
                id=_int(t.get("id")),
                text=str(t.get("text", "")),
                logprob=_float(t.get("logprob")),
                ratio=_float(t.get("ratio")),
                kept=_int(t.get("kept")),
                version=_int(t.get("version")),
            )
            for t in (tokens if isinstance(tokens, Sequence) and not isinstance(tokens, str) else ())
            if isinstance(t, Mapping)
        ),
    )


def _deviation(value: float | None) -> float | None:
    return abs(value - 1) if value is not None else None


def _share(part: int | None, whole: int | None) -> float | None:
    return part / whole if part is not None and whole else None


def _float(value: object) -> float | None:
    """A JSON number as a float (NaN kept); anything else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int(value: object) -> int | None:
    """A JSON integer (or a string of one, as object keys are); anything else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None
