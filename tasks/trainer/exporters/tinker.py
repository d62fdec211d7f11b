"""Tinker: our rows as ``Datum``\\ s for ``forward_backward(..., loss_fn="ppo")``, as plain dicts of tensors.

A Tinker ``Datum`` (docs: tinker-docs.thinkingmachines.ai/tinker/losses) is ``model_input`` (tokens ``0..N-2``
of the sequence) and ``loss_fn_inputs`` over the next-token targets: ``target_tokens`` (tokens ``1..N-1``),
``logprobs`` and ``advantages``, position ``i`` being about token ``i + 1``. Build the real thing with
``tinker.Datum(model_input=tinker.ModelInput.from_ints(d["model_input"].tolist()),
loss_fn_inputs={k: tinker.TensorData.from_torch(v) for k, v in d["loss_fn_inputs"].items()})``.
A multi-turn row is one Datum: its carried tokens (the prompt and each later call's environment tokens) have
advantage 0, so they add nothing to the loss, as the cookbook merges an episode's turns.

Tinker's ``ppo`` loss is ``-sum(min(r·A, clip(r, lo, hi)·A))`` with ``r = exp(target_logprobs - logprobs)``: a
sum over tokens (and over the Datums of a ``forward_backward`` and of the calls accumulated before
``optim_step``), clipped around the ``logprobs`` the Datum carries. Our loss clips around the trainer's step-0
policy, weights each token by ``w = min(exp(proximal - rollout), tis_cap)`` and takes the token mean. The
export folds both in, exactly (``w/N > 0`` passes through ``min`` and ``clip``):

* ``logprobs`` holds the trainer's step-0 logprob of each sampled token (``proximal``: Tinker's own
  ``forward`` of the Datums before the step gives them); without ``proximal`` it holds the sampler's, which is
  our loss only when sampler and trainer agree (w = 1);
* ``advantages`` holds ``A · w / N`` on each sampled token of a trainable row, 0 elsewhere, ``N`` the number of
  such tokens over every exported row: one step's Datums are exactly one export.

Masked rows and rows without tokens are left out (they train nothing). Settings: ``loss_fn="ppo"`` with
``loss_fn_config`` = :func:`tinker_loss_config` (``clip_low_threshold = 1 - clip_low``,
``clip_high_threshold = 1 + clip_high``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tasks.trainer.exporters.rows import export_rows, proximal_of
from tasks.trainer.loss import GrpoLossSettings


def tinker_loss_config(settings: GrpoLossSettings) -> dict[str, float]:
    """The ``loss_fn_config`` of Tinker's ``ppo`` loss for our clip range."""
    return {"clip_low_threshold": 1.0 - settings.clip_low, "clip_high_threshold": 1.0 + settings.clip_high}


def tinker_datums(
    rows: pa.Table | Iterable[Mapping[str, Any]],
    *,
    settings: GrpoLossSettings,
    proximal: Sequence[Any] | None = None,
) -> list[dict[str, Any]]:
    """One Datum per trainable row of ``rows`` (see the module docstring), each with its ``rollout_id``."""
    every = export_rows(rows)
    trainer = proximal_of(every, proximal)
    chosen = [(i, row) for i, row in enumerate(every) if row.has_tokens and row.sample_mask]
    tokens = sum(int(row.train_mask.sum()) for _, row in chosen)
    datums = []
    for i, row in chosen:
        if row.loss_mask[0]:
            raise ValueError(f"row {row.rollout_id}: its first token is sampled; no Datum predicts token 0")
        mask = row.train_mask.astype(bool)
        step0 = trainer[i] if trainer is not None else row.logprobs.astype(np.float64)
        step0 = np.where(mask, step0, 0.0)
        weight = np.minimum(np.exp(step0 - row.logprobs.astype(np.float64)), settings.tis_cap)
        advantages = np.where(mask, row.advantage * weight / max(tokens, 1), 0.0)
        datums.append(
            {
                "model_input": torch.from_numpy(row.input_ids[:-1].copy()),
                "loss_fn_inputs": {
                    "target_tokens": torch.from_numpy(row.input_ids[1:].copy()),
                    "logprobs": torch.from_numpy(step0[1:].astype(np.float32)),
                    "advantages": torch.from_numpy(advantages[1:].astype(np.float32)),
                },
                "rollout_id": row.rollout_id,
            }
        )
    return datums
