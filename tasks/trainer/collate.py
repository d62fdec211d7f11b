"""Trainer side: torch access to a published GRPO dataset, a map-style Dataset and a right-padding collator.

:class:`PublishedDataset` reads only the parts a batch's ``dataset/_COMMITTED.json`` names,
checking each part's size, sha256 and schema (a part of an older schema version read as the current
one, :func:`~tasks.records.dataset_row.upgrade_rows`), and keeps the columns as flat numpy arrays (no
per-row Python objects). :class:`GrpoCollator` pads a list of rows — from this Dataset or from
Hugging Face ``datasets`` (lists of numbers) — into a batch where every per-token tensor has
the same shape and padding never counts: ``attention_mask``, ``loss_mask`` and ``train_mask``
are 0 on padding, and ``train_mask`` is also 0 on every token of a masked row.

Every row says how its tokens were sampled (``temperature``, ``top_p``, ``top_k``, ``logprobs_mode``)
and, when that truncates (top-p / top-k), each sampled token's kept set: the ids the sampler drew it
from, which a trainer renormalizes over to compute ratios against the sampled logprobs. The
collator lays them out flat for a vectorized gather: ``kept_counts`` ``(B, T)`` at each sampled
position and the ids of all sets in ``(b, t)`` order, with the flat position each id belongs to.
A row of dataset schema 1 or 2 has its sampling not recorded (``sampling_recorded`` False) and no
kept sets; its batch's configured sampling is in the dataset manifest's ``config``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from tasks.records.dataset_row import DatasetRow, upgrade_rows
from tasks.sampling import truncates
from tasks.storage.dataset_manifest import read_dataset_marker, read_dataset_part
from tasks.storage.objects import ObjectStore
from tasks.storage.options import StorageOptions

TOKEN_COLUMNS = ("input_ids", "loss_mask", "logprobs")
KEPT_COLUMNS = ("kept_counts", "kept_token_ids")  # per row: one count per sampled token, then every kept id
ROW_COLUMNS = ("advantage", "sample_mask", "prompt_len")
SAMPLING_COLUMNS = ("temperature", "top_p", "top_k")  # NaN / 0 where not recorded (sampling_recorded False)
TOP_K_NOT_RECORDED = 0  # never a recorded top_k (-1 is off, else positive)


class PublishedDataset(torch.utils.data.Dataset):
    """Rows of a GRPO dataset; item ``i`` is a dict of tensors plus its ``rollout_id``, ``group_id`` and
    ``logprobs_mode`` (None where not recorded).

    Tensors: ``input_ids``, ``loss_mask``, ``logprobs``, ``kept_counts`` (int32, one per sampled token of a
    truncating row, else empty) and ``kept_token_ids`` (int32), scalars ``advantage``, ``sample_mask``,
    ``prompt_len``, ``temperature`` and ``top_p`` (float64, NaN where not recorded), ``top_k`` (int32, -1 off,
    0 where not recorded) and ``sampling_recorded`` (bool).
    """

    def __init__(self, table: pa.Table) -> None:
        table = upgrade_rows(table)
        DatasetRow.check_table(table)
        self._lists: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name in (*TOKEN_COLUMNS, *KEPT_COLUMNS):
            cells = table.column(name).combine_chunks()
            offsets = cells.offsets.to_numpy()
            self._lists[name] = (cells.values.to_numpy(zero_copy_only=False), offsets)
        self._scalars = {name: table.column(name).to_numpy() for name in ROW_COLUMNS}
        recorded = table.column("temperature").is_valid().to_numpy(zero_copy_only=False)
        self._scalars |= {
            "temperature": table.column("temperature").to_numpy(zero_copy_only=False).astype(np.float64),
            "top_p": table.column("top_p").to_numpy(zero_copy_only=False).astype(np.float64),
            "top_k": pc.fill_null(table.column("top_k"), TOP_K_NOT_RECORDED).to_numpy().astype(np.int32),
            "sampling_recorded": recorded,
        }
        self._ids = {name: table.column(name).to_pylist() for name in ("rollout_id", "group_id", "logprobs_mode")}
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
        for name, (values, offsets) in self._lists.items():
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

    The sampling, per row: ``temperature`` and ``top_p`` (float32, NaN where not recorded), ``top_k``
    (int64: -1 off, 0 where not recorded), ``sampling_recorded`` and ``truncates`` (bool: recorded and
    top-p / top-k on, :func:`tasks.sampling.truncates`), the ``logprobs_mode`` list. The sampling mask,
    flat: ``kept_counts`` (int64 ``(B, T)``: the size of the kept set of each sampled token of a
    truncating row, 0 elsewhere), ``kept_starts`` (int64 ``(B, T)``: where that set starts in
    ``kept_token_ids``), ``kept_token_ids`` (int64 ``(N,)``: every set, in ``(b, t)`` order, each
    ascending) and ``kept_positions`` (int64 ``(N,)``: the flat index ``b * T + t`` of the token each id
    is kept for), so ``logits.view(B * T, V)[kept_positions, kept_token_ids]`` gathers every kept logit
    and a segment reduction over ``kept_positions`` renormalizes each token over its set.
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
        kept_counts = torch.zeros(shape, dtype=torch.int64)
        kept_ids = []
        for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
            input_ids[i, :length] = torch.as_tensor(row["input_ids"], dtype=torch.int64)
            attention_mask[i, :length] = 1
            loss_mask[i, :length] = torch.as_tensor(row["loss_mask"], dtype=torch.float32)
            logprobs[i, :length] = torch.as_tensor(row["logprobs"], dtype=torch.float32)
            counts = torch.as_tensor(row.get("kept_counts", ()), dtype=torch.int64)
            if counts.numel():
                sampled = loss_mask[i].nonzero().squeeze(1)
                if sampled.numel() != counts.numel():
                    raise ValueError(
                        f"row {row['rollout_id']}: {counts.numel()} kept sets for {sampled.numel()} sampled tokens"
                    )
                kept_counts[i, sampled] = counts
                kept_ids.append(torch.as_tensor(row["kept_token_ids"], dtype=torch.int64))
        advantage = torch.tensor([float(row["advantage"]) for row in rows], dtype=torch.float32)
        sample_mask = torch.tensor([float(row["sample_mask"]) for row in rows], dtype=torch.float32)
        sampling = _row_sampling(rows)
        flat_counts = kept_counts.flatten()
        kept_token_ids = torch.cat(kept_ids) if kept_ids else torch.zeros(0, dtype=torch.int64)
        if kept_token_ids.numel() != int(flat_counts.sum()):
            raise ValueError(f"{kept_token_ids.numel()} kept ids for kept sets of {int(flat_counts.sum())}")
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
            **sampling,
            "logprobs_mode": [row.get("logprobs_mode") for row in rows],
            "kept_counts": kept_counts,
            "kept_starts": (torch.cumsum(flat_counts, 0) - flat_counts).view(shape),
            "kept_token_ids": kept_token_ids,
            "kept_positions": torch.repeat_interleave(torch.arange(flat_counts.numel()), flat_counts),
        }


def _row_sampling(rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Per row: temperature and top_p (NaN where not recorded), top_k (0 there), sampling_recorded and truncates.

    A row is recorded when it names a temperature (a row from a ``datasets`` part of schema 1 or 2 has no such
    key, one of schema 3 read with nulls holds None or NaN).
    """
    temperature = np.array([_number(row.get("temperature")) for row in rows], np.float64)
    top_p = np.array([_number(row.get("top_p")) for row in rows], np.float64)
    recorded = ~np.isnan(temperature)
    top_k = np.array(
        [int(row["top_k"]) if ok else TOP_K_NOT_RECORDED for row, ok in zip(rows, recorded.tolist(), strict=True)],
        np.int64,
    )
    cut = [
        bool(ok and truncates(t, p, k))
        for ok, t, p, k in zip(recorded.tolist(), temperature.tolist(), top_p.tolist(), top_k.tolist(), strict=True)
    ]
    return {
        "temperature": torch.from_numpy(temperature.astype(np.float32)),
        "top_p": torch.from_numpy(top_p.astype(np.float32)),
        "top_k": torch.from_numpy(top_k),
        "sampling_recorded": torch.from_numpy(recorded),
        "truncates": torch.tensor(cut, dtype=torch.bool),
    }


def _number(value: Any) -> float:
    """A recorded float column's value (a tensor, a numpy or Python number), NaN for None."""
    return float("nan") if value is None else float(value)
