"""TRL: our rows as the output of a ``GRPOTrainer`` ``rollout_func`` (lists per sample, as TRL takes them).

TRL's ``GRPOTrainer._generate`` (``trl/trainer/grpo_trainer.py``) takes from ``rollout_func`` the required
``prompt_ids``, ``completion_ids`` and ``logprobs`` (per completion token, as sampled) and any extra field;
``env_mask`` is read as its tool mask (1 on tokens the model generated, 0 on environment tokens) and every other
extra field reaches the reward functions. How a row maps: ``prompt_ids`` is its first ``prompt_len`` tokens,
``completion_ids`` every token after, so a multi-turn row's later carried (environment) tokens are in the
completion with ``env_mask`` 0.

Advantages: TRL computes them itself from rewards, per group of ``num_generations`` consecutive samples
(``rewards - nanmean(group rewards)``, divided by a std unless ``scale_rewards="none"``). The export hands each
row's advantage over as its reward (extra field ``rollout_ledger_advantage``, read by the reward function
:func:`ledger_advantage`), null for a masked row, so TRL's NaN handling gives it advantage 0 and leaves it out of
its group's mean; since our advantages are centred over a group's trainable rows, TRL's
``advantage - mean`` is the row's advantage. Groups go out whole and in order (each ``group_id``'s rows
consecutive, all of one size: ``num_generations``); a masked row without tokens becomes one pad token after its
group's prompt with ``env_mask`` 0 (a placeholder that trains nothing), and a masked row's ``env_mask`` is 0
throughout.

Settings (``GRPOConfig``, :func:`trl_settings`): ``loss_type="dapo"`` (token mean over the generation batch),
``epsilon`` / ``epsilon_high`` = our clip, ``beta=0``, ``scale_rewards="none"``, ``num_generations`` = the
batch's group size, ``importance_sampling_level="token"``, ``vllm_importance_sampling_correction=True`` with
``vllm_importance_sampling_mode="token_truncate"``, ``vllm_importance_sampling_clip_max`` = our TIS cap and no
``_clip_min``, ``mask_truncated_completions=False``, ``top_entropy_quantile=1.0``, no
``off_policy_mask_threshold`` or ``delta``, one generation per optimizer step (TRL then computes
``old_per_token_logps`` with the model before the update: our proximal policy), reward function
:func:`ledger_advantage` alone with weight 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from tasks.trainer.exporters.rows import ExportRow, export_rows
from tasks.trainer.loss import GrpoLossSettings

ADVANTAGE_FIELD = "rollout_ledger_advantage"


def trl_settings(settings: GrpoLossSettings, *, group_size: int) -> dict[str, Any]:
    """The ``GRPOConfig`` arguments under which TRL's loss over :func:`trl_rollout` is ``grpo_loss``."""
    return {
        "loss_type": "dapo",
        "epsilon": settings.clip_low,
        "epsilon_high": settings.clip_high,
        "beta": 0.0,
        "scale_rewards": "none",
        "num_generations": group_size,
        "importance_sampling_level": "token",
        "use_vllm": True,
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": settings.tis_cap,
        "vllm_importance_sampling_clip_min": None,
        "mask_truncated_completions": False,
        "top_entropy_quantile": 1.0,
        "off_policy_mask_threshold": None,
        "delta": None,
    }


def ledger_advantage(prompts: Any = None, completions: Any = None, **kwargs: Any) -> list[float | None]:
    """A TRL reward function: each sample's exported advantage (None for a masked row: TRL reads it as NaN)."""
    return list(kwargs[ADVANTAGE_FIELD])


def trl_rollout(rows: pa.Table | Iterable[Mapping[str, Any]], *, pad_token_id: int = 0) -> dict[str, list[Any]]:
    """The ``rollout_func`` output of ``rows`` (see the module docstring), with ``rollout_id`` and ``group_id``."""
    every = export_rows(rows)
    groups: dict[str, list[ExportRow]] = {}
    for row in every:
        if groups and row.group_id in groups and row.group_id != next(reversed(groups)):
            raise ValueError(f"group {row.group_id}'s rows are not consecutive: TRL groups consecutive samples")
        groups.setdefault(row.group_id, []).append(row)
    sizes = {len(members) for members in groups.values()}
    if len(sizes) > 1:
        raise ValueError(f"groups of different sizes {sorted(sizes)}: TRL needs num_generations rows per group")
    out: dict[str, list[Any]] = {
        name: [] for name in ("prompt_ids", "completion_ids", "logprobs", "env_mask", ADVANTAGE_FIELD)
    }
    out["rollout_id"], out["group_id"] = [], []
    for group_id, members in groups.items():
        prompt = next((r.input_ids[: r.prompt_len].tolist() for r in members if r.has_tokens), None)
        if prompt is None:
            continue  # no row of the group has tokens: nothing of it can train
        for row in members:
            if row.has_tokens:
                p = row.prompt_len
                out["prompt_ids"].append(row.input_ids[:p].tolist())
                out["completion_ids"].append(row.input_ids[p:].tolist())
                out["logprobs"].append(row.logprobs[p:].astype(float).tolist())
                out["env_mask"].append(row.train_mask[p:].tolist())
            else:  # a placeholder: one pad token that no mask lets train
                out["prompt_ids"].append(list(prompt))
                out["completion_ids"].append([pad_token_id])
                out["logprobs"].append([0.0])
                out["env_mask"].append([0])
            out[ADVANTAGE_FIELD].append(row.advantage if row.sample_mask else None)
            out["rollout_id"].append(row.rollout_id)
            out["group_id"].append(group_id)
    return out
