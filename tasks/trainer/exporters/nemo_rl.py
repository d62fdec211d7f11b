"""NeMo RL: our rows as the ``ClippedPGLossDataDict`` its ``ClippedPGLossFn`` reads (a dict of tensors).

NeMo RL keeps a sample's whole sequence in one row (``nemo_rl/algorithms/loss/loss_functions.py``): every
per-token tensor is ``[B, T]`` over ``input_ids``, and the loss reads positions ``1..T-1`` (the logprob of token
``t`` comes from the logits at ``t - 1``). Our rows have the same layout, so a row maps one to one:
``input_ids`` right-padded, ``input_lengths``, ``token_mask`` (our ``loss_mask``: 1 on sampled tokens, 0 on the
prompt, on each later call's carried environment tokens and on padding, as NeMo's message log marks
non-assistant tokens), ``sample_mask`` (ours: NeMo multiplies it in itself), ``generation_logprobs`` (our
stored logprobs, 0 where not sampled) and ``advantages`` (the row's advantage on its sampled tokens).
``prev_logprobs`` (and ``reference_policy_logprobs``, read only with a KL penalty) are the trainer's step-0
logprobs: given as ``proximal`` they are exported, else NeMo's GRPO loop computes them
(``policy.get_logprobs``) before the update. A row without tokens is left out; a row whose first token is
sampled cannot be expressed (NeMo never trains position 0) and is refused.

Settings (``loss_fn`` of the GRPO config, :func:`nemo_rl_settings`): ``token_level_loss: true``,
``ratio_clip_min`` / ``ratio_clip_max`` = our clip, ``ratio_clip_c: null`` (no dual clip),
``use_importance_sampling_correction: true`` with ``truncated_importance_sampling_type: tis``,
``truncated_importance_sampling_ratio`` = our TIS cap and no ``_min``, ``reference_policy_kl_penalty: 0``,
``disable_ppo_ratio`` / ``force_on_policy_ratio`` / ``sequence_level_importance_ratios`` / ``use_cispo``
false, no ``positive_example_nll_weight``; the loss normalized by the global count of trainable tokens
(``global_valid_toks``, as NeMo's data step computes it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import torch

from tasks.trainer.exporters.rows import export_rows, proximal_of
from tasks.trainer.loss import GrpoLossSettings


def nemo_rl_settings(settings: GrpoLossSettings) -> dict[str, Any]:
    """The ``loss_fn`` values of NeMo RL's GRPO config under which ``ClippedPGLossFn`` is ``grpo_loss``."""
    return {
        "reference_policy_kl_penalty": 0.0,
        "ratio_clip_min": settings.clip_low,
        "ratio_clip_max": settings.clip_high,
        "ratio_clip_c": None,
        "disable_ppo_ratio": False,
        "force_on_policy_ratio": False,
        "use_on_policy_kl_approximation": False,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": settings.tis_cap,
        "truncated_importance_sampling_ratio_min": None,
        "token_level_loss": True,
        "sequence_level_importance_ratios": False,
        "use_cispo": False,
        "positive_example_nll_weight": 0.0,
    }


def nemo_rl_data(
    rows: pa.Table | Iterable[Mapping[str, Any]],
    *,
    pad_token_id: int = 0,
    proximal: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """The ``ClippedPGLossDataDict`` of ``rows`` (see the module docstring); ``rollout_id`` lists the rows, in order."""
    every = export_rows(rows)
    trainer = proximal_of(every, proximal)
    kept = [i for i, row in enumerate(every) if row.has_tokens]
    chosen = [every[i] for i in kept]
    for row in chosen:
        if row.loss_mask[0]:
            raise ValueError(f"row {row.rollout_id}: its first token is sampled; NeMo RL never trains position 0")
    width = max((row.input_ids.size for row in chosen), default=0)
    shape = (len(chosen), width)
    data: dict[str, Any] = {
        "input_ids": torch.full(shape, pad_token_id, dtype=torch.int64),
        "input_lengths": torch.tensor([row.input_ids.size for row in chosen], dtype=torch.int64),
        "token_mask": torch.zeros(shape, dtype=torch.float32),
        "sample_mask": torch.tensor([float(row.sample_mask) for row in chosen], dtype=torch.float32),
        "generation_logprobs": torch.zeros(shape, dtype=torch.float32),
        "advantages": torch.zeros(shape, dtype=torch.float32),
    }
    if trainer is not None:
        data["prev_logprobs"] = torch.zeros(shape, dtype=torch.float32)
    for b, row in enumerate(chosen):
        n = row.input_ids.size
        mask = torch.from_numpy(row.loss_mask).to(torch.float32)
        data["input_ids"][b, :n] = torch.from_numpy(row.input_ids)
        data["token_mask"][b, :n] = mask
        data["generation_logprobs"][b, :n] = torch.from_numpy(row.logprobs)
        data["advantages"][b, :n] = row.advantage * mask
        if trainer is not None:
            data["prev_logprobs"][b, :n] = torch.from_numpy(trainer[kept[b]]).to(torch.float32) * mask
    if trainer is not None:
        data["reference_policy_logprobs"] = data["prev_logprobs"].clone()
    data["rollout_id"] = [row.rollout_id for row in chosen]
    return data
