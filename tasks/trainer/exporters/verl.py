"""verl: our rows as the rollout batch of a ``DataProto`` (its ``batch`` TensorDict's tensors, in a dict).

verl's agent loop (``verl/experimental/agent_loop/agent_loop.py``, ``_postprocess``) hands the trainer, per
sample, a left-padded prompt and a right-padded response: ``prompts`` ``[B, P]``, ``responses`` ``[B, R]``,
``input_ids`` and ``attention_mask`` ``[B, P + R]`` (their concatenation), ``position_ids`` (cumulative
attention, from 0), ``response_mask`` ``[B, R]`` (1 on tokens the model generated, 0 on tool/environment tokens
and padding) and ``rollout_log_probs`` ``[B, R]`` (the sampler's logprob of each response token, 0 elsewhere).

How a row maps: the prompt is the row's first ``prompt_len`` tokens (the root call's carried tokens); the
response is every token after it, so a multi-turn row's later calls' carried (environment) tokens sit inside
the response with ``response_mask`` 0, as verl's multi-turn agent loop marks its tool responses.
``response_mask`` is also 0 on every token of a masked row (``sample_mask`` 0: verl has no per-sample mask);
``advantages`` is the row's advantage on its ``response_mask`` tokens (verl's GRPO advantages are token-level,
``[B, R]``). A row without tokens (a rollout that left none) is left out: it has no prompt and trains nothing.
Given the trainer's step-0 logprobs (``proximal``), ``old_log_probs`` holds them as verl's actor would
recompute them; otherwise verl computes it.

The settings under which verl's loss over these fields is :func:`tasks.trainer.loss.grpo_loss` (checked by
tests/trainer/test_exporters.py against ``compute_policy_loss_vanilla``, ``agg_loss`` and
``compute_rollout_correction_weights`` of verl's ``core_algos.py`` / ``rollout_corr_helper.py``):
:func:`verl_settings` gives them: ``actor.policy_loss.loss_mode=vanilla``, ``actor.loss_agg_mode=token-mean``,
``actor.clip_ratio_low`` / ``clip_ratio_high`` = our clip, ``actor.clip_ratio_c`` large enough never to bind
(our loss has no dual clip), ``algorithm.rollout_correction`` in decoupled mode (``bypass_mode=false``: the
actor recomputes ``old_log_prob``, three policies, ``RolloutCorrectionConfig.decoupled_token_is``) with
``rollout_is=token`` (the default is ``sequence``) and ``rollout_is_threshold`` = our TIS cap, no rejection
sampling (``rollout_rs=null``), no batch normalization of the weights, no KL loss or entropy bonus, and the
advantages taken as exported (the step after ``compute_advantage``; verl's own GRPO estimator would recompute
them from scores).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import torch

from tasks.trainer.exporters.rows import export_rows, proximal_of
from tasks.trainer.loss import GrpoLossSettings

# verl's dual-clip bound for negative advantages; our loss has none, so the export assumes one that never binds
NO_DUAL_CLIP = 1.0e9


def verl_settings(settings: GrpoLossSettings) -> dict[str, Any]:
    """The verl config values (dotted paths) under which its loss over :func:`verl_batch` is ``grpo_loss``."""
    return {
        "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "actor_rollout_ref.actor.clip_ratio_low": settings.clip_low,
        "actor_rollout_ref.actor.clip_ratio_high": settings.clip_high,
        "actor_rollout_ref.actor.clip_ratio_c": NO_DUAL_CLIP,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "algorithm.rollout_correction.bypass_mode": False,  # decoupled: the actor recomputes old_log_prob
        "algorithm.rollout_correction.rollout_is": "token",
        "algorithm.rollout_correction.rollout_is_threshold": settings.tis_cap,
        "algorithm.rollout_correction.rollout_is_batch_normalize": False,
        "algorithm.rollout_correction.rollout_rs": None,
    }


def verl_batch(
    rows: pa.Table | Iterable[Mapping[str, Any]],
    *,
    pad_token_id: int = 0,
    proximal: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """The rollout batch of ``rows`` (see the module docstring); ``rollout_id`` lists the rows exported, in order."""
    every = export_rows(rows)
    trainer = proximal_of(every, proximal)
    kept = [i for i, row in enumerate(every) if row.has_tokens]
    chosen = [every[i] for i in kept]
    width_p = max((row.prompt_len for row in chosen), default=0)
    width_r = max((row.input_ids.size - row.prompt_len for row in chosen), default=0)
    shape_p, shape_r = (len(chosen), width_p), (len(chosen), width_r)
    prompts = torch.full(shape_p, pad_token_id, dtype=torch.int64)
    prompt_attention = torch.zeros(shape_p, dtype=torch.int64)
    responses = torch.full(shape_r, pad_token_id, dtype=torch.int64)
    response_attention = torch.zeros(shape_r, dtype=torch.int64)
    response_mask = torch.zeros(shape_r, dtype=torch.int64)
    rollout_log_probs = torch.zeros(shape_r, dtype=torch.float32)
    old_log_probs = torch.zeros(shape_r, dtype=torch.float32)
    advantages = torch.zeros(shape_r, dtype=torch.float32)
    for b, row in enumerate(chosen):
        p, r = row.prompt_len, row.input_ids.size - row.prompt_len
        prompts[b, width_p - p :] = torch.from_numpy(row.input_ids[:p])  # left padded, as verl's prompts are
        prompt_attention[b, width_p - p :] = 1
        responses[b, :r] = torch.from_numpy(row.input_ids[p:])
        response_attention[b, :r] = 1
        mask = torch.from_numpy(row.train_mask[p:])
        response_mask[b, :r] = mask
        rollout_log_probs[b, :r] = torch.from_numpy(row.logprobs[p:])
        advantages[b, :r] = row.advantage * mask.to(torch.float32)
        if trainer is not None:
            old_log_probs[b, :r] = torch.from_numpy(trainer[kept[b]][p:]).to(torch.float32)
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    batch: dict[str, Any] = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "rollout_log_probs": rollout_log_probs,
        "advantages": advantages,
        "rollout_id": [row.rollout_id for row in chosen],
        "uid": [row.group_id for row in chosen],  # verl's GRPO groups samples by uid
    }
    if trainer is not None:
        batch["old_log_probs"] = old_log_probs
    return batch
