"""Logprob audit: recompute the stored logprobs of sampled tokens with the HF model and compare.

The staged logprobs are vLLM's ``processed_logprobs``: the log-probability of the sampled token
under the distribution it was drawn from. vLLM (v1 sampler, this version) builds that
distribution from the fp32 logits in this order: divide by the temperature; keep the logits
``>=`` the k-th largest (top-k); sort the survivors ascending and mask every token whose
inclusive cumulative probability is ``<= 1 - top_p``, never the largest (top-p); log-softmax
over what is left (masked tokens are ``-inf``). A temperature below ``1e-5`` is greedy
sampling: vLLM then returns the log-softmax of the raw logits. :func:`processed_log_softmax`
is that processing; :func:`audit_logprobs` runs a seeded sample of dataset rows through the
model (fp32, CPU, bounded right-padded batches) and reports how far the stored logprobs are
from the recomputed ones, and the importance ratios a trainer would apply.

The same pass feeds the off-policy gate (:mod:`tasks.finalize.off_policy`, the report's
``off_policy``): the trainer's logprob of each audited token over the whole vocabulary and over
its recorded kept set (:mod:`tasks.models.logprobs`, the trainer's own definitions), at the
sampling the row records (a row without recorded sampling is read with the batch's). There a
NaN stored logprob, or a truncating row without its kept sets, is counted, never raised.

Invariants: the sample depends only on the rows' loss masks, ``sample_size`` and ``seed``;
position ``t`` is scored from the logits at ``t - 1``; a sampled token the recompute filters
out (``-inf``) is counted in ``filtered_out_tokens`` and left out of every average and ratio
(so is a token whose stored logprob is not finite: the off-policy gate counts it in ``nan_tokens``).
Ratios are trainer over rollout, ``exp(recomputed - stored)``: the truncated-IS weight.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tasks.finalize.off_policy import OffPolicyThresholds, ScoredRow, off_policy_figures
from tasks.sampling import GREEDY_TEMPERATURE, truncates

DEFAULT_CLIP = (0.5, 2.0)
DEFAULT_BATCH_TOKENS = 2048
_PROCESS_CHUNK = 256  # positions processed (sorted over the vocab) at once
# The audit's time on 2 idle CPU cores, for its headline, measured with the bundled model (135M parameters, fp32 weights
# of this many bytes): importing torch and transformers, then, in proportion to the model's weights, loading it and
# its forward passes at about this many tokens a second.
AUDIT_IMPORT_SECONDS = 3.5
AUDIT_LOAD_SECONDS = 1.0
AUDIT_TOKENS_PER_SECOND = 550.0
AUDIT_MEASURED_WEIGHT_BYTES = 538_090_408


class SamplingLike(Protocol):
    temperature: float
    top_p: float
    top_k: int


class AuditRowError(ValueError):
    """A row cannot be audited; ``.reason`` is stable, the message names the row."""

    def __init__(self, row: str, reason: str, detail: str) -> None:
        super().__init__(f"{row}: {reason}: {detail}")
        self.row = row
        self.reason = reason


@dataclass(frozen=True)
class AuditReport:
    """What the audit measured. Statistics are None when no token could be compared."""

    model_path: str
    temperature: float
    top_p: float
    top_k: int
    sample_size: int
    seed: int
    rows_eligible: int  # rows with at least one sampled token
    rows_audited: int
    tokens_audited: int  # sampled tokens scored, filtered-out ones included
    filtered_out_tokens: int  # recomputed processed logprob is -inf: vLLM sampled what the recompute filters
    mean_abs_diff: float | None
    max_abs_diff: float | None
    p99_abs_diff: float | None
    raw_mean_abs_diff: float | None  # stored vs unprocessed (temperature 1, no filtering) logprobs
    clip_low: float
    clip_high: float
    token_ratio_mean: float | None
    token_ratio_min: float | None
    token_ratio_max: float | None
    tokens_outside_clip: int
    token_outside_clip_fraction: float | None
    seq_log_ratio_mean: float | None
    seq_ratio_mean: float | None
    seq_ratio_min: float | None
    seq_ratio_max: float | None
    sequences_outside_clip: int
    seq_outside_clip_fraction: float | None
    off_policy: dict[str, Any] | None = None  # the off-policy gate (tasks.finalize.off_policy), JSON-ready

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; a ratio that overflows float64 (not finite) becomes None."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def processed_log_softmax(logits: Any, *, temperature: float, top_k: int, top_p: float) -> Any:
    """Log-probabilities ``[N, V]`` of the distribution vLLM samples from, given fp32 logits ``[N, V]``.

    Temperature, then top-k (``top_k <= 0`` or ``>= V`` is off), then top-p (``1.0`` is off),
    then log-softmax; filtered tokens get ``-inf``. Scalars are float32 as in vLLM's tensors.
    """
    import torch

    logits = logits.to(torch.float32)
    if temperature < GREEDY_TEMPERATURE:
        return logits.log_softmax(dim=-1)
    logits = logits / torch.tensor(temperature, dtype=torch.float32)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth_largest = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    if top_p < 1.0:
        ascending, order = logits.sort(dim=-1, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - torch.tensor(top_p, dtype=torch.float32)
        drop[:, -1] = False  # the most likely token always survives
        logits = logits.scatter(-1, order, ascending.masked_fill(drop, -math.inf))
    return logits.log_softmax(dim=-1)


def sample_rows(rows: Sequence[Any], sample_size: int, seed: int) -> tuple[list[int], int]:
    """Indices (ascending) of a seeded sample among rows with a sampled token, and how many had one."""
    eligible = [i for i, row in enumerate(rows) if np.any(np.asarray(_get(row, "loss_mask", f"row {i}")) == 1)]
    if len(eligible) <= sample_size:
        return eligible, len(eligible)
    picked = np.random.default_rng(seed).choice(len(eligible), size=sample_size, replace=False)
    return sorted(eligible[i] for i in picked), len(eligible)


def audit_logprobs(
    rows: Sequence[Mapping[str, Any] | Any],
    *,
    model_path: str,
    sampling: SamplingLike,
    sample_size: int = 32,
    seed: int = 0,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    clip: tuple[float, float] = DEFAULT_CLIP,
    planned_weight_version: int = 0,
    thresholds: OffPolicyThresholds | None = None,
) -> AuditReport:
    """Recompute the processed logprobs of a seeded sample of ``rows`` and compare with the stored ones.

    A row is a mapping or an object with ``input_ids``, ``loss_mask`` (1 = sampled) and ``logprobs``
    (stored, read where the mask is 1); optionally (dataset schema 3) ``temperature``, ``top_p``,
    ``top_k`` (else ``sampling``'s), ``kept_counts`` / ``kept_token_ids`` (its sampling mask) and
    ``weight_version_spans`` (else every token is of ``planned_weight_version``). The model runs on
    CPU in fp32, at most ``batch_tokens`` padded tokens per forward pass (a longer row runs alone).
    The report's ``off_policy`` applies ``thresholds`` (the defaults when None).
    """
    if sample_size < 1:
        raise ValueError(f"sample_size must be >= 1, got {sample_size!r}")
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens!r}")
    if not 0 < clip[0] < 1 < clip[1]:
        raise ValueError(f"clip must be (low, high) with 0 < low < 1 < high, got {clip!r}")
    picked, eligible = sample_rows(rows, sample_size, seed)
    audited = [_AuditRow.read(rows[i], i, sampling, planned_weight_version) for i in picked]
    if audited:
        print(audit_headline(audited, model_path), file=sys.stderr, flush=True)
    scores = _score(audited, model_path, batch_tokens)
    report = _report(
        audited,
        scores,
        model_path=str(model_path),
        sampling=sampling,
        sample_size=sample_size,
        seed=seed,
        eligible=eligible,
        clip=clip,
    )
    off_policy = off_policy_figures(
        [
            ScoredRow(
                raw_logprobs=_mismatched(row, full, kept) and _matches(row.stored, raw),
                sampled_temperature=fitted,
                rollout_id=row.rollout_id,
                token_ids=row.input_ids[row.positions],
                stored=row.stored,
                full_vocab=full,
                kept_set=kept,
                kept_counts=row.kept_counts,
                versions=row.versions,
                missing_mask=row.missing_mask,
            )
            for row, raw, full, kept, fitted in zip(
                audited, scores.raw, scores.full_vocab, scores.kept_set, scores.sampled_temperature, strict=True
            )
        ],
        planned_weight_version=planned_weight_version,
        thresholds=thresholds or OffPolicyThresholds(),
        text=_token_text(model_path) if audited else lambda token: "",
    )
    return dataclasses.replace(report, off_policy=off_policy)


def _token_text(model_path: str) -> Callable[[int], str]:
    """Each token id's text by the model's tokenizer ("" without one: the gate's token view then shows ids)."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError):
        return lambda token: ""
    return lambda token: tokenizer.decode([token])


def audit_headline(audited: Sequence[_AuditRow], model_path: str) -> str:
    """The line said before the audit: what it recomputes, with which model, and about how long (the measured time
    scaled by the rows' tokens and the model's weights)."""
    from tasks.models.bundled import weight_files

    tokens = sum(row.input_ids.size for row in audited)
    sampled = sum(row.positions.size for row in audited)
    weights = sum(path.stat().st_size for path in weight_files(Path(model_path)))
    scale = weights / AUDIT_MEASURED_WEIGHT_BYTES
    seconds = AUDIT_IMPORT_SECONDS + scale * (AUDIT_LOAD_SECONDS + tokens / AUDIT_TOKENS_PER_SECOND)
    return (
        f"logprob audit: recomputing the logprobs of {sampled} sampled tokens in {len(audited)} rows ({tokens} tokens) "
        f"with the model in {model_path} on CPU, about {_rounded(seconds)} s on 2 CPU cores (--no-audit skips it)"
    )


def _rounded(seconds: float) -> int:
    """Seconds as an estimate is said: to 5 s, or 10 s above a minute."""
    step = 10 if seconds > 60 else 5
    return max(step, int(round(seconds / step) * step))


@dataclass(frozen=True)
class _RowSampling:
    """The sampling a row's tokens were drawn with (``SamplingLike``)."""

    temperature: float
    top_p: float
    top_k: int


@dataclass(frozen=True)
class _AuditRow:
    label: str
    rollout_id: str
    input_ids: np.ndarray  # int64
    positions: np.ndarray  # sampled positions t (all >= 1)
    stored: np.ndarray  # float64 stored logprobs at ``positions`` (may hold NaN: the gate counts it)
    sampling: _RowSampling
    kept_counts: np.ndarray | None  # per sampled token; None when not truncating or missing
    kept_token_ids: np.ndarray | None
    missing_mask: bool  # the row truncates but its kept sets do not cover its sampled tokens
    versions: np.ndarray  # weight version per sampled token

    @classmethod
    def read(cls, row: Any, index: int, batch_sampling: SamplingLike, planned_version: int) -> _AuditRow:
        rollout_id = _get(row, "rollout_id", f"row {index}", default=None)
        label = f"row {index}" + (f" (rollout {rollout_id})" if rollout_id else "")
        ids = np.asarray(_get(row, "input_ids", label), dtype=np.int64)
        mask = np.asarray(_get(row, "loss_mask", label))
        logprobs = np.asarray(_get(row, "logprobs", label), dtype=np.float64)
        if not ids.shape == mask.shape == logprobs.shape or ids.ndim != 1:
            raise AuditRowError(
                label, "length_mismatch", f"input_ids {ids.shape}, loss_mask {mask.shape}, logprobs {logprobs.shape}"
            )
        positions = np.flatnonzero(mask == 1)
        if positions[0] == 0:
            raise AuditRowError(label, "sampled_token_without_context", "loss_mask[0] is 1: no logits predict it")
        sampling = _row_sampling(row, label, batch_sampling)
        counts = _int_array(_get(row, "kept_counts", label, default=None))
        kept_ids = _int_array(_get(row, "kept_token_ids", label, default=None))
        truncating = truncates(sampling.temperature, sampling.top_p, sampling.top_k)
        covered = counts.size == positions.size and int(counts.sum()) == kept_ids.size and (counts >= 1).all()
        return cls(
            label=label,
            rollout_id=str(rollout_id) if rollout_id else label,
            input_ids=ids,
            positions=positions,
            stored=logprobs[positions],
            sampling=sampling,
            kept_counts=counts if truncating and covered else None,
            kept_token_ids=kept_ids if truncating and covered else None,
            missing_mask=truncating and not covered,
            versions=_token_versions(row, label, positions, planned_version),
        )


def _int_array(values: Any) -> np.ndarray:
    return np.zeros(0, np.int64) if values is None else np.asarray(values, dtype=np.int64).reshape(-1)


def _row_sampling(row: Any, label: str, batch: SamplingLike) -> _RowSampling:
    """The row's recorded sampling (dataset schema 3), else the batch's."""
    temperature = _get(row, "temperature", label, default=None)
    if temperature is None:
        return _RowSampling(float(batch.temperature), float(batch.top_p), int(batch.top_k))
    return _RowSampling(float(temperature), float(_get(row, "top_p", label)), int(_get(row, "top_k", label)))


def _token_versions(row: Any, label: str, positions: np.ndarray, planned: int) -> np.ndarray:
    """The weight version of each sampled position, from the row's ``weight_version_spans`` (each span's call
    covers its tokens up to the next span's start); ``planned`` for a row without spans."""
    spans = _get(row, "weight_version_spans", label, default=None)
    spans = () if spans is None else spans
    versions = np.full(positions.size, int(planned), dtype=np.int64)
    ordered = sorted((_span_field(s, "start"), _span_field(s, "weight_version")) for s in spans)
    for start, version in ordered:
        versions[positions >= start] = version
    return versions


def _span_field(span: Any, name: str) -> int:
    return int(span[name] if isinstance(span, Mapping) else getattr(span, name))


@dataclass(frozen=True)
class _Scores:
    processed: list[np.ndarray]  # per audited row, float64 at its positions (-inf = filtered out)
    raw: list[np.ndarray]
    full_vocab: list[np.ndarray]  # the trainer's logprob over the whole vocabulary (tasks.models.logprobs)
    kept_set: list[np.ndarray | None]  # ... over the recorded kept set; None when the row's mask is missing
    sampled_temperature: list[float | None]  # the temperature that explains a mismatched row (_fitted_temperature)


def _score(audited: list[_AuditRow], model_path: str, batch_tokens: int) -> _Scores:
    import torch
    from transformers import AutoModelForCausalLM

    if not audited:
        return _Scores([], [], [], [], [])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True)
    model.eval()
    scored: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = {}
    with torch.inference_mode():
        for batch in _batches([row.input_ids.size for row in audited], batch_tokens):
            rows = [audited[i] for i in batch]
            # Only the positions some row of the batch is scored from are projected to the vocabulary.
            keep = np.unique(np.concatenate([row.positions - 1 for row in rows]))
            logits = _forward(model, rows, keep)
            column = np.searchsorted(keep, np.arange(keep[-1] + 1))
            for slot, (i, row) in enumerate(zip(batch, rows, strict=True)):
                row_logits = logits[slot, torch.from_numpy(column[row.positions - 1])]
                scored[i] = (*_token_logprobs(row_logits, row), None)
                if _mismatched(row, *scored[i][2:4]) and not _matches(row.stored, scored[i][1]):
                    scored[i] = (*scored[i][:4], _fitted_temperature(row_logits, row))
    return _Scores(*([scored[i][k] for i in range(len(audited))] for k in range(5)))


DIAGNOSIS_TOLERANCE = 1e-2  # mean |stored - recomputed| under which a recompute explains the stored logprobs
TEMPERATURE_GRID = tuple(round(0.05 * i, 2) for i in range(1, 41))  # 0.05 .. 2.0


def _matches(stored: np.ndarray, recomputed: np.ndarray | None) -> bool:
    """Whether ``recomputed`` explains the finite stored logprobs (mean |difference| within the tolerance)."""
    if recomputed is None:
        return False
    both = np.isfinite(stored) & np.isfinite(recomputed)
    return bool(both.any()) and float(np.mean(np.abs(stored[both] - recomputed[both]))) < DIAGNOSIS_TOLERANCE


def _mismatched(row: _AuditRow, full: np.ndarray, kept: np.ndarray | None) -> bool:
    """Whether the row's stored logprobs are not what its recorded sampling gives (worth a diagnosis)."""
    return not _matches(row.stored, kept if kept is not None else full)


def _fitted_temperature(logits: Any, row: _AuditRow) -> float | None:
    """The temperature of :data:`TEMPERATURE_GRID` whose trainer logprobs (over the recorded kept sets, or the
    vocabulary) explain the stored ones, when it is not the recorded one; None when none does."""
    import torch

    from tasks.models.logprobs import full_vocab_logprobs, kept_set_logprobs

    finite = np.isfinite(row.stored)
    if row.missing_mask or not finite.any():
        return None
    tokens = torch.from_numpy(row.input_ids[row.positions])
    counts = row.kept_counts
    starts = np.concatenate([[0], np.cumsum(counts)]) if counts is not None else None
    errors = []
    for temperature in TEMPERATURE_GRID:
        chunks = []
        for start in range(0, tokens.numel(), _PROCESS_CHUNK):  # chunked: a [P, V] temporary per chunk only
            stop = min(start + _PROCESS_CHUNK, tokens.numel())
            if counts is not None and starts is not None and row.kept_token_ids is not None:
                ids = row.kept_token_ids[starts[start] : starts[stop]]
                chunk = kept_set_logprobs(logits[start:stop], tokens[start:stop], temperature, counts[start:stop], ids)
            else:
                chunk = full_vocab_logprobs(logits[start:stop], tokens[start:stop], temperature)
            chunks.append(chunk)
        values = torch.cat(chunks).double().numpy()
        usable = finite & np.isfinite(values)
        errors.append(float(np.mean(np.abs(values[usable] - row.stored[usable]))) if usable.any() else math.inf)
    best = int(np.argmin(errors))
    fitted = TEMPERATURE_GRID[best]
    if errors[best] >= DIAGNOSIS_TOLERANCE or abs(fitted - row.sampling.temperature) < 0.05:
        return None
    return fitted


def _forward(model: Any, rows: list[_AuditRow], keep: np.ndarray) -> Any:
    """Logits ``[B, len(keep), V]`` at positions ``keep`` of the right-padded batch ``rows``."""
    import torch

    width = max(row.input_ids.size for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for slot, row in enumerate(rows):
        ids[slot, : row.input_ids.size] = torch.from_numpy(row.input_ids)
        attention[slot, : row.input_ids.size] = 1
    positions = torch.from_numpy(keep)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return model(input_ids=ids, attention_mask=attention, logits_to_keep=positions).logits
    return model(input_ids=ids, attention_mask=attention).logits[:, positions]


def _token_logprobs(logits: Any, row: _AuditRow) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Processed, raw, full-vocabulary and kept-set logprobs (float64) of the row's sampled tokens under
    ``logits`` ``[N, V]``, chunked over positions; the kept-set ones are the full-vocabulary ones when the row
    does not truncate, None when its mask is missing."""
    import torch

    from tasks.models.logprobs import full_vocab_logprobs, kept_set_logprobs

    sampling = row.sampling
    settings = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
    tokens = torch.from_numpy(row.input_ids[row.positions])
    counts = row.kept_counts
    starts = np.concatenate([[0], np.cumsum(counts)]) if counts is not None else None
    processed, raw, full, kept = [], [], [], []
    for start in range(0, tokens.numel(), _PROCESS_CHUNK):
        stop = min(start + _PROCESS_CHUNK, tokens.numel())
        chunk = logits[start:stop]
        picked = tokens[start:stop]
        processed.append(processed_log_softmax(chunk, **settings).gather(1, picked[:, None])[:, 0])
        raw.append(chunk.log_softmax(dim=-1).gather(1, picked[:, None])[:, 0])
        full.append(full_vocab_logprobs(chunk, picked, sampling.temperature))
        if counts is not None and starts is not None and row.kept_token_ids is not None:
            ids = row.kept_token_ids[starts[start] : starts[stop]]
            kept.append(kept_set_logprobs(chunk, picked, sampling.temperature, counts[start:stop], ids))
    full_vocab = torch.cat(full).double().numpy()
    if counts is not None:
        kept_set: np.ndarray | None = torch.cat(kept).double().numpy()
    else:
        kept_set = None if row.missing_mask else full_vocab
    return torch.cat(processed).double().numpy(), torch.cat(raw).double().numpy(), full_vocab, kept_set


def _batches(lengths: list[int], batch_tokens: int) -> Iterator[list[int]]:
    """Index batches, longest rows first, whose padded size ``len * max_len`` stays within budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * lengths[batch[0]] > batch_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def _report(
    audited: list[_AuditRow],
    scores: _Scores,
    *,
    model_path: str,
    sampling: SamplingLike,
    sample_size: int,
    seed: int,
    eligible: int,
    clip: tuple[float, float],
) -> AuditReport:
    stored = np.concatenate([row.stored for row in audited]) if audited else np.zeros(0)
    processed = np.concatenate(scores.processed) if audited else np.zeros(0)
    raw = np.concatenate(scores.raw) if audited else np.zeros(0)
    kept = np.isfinite(processed) & np.isfinite(stored)
    diff = np.abs(stored[kept] - processed[kept])
    log_ratio = processed[kept] - stored[kept]
    outside = _outside(log_ratio, clip)
    seq_log = np.array(
        [
            np.sum((p - row.stored)[np.isfinite(p) & np.isfinite(row.stored)])
            for row, p in zip(audited, scores.processed, strict=True)
        ]
    )
    seq_outside = _outside(seq_log, clip)
    with np.errstate(over="ignore"):
        token_ratio, seq_ratio = np.exp(log_ratio), np.exp(seq_log)
    return AuditReport(
        model_path=model_path,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k),
        sample_size=sample_size,
        seed=seed,
        rows_eligible=eligible,
        rows_audited=len(audited),
        tokens_audited=int(stored.size),
        filtered_out_tokens=int((~np.isfinite(processed) & np.isfinite(stored)).sum()),
        mean_abs_diff=_stat(np.mean, diff),
        max_abs_diff=_stat(np.max, diff),
        p99_abs_diff=_stat(lambda d: np.percentile(d, 99), diff),
        raw_mean_abs_diff=_stat(np.mean, np.abs(stored[kept] - raw[kept])),
        clip_low=float(clip[0]),
        clip_high=float(clip[1]),
        token_ratio_mean=_stat(np.mean, token_ratio),
        token_ratio_min=_stat(np.min, token_ratio),
        token_ratio_max=_stat(np.max, token_ratio),
        tokens_outside_clip=outside,
        token_outside_clip_fraction=outside / diff.size if diff.size else None,
        seq_log_ratio_mean=_stat(np.mean, seq_log),
        seq_ratio_mean=_stat(np.mean, seq_ratio),
        seq_ratio_min=_stat(np.min, seq_ratio),
        seq_ratio_max=_stat(np.max, seq_ratio),
        sequences_outside_clip=seq_outside,
        seq_outside_clip_fraction=seq_outside / seq_log.size if seq_log.size else None,
    )


def _outside(log_ratio: np.ndarray, clip: tuple[float, float]) -> int:
    return int(((log_ratio < math.log(clip[0])) | (log_ratio > math.log(clip[1]))).sum())


def _stat(fn: Any, values: np.ndarray) -> float | None:
    return float(fn(values)) if values.size else None


_MISSING = object()


def _get(row: Any, name: str, label: str, *, default: Any = _MISSING) -> Any:
    """Field ``name`` of a mapping or an object row."""
    value = row.get(name, default) if isinstance(row, Mapping) else getattr(row, name, default)
    if value is _MISSING:
        raise AuditRowError(label, "missing_field", f"no {name!r}")
    return value
