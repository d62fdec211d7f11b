"""Trainer side: torch access to a published GRPO dataset, a map-style Dataset and a right-padding collator.

:class:`PublishedDataset` reads only the parts a batch's ``dataset/_COMMITTED.json`` names,
checking each part's size, sha256 and schema (a part of an older schema version read as the current
one, :func:`~tasks.records.dataset_row.upgrade_rows`), and keeps the columns as flat numpy arrays (no
per-row Python objects). :class:`GrpoCollator` pads a list of rows — from this Dataset or from
Hugging Face ``datasets`` (lists of numbers) — into a batch where every per-token tensor has
the same shape and padding never counts: ``attention_mask``, ``loss_mask`` and ``train_mask``
are 0 on padding, and ``train_mask`` is also 0 on every token of a masked row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from tasks.records.dataset_row import DatasetRow, upgrade_rows
from tasks.storage.dataset_manifest import read_dataset_marker, read_dataset_part
from tasks.storage.objects import ObjectStore
from tasks.storage.options import StorageOptions

TOKEN_COLUMNS = ("input_ids", "loss_mask", "logprobs")
ROW_COLUMNS = ("advantage", "sample_mask", "prompt_len")


class PublishedDataset(torch.utils.data.Dataset):
    """Rows of a GRPO dataset; item ``i`` is a dict of tensors plus its ``rollout_id`` and ``group_id``."""

    def __init__(self, table: pa.Table) -> None:
        table = upgrade_rows(table)
        DatasetRow.check_table(table)
        self._tokens: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name in TOKEN_COLUMNS:
            cells = table.column(name).combine_chunks()
            offsets = cells.offsets.to_numpy()
            self._tokens[name] = (cells.values.to_numpy(zero_copy_only=False), offsets)
        self._scalars = {name: table.column(name).to_numpy() for name in ROW_COLUMNS}
        self._ids = {name: table.column(name).to_pylist() for name in ("rollout_id", "group_id")}
        self._len = table.num_rows

    @classmethod
    def from_url(cls, batch_url: str, *, storage_options: StorageOptions | None = None) -> Self:
        """The dataset the batch at ``batch_url`` committed (fsspec ``storage_options``); FileNotFoundError if none."""
        store = ObjectStore(batch_url, **dict(storage_options or {}))
        marker = read_dataset_marker(store)
        if marker is None:
            raise FileNotFoundError(f"{batch_url} has no committed dataset (no dataset/_COMMITTED.json)")
        return cls(pa.concat_tables([read_dataset_part(store, part) for part in marker.parts]))

    @classmethod
    def from_files(cls, paths: Sequence[str]) -> Self:
        """Rows of local Parquet parts, unchecked against any marker (for files copied elsewhere)."""
        tables = [upgrade_rows(pq.read_table(p)) for p in paths]
        for path, table in zip(paths, tables, strict=True):
            DatasetRow.check_table(table, source=str(path))
        return cls(pa.concat_tables(tables) if tables else DatasetRow.to_table([]))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -self._len <= index < self._len:
            raise IndexError(f"row {index} is out of range for {self._len} rows")
        index %= self._len
        item: dict[str, Any] = {}
        for name, (values, offsets) in self._tokens.items():
            item[name] = torch.tensor(values[offsets[index] : offsets[index + 1]])
        for name, values in self._scalars.items():
            item[name] = torch.tensor(values[index])
        for name, values in self._ids.items():
            item[name] = values[index]
        return item


@dataclass(frozen=True)
class GrpoCollator:
    """Right-pads rows into a batch of shape ``(B, T)``, ``T`` the longest row (rounded up to ``pad_to_multiple_of``).

    Returns ``input_ids`` (int64, ``pad_token_id`` on padding), ``attention_mask`` (int64),
    ``loss_mask`` (float32, 1 on sampled tokens), ``logprobs`` (float32), ``advantages``
    (float32: the row's advantage on its sampled tokens, else 0), ``train_mask`` (float32:
    ``loss_mask`` × ``sample_mask``), per row ``advantage`` and ``sample_mask`` (float32), and
    the ``rollout_id`` list.
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        lengths = [len(row["input_ids"]) for row in rows]
        width = max(lengths, default=0)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        shape = (len(rows), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros(shape, dtype=torch.int64)
        loss_mask = torch.zeros(shape, dtype=torch.float32)
        logprobs = torch.zeros(shape, dtype=torch.float32)
        for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
            input_ids[i, :length] = torch.as_tensor(row["input_ids"], dtype=torch.int64)
            attention_mask[i, :length] = 1
            loss_mask[i, :length] = torch.as_tensor(row["loss_mask"], dtype=torch.float32)
            logprobs[i, :length] = torch.as_tensor(row["logprobs"], dtype=torch.float32)
        advantage = torch.tensor([float(row["advantage"]) for row in rows], dtype=torch.float32)
        sample_mask = torch.tensor([float(row["sample_mask"]) for row in rows], dtype=torch.float32)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "logprobs": logprobs,
            "advantages": advantage[:, None] * loss_mask,
            "train_mask": loss_mask * sample_mask[:, None],
            "advantage": advantage,
            "sample_mask": sample_mask,
            "rollout_id": [row["rollout_id"] for row in rows],
        }
