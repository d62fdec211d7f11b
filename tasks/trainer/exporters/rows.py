"""The rows an exporter reads, whatever they came as: one shape (:class:`ExportRow`) for every exporter.

A pyarrow table of dataset rows is read through :class:`~tasks.trainer.collate.PublishedDataset` (which checks
the schema and upgrades an older one); its items, or any mappings with the same keys (lists of numbers are
fine), are taken as they are. ``proximal``, where an exporter takes it, is the trainer's own logprob of each
token before the step's first update, one array per row aligned with ``input_ids`` (any value on carried tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tasks.trainer.collate import PublishedDataset


@dataclass(frozen=True)
class ExportRow:
    """One dataset row as the exporters read it (numpy arrays over the row's tokens)."""

    rollout_id: str
    group_id: str
    input_ids: np.ndarray  # int64
    loss_mask: np.ndarray  # int64: 1 sampled, 0 carried
    logprobs: np.ndarray  # float32, 0 where loss_mask is 0
    advantage: float
    sample_mask: int
    prompt_len: int

    @property
    def train_mask(self) -> np.ndarray:
        """1 on the tokens the loss trains on: sampled tokens of a trainable row."""
        return self.loss_mask * self.sample_mask

    @property
    def has_tokens(self) -> bool:
        return self.input_ids.size > 0


def export_rows(rows: pa.Table | Iterable[Mapping[str, Any]]) -> list[ExportRow]:
    """``rows`` as :class:`ExportRow`\\ s, in order."""
    items: Iterable[Mapping[str, Any]] = PublishedDataset(rows) if isinstance(rows, pa.Table) else rows
    return [_row(item) for item in items]


def _row(item: Mapping[str, Any]) -> ExportRow:
    def array(name: str, dtype: type) -> np.ndarray:
        value = item[name]
        value = value.numpy() if hasattr(value, "numpy") else value
        return np.asarray(value, dtype=dtype).reshape(-1)

    row = ExportRow(
        rollout_id=str(item["rollout_id"]),
        group_id=str(item["group_id"]),
        input_ids=array("input_ids", np.int64),
        loss_mask=array("loss_mask", np.int64),
        logprobs=array("logprobs", np.float32),
        advantage=float(item["advantage"]),
        sample_mask=int(item["sample_mask"]),
        prompt_len=int(item["prompt_len"]),
    )
    if not row.input_ids.size == row.loss_mask.size == row.logprobs.size:
        raise ValueError(f"row {row.rollout_id}: input_ids, loss_mask and logprobs differ in length")
    if row.loss_mask[: row.prompt_len].any():
        raise ValueError(f"row {row.rollout_id}: a token of its prompt (the first {row.prompt_len}) is sampled")
    return row


def proximal_of(rows: Sequence[ExportRow], proximal: Sequence[Any] | None) -> list[np.ndarray] | None:
    """The per-row trainer logprobs ``proximal`` (None stays None), each checked against its row's length."""
    if proximal is None:
        return None
    if len(proximal) != len(rows):
        raise ValueError(f"proximal has {len(proximal)} rows, the export {len(rows)}")
    found = []
    for row, value in zip(rows, proximal, strict=True):
        plain = value.detach().cpu().numpy() if hasattr(value, "detach") else value
        array = np.asarray(plain, dtype=np.float64).reshape(-1)
        if array.size != row.input_ids.size:
            raise ValueError(f"row {row.rollout_id}: proximal has {array.size} values, the row {row.input_ids.size}")
        found.append(array)
    return found
