"""Each trainer's own loss over our exported fields is the reference GRPO loss (tasks/trainer/exporters/).

The fixture is a published dataset of four groups of four multi-turn rows (two calls each: carried prompt,
sampled tokens, carried environment tokens, sampled tokens) of different lengths, with a poisoned row (masked,
with tokens), a missing rollout (masked, no tokens) and advantages of both signs. The trainer's step-0 policy
(``proximal``) is the rows' logprobs perturbed so that some truncated IS weights reach the cap, and the policy
being trained (``new``) perturbs that again so that some ratios leave the clip range. Each test reimplements one
trainer's documented loss from its source (cited at each function; facts, not code), reads every input it can
from the exported fields (masks, ids, sampled logprobs, advantages, layout), takes the trainer-side logprobs
(``new``, and the trainer's own recompute of the step-0 ones) from the policy at the positions the exported
layout says, and matches :func:`tasks.trainer.loss.grpo_loss` to 1e-6.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from tasks.finalize.dataset_writer import stage_dataset
from tasks.storage.dataset_manifest import read_dataset_marker, read_dataset_part
from tasks.storage.objects import ObjectStore
from tasks.trainer.collate import PublishedDataset
from tasks.trainer.exporters.nemo_rl import nemo_rl_data, nemo_rl_settings
from tasks.trainer.exporters.tinker import tinker_datums, tinker_loss_config
from tasks.trainer.exporters.trl import ADVANTAGE_FIELD, ledger_advantage, trl_rollout, trl_settings
from tasks.trainer.exporters.verl import verl_batch, verl_settings
from tasks.trainer.loss import GrpoLossSettings, grpo_loss
from tests.finalize.rollouts import batch_config, commit_by_hand, mixed_groups

TOLERANCE = 1e-6
GROUP_SIZE = 4
SEEDS = (0, 1, 2, 3, 4)
# asymmetric clips, so a swapped pair of settings shows
SETTINGS = (GrpoLossSettings(), GrpoLossSettings(clip_low=0.2, clip_high=0.28, tis_cap=1.5))
PAD = 3


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> str:
    """The URL of the batch whose dataset the tests export (committed by hand, as publish commits it)."""
    config = batch_config(num_tasks=4, group_size=GROUP_SIZE)
    store = ObjectStore(str(tmp_path_factory.mktemp("exporters") / "batch"))
    commit_by_hand(store, stage_dataset(store, mixed_groups(config), config=config, rows_per_part=5).marker)
    return store.url


@pytest.fixture(scope="module")
def dataset(published) -> PublishedDataset:
    return PublishedDataset.from_url(published)


def rows_of(dataset: PublishedDataset) -> list[dict]:
    return [dataset[i] for i in range(len(dataset))]


class Policy:
    """The trainer's logprobs of each row's tokens: ``proximal`` (step 0) and ``new``, by rollout id (float64)."""

    def __init__(self, rows: list[dict], seed: int, *, spread: float = 0.3) -> None:
        rng = np.random.default_rng(seed)
        self.proximal: dict[str, np.ndarray] = {}
        self.new: dict[str, np.ndarray] = {}
        for row in rows:
            rollout = row["logprobs"].numpy().astype(np.float64)
            sampled = row["loss_mask"].numpy() == 1
            step0 = np.where(sampled, np.minimum(rollout + rng.normal(0.0, 0.6, rollout.size), -1e-3), 0.0)
            self.proximal[row["rollout_id"]] = step0
            self.new[row["rollout_id"]] = np.where(sampled, step0 + rng.normal(0.0, spread, rollout.size), 0.0)

    def proximal_list(self, rows: list[dict]) -> list[np.ndarray]:
        return [self.proximal[row["rollout_id"]] for row in rows]


def reference(rows: list[dict], policy: Policy, settings: GrpoLossSettings) -> tuple[float, dict[str, float]]:
    """grpo_loss over the rows, padded, in float64; with how much of it the cap and the clip touched."""
    width = max(len(row["input_ids"]) for row in rows)
    shape = (len(rows), width)
    new, proximal, rollout, mask = (torch.zeros(shape, dtype=torch.float64) for _ in range(4))
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        new[i, :n] = torch.from_numpy(policy.new[row["rollout_id"]])
        proximal[i, :n] = torch.from_numpy(policy.proximal[row["rollout_id"]])
        rollout[i, :n] = row["logprobs"].to(torch.float64)
        mask[i, :n] = row["loss_mask"].to(torch.float64) * float(row["sample_mask"])
    advantages = torch.tensor([float(row["advantage"]) for row in rows], dtype=torch.float64)
    out = grpo_loss(new, proximal, rollout, advantages, mask, settings)
    on = mask > 0
    shape_of = {
        "capped": float((out.tis_weight[on] >= settings.tis_cap).double().mean()),
        "clipped": float(((out.ratio[on] - 1).abs() > min(settings.clip_low, settings.clip_high)).double().mean()),
        "negative_rows": float((advantages < 0).sum()),
    }
    return float(out.loss), shape_of


def at(policy_values: dict[str, np.ndarray], rollout_id: str, position: int) -> float:
    return float(policy_values[rollout_id][position])


# ---------------------------------------------------------------- verl
def verl_loss(batch: dict, policy: Policy, settings: GrpoLossSettings, clip_ratio_c: float) -> float:
    """verl's actor loss over a rollout batch.

    verl/trainer/ppo/rollout_corr_helper.py compute_rollout_correction_and_rejection_mask /
    compute_rollout_correction_weights (rollout_is="token"): w = exp(clamp(old - rollout, ±20)) · response_mask,
    truncated at rollout_is_threshold, detached. verl/trainer/ppo/core_algos.py compute_policy_loss_vanilla:
    ratio = exp(clamp(log_prob - old, ±20)); max(-A·ratio, -A·clip(ratio, 1 - low, 1 + high)), then for A < 0 the
    dual clip min(·, -A·clip_ratio_c); times the rollout IS weights; agg_loss("token-mean"):
    masked_sum(loss, response_mask) / response_mask.sum().
    """
    responses = batch["responses"]
    b_size, r_size = responses.shape
    p_size = batch["prompts"].shape[1]
    prompt_lens = batch["attention_mask"][:, :p_size].sum(dim=1)
    response_attention = batch["attention_mask"][:, p_size:]
    log_prob = torch.zeros(b_size, r_size, dtype=torch.float64)
    old_log_prob = torch.zeros(b_size, r_size, dtype=torch.float64)  # the actor's recompute before the update
    for b, rid in enumerate(batch["rollout_id"]):
        for j in range(r_size):
            if response_attention[b, j]:
                t = int(prompt_lens[b]) + j  # the response token's position in the whole sequence
                log_prob[b, j] = at(policy.new, rid, t)
                old_log_prob[b, j] = at(policy.proximal, rid, t)
    mask = batch["response_mask"].to(torch.float64)
    advantages = batch["advantages"].to(torch.float64)
    rollout = batch["rollout_log_probs"].to(torch.float64)
    weights = (torch.exp((old_log_prob - rollout).clamp(-20.0, 20.0)) * mask).clamp(max=settings.tis_cap)
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(-advantages * clip_ratio_c, clipped)
    per_token = torch.where(advantages < 0, dual, clipped) * weights
    return float((per_token * mask).sum() / mask.sum())


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("seed", SEEDS)
def test_verl_token_mean_loss_with_token_rollout_is_matches_the_reference(dataset, seed, settings):
    rows = rows_of(dataset)
    policy = Policy(rows, seed)
    expected, shape = reference(rows, policy, settings)
    assert shape["capped"] > 0 and shape["clipped"] > 0 and shape["negative_rows"] > 0
    batch = verl_batch(dataset, pad_token_id=PAD, proximal=policy.proximal_list(rows))
    config = verl_settings(settings)
    got = verl_loss(batch, policy, settings, config["actor_rollout_ref.actor.clip_ratio_c"])
    assert abs(got - expected) < TOLERANCE, (got, expected)


def test_verl_dual_clip_never_binds_at_the_exported_setting_where_a_ratio_passes_3(dataset):
    rows = rows_of(dataset)
    policy = Policy(rows, 0, spread=1.5)  # ratios far outside the clip range, some above verl's default c = 3
    settings = GrpoLossSettings()
    expected, _ = reference(rows, policy, settings)
    batch = verl_batch(dataset, proximal=policy.proximal_list(rows))
    clip_ratio_c = verl_settings(settings)["actor_rollout_ref.actor.clip_ratio_c"]
    assert abs(verl_loss(batch, policy, settings, clip_ratio_c) - expected) < TOLERANCE
    assert abs(verl_loss(batch, policy, settings, 3.0) - expected) > 1e-3  # verl's default dual clip would bind


def test_verl_batch_layout_left_pads_prompts_and_masks_carried_and_masked_tokens(dataset):
    rows = rows_of(dataset)
    batch = verl_batch(dataset, pad_token_id=PAD, proximal=Policy(rows, 0).proximal_list(rows))
    with_tokens = [row for row in rows if len(row["input_ids"])]
    assert batch["rollout_id"] == [row["rollout_id"] for row in with_tokens]  # the tokenless row is left out
    p_size = batch["prompts"].shape[1]
    for b, row in enumerate(with_tokens):
        p, n = int(row["prompt_len"]), len(row["input_ids"])
        assert batch["prompts"][b, p_size - p :].tolist() == row["input_ids"][:p].tolist()
        assert (batch["prompts"][b, : p_size - p] == PAD).all()
        assert batch["responses"][b, : n - p].tolist() == row["input_ids"][p:].tolist()
        expected_mask = row["loss_mask"][p:] * int(row["sample_mask"])
        assert batch["response_mask"][b, : n - p].tolist() == expected_mask.tolist()
        assert batch["response_mask"][b, n - p :].sum() == 0
        valid = batch["attention_mask"][b].bool()
        assert batch["input_ids"][b, valid].tolist() == row["input_ids"].tolist()
        assert batch["position_ids"][b, valid].tolist() == list(range(n))
    carried_inside = [
        (b, j)
        for b, row in enumerate(with_tokens)
        for j, m in enumerate(row["loss_mask"][int(row["prompt_len"]) :].tolist())
        if m == 0
    ]
    assert carried_inside and all(batch["response_mask"][b, j] == 0 for b, j in carried_inside)


# ---------------------------------------------------------------- NeMo RL
def nemo_rl_loss(data: dict, policy: Policy, config: dict) -> float:
    """NeMo RL's ClippedPGLossFn over a ClippedPGLossDataDict.

    nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossFn.__call__: every tensor read at [:, 1:] (the
    logprob of token t comes from position t - 1); mask = token_mask · sample_mask; ratios = exp(curr - prev),
    clamped to [1 - ratio_clip_min, 1 + ratio_clip_max]; clip_loss = max(-A·r, -A·r_clamped) (no dual clip:
    ratio_clip_c None); token-level actor IS weights exp(prev - generation) (nan_to_num), "tis": clamped to
    [min or 0, truncated_importance_sampling_ratio]; token-level loss masked_mean(w · clip_loss, mask,
    global_normalization_factor=global_valid_toks) = sum(w · clip_loss · mask) / (global_valid_toks + 1e-8);
    no KL (reference_policy_kl_penalty 0). global_valid_toks as nemo_rl/models/automodel/data.py computes it:
    sum(token_mask[:, 1:] · sample_mask).
    """
    assert config["token_level_loss"] and config["ratio_clip_c"] is None and config["reference_policy_kl_penalty"] == 0
    lengths = data["input_lengths"]
    b_size, width = data["input_ids"].shape
    curr = torch.zeros(b_size, width - 1, dtype=torch.float64)  # next_token_logprobs of the policy being trained
    prev = torch.zeros(b_size, width - 1, dtype=torch.float64)  # the trainer's step-0 recompute (policy.get_logprobs)
    for b, rid in enumerate(data["rollout_id"]):
        for t in range(1, int(lengths[b])):
            curr[b, t - 1] = at(policy.new, rid, t)
            prev[b, t - 1] = at(policy.proximal, rid, t)
    token_mask = data["token_mask"][:, 1:].to(torch.float64)
    sample_mask = data["sample_mask"].to(torch.float64)
    advantages = data["advantages"][:, 1:].to(torch.float64)
    generation = data["generation_logprobs"][:, 1:].to(torch.float64)
    mask = token_mask * sample_mask.unsqueeze(-1)
    ratios = (curr - prev).exp()
    clamped = ratios.clamp(1.0 - config["ratio_clip_min"], 1.0 + config["ratio_clip_max"])
    clip_loss = torch.maximum(-advantages * ratios, -advantages * clamped)
    weights = torch.nan_to_num((prev - generation).exp(), nan=0.0, posinf=0.0, neginf=0.0)
    tis_min = config["truncated_importance_sampling_ratio_min"] or 0.0
    weights = weights.clamp(min=tis_min, max=config["truncated_importance_sampling_ratio"])
    global_valid_toks = (data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)).sum().to(torch.float64)
    return float((weights * clip_loss * mask).sum() / (global_valid_toks + 1e-8))


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("seed", SEEDS)
def test_nemo_rl_clipped_pg_loss_with_tis_matches_the_reference(dataset, seed, settings):
    rows = rows_of(dataset)
    policy = Policy(rows, seed)
    expected, _ = reference(rows, policy, settings)
    data = nemo_rl_data(dataset, pad_token_id=PAD, proximal=policy.proximal_list(rows))
    got = nemo_rl_loss(data, policy, nemo_rl_settings(settings))
    assert abs(got - expected) < TOLERANCE, (got, expected)


def test_nemo_rl_data_keeps_masked_rows_with_their_sample_mask_and_the_full_sequence(dataset):
    rows = rows_of(dataset)
    policy = Policy(rows, 0)
    data = nemo_rl_data(rows, pad_token_id=PAD, proximal=policy.proximal_list(rows))
    with_tokens = [row for row in rows if len(row["input_ids"])]
    assert data["rollout_id"] == [row["rollout_id"] for row in with_tokens]
    assert data["sample_mask"].tolist() == [float(row["sample_mask"]) for row in with_tokens]
    assert 0.0 in data["sample_mask"].tolist()
    for b, row in enumerate(with_tokens):
        n = len(row["input_ids"])
        assert data["input_ids"][b, :n].tolist() == row["input_ids"].tolist()
        assert data["token_mask"][b, :n].tolist() == row["loss_mask"].float().tolist()
        assert data["generation_logprobs"][b, :n].tolist() == row["logprobs"].tolist()
        np.testing.assert_allclose(
            data["prev_logprobs"][b, :n].numpy(), policy.proximal[row["rollout_id"]] * row["loss_mask"].numpy(),
            rtol=1e-6, atol=1e-6,
        )  # fmt: skip


# ---------------------------------------------------------------- TRL
def trl_loss(rollout: dict, policy: Policy, config: dict) -> float:
    """TRL GRPOTrainer's loss over a rollout_func output.

    trl/trainer/grpo_trainer.py _generate: rollout_func's prompt_ids / completion_ids / logprobs, extra field
    env_mask taken as the tool mask, other extra fields passed to the reward functions.
    _generate_and_score_completions: prompts left-padded, completions right-padded with completion_mask 1 on
    every completion token, tool_mask padded with 1; rewards (None read as NaN) weighted and summed,
    advantages = rewards - nanmean over each group of num_generations (no division: scale_rewards "none"),
    nan_to_num(0); the vLLM importance sampling ratio ("token_truncate") exp((old - sampling) · mask) clamped to
    [clip_min, clip_max], mask = completion_mask · tool_mask. _compute_loss (importance_sampling_level "token",
    loss_type "dapo"): coef_1 = exp(logps - old), coef_2 = clamp(coef_1, 1 - epsilon, 1 + epsilon_high),
    per_token_loss = -min(coef_1·A, coef_2·A) · importance_sampling_ratio; loss = sum(per_token_loss · mask) /
    num_items_in_batch (the gathered sum of mask: one process).
    """
    assert config["loss_type"] == "dapo" and config["beta"] == 0 and config["scale_rewards"] == "none"
    completions = rollout["completion_ids"]
    b_size, width = len(completions), max(len(c) for c in completions)
    completion_mask = torch.zeros(b_size, width, dtype=torch.float64)
    tool_mask = torch.ones(b_size, width, dtype=torch.float64)
    sampling = torch.zeros(b_size, width, dtype=torch.float64)
    logps = torch.zeros(b_size, width, dtype=torch.float64)
    old = torch.zeros(b_size, width, dtype=torch.float64)  # computed by TRL with the model before the update
    for b, (rid, prompt, completion) in enumerate(
        zip(rollout["rollout_id"], rollout["prompt_ids"], completions, strict=True)
    ):
        n = len(completion)
        completion_mask[b, :n] = 1
        tool_mask[b, :n] = torch.tensor(rollout["env_mask"][b], dtype=torch.float64)
        sampling[b, :n] = torch.tensor(rollout["logprobs"][b], dtype=torch.float64)
        if rid in policy.new and len(policy.new[rid]):
            for j in range(n):
                logps[b, j] = at(policy.new, rid, len(prompt) + j)
                old[b, j] = at(policy.proximal, rid, len(prompt) + j)
    extra = {k: v for k, v in rollout.items() if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
    rewards = torch.tensor(
        [math.nan if r is None else r for r in ledger_advantage(None, None, **extra)], dtype=torch.float64
    )
    grouped = rewards.view(-1, config["num_generations"])
    advantages = torch.nan_to_num(rewards - grouped.nanmean(dim=1).repeat_interleave(config["num_generations"]))
    mask = completion_mask * tool_mask
    is_ratio = torch.exp((old - sampling) * mask).clamp(
        min=config["vllm_importance_sampling_clip_min"], max=config["vllm_importance_sampling_clip_max"]
    )
    coef_1 = torch.exp(logps - old)
    coef_2 = coef_1.clamp(1 - config["epsilon"], 1 + config["epsilon_high"])
    a = advantages.unsqueeze(1)
    per_token_loss = -torch.minimum(coef_1 * a, coef_2 * a) * is_ratio
    return float((per_token_loss * mask).sum() / mask.sum().clamp(min=1.0))


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("seed", SEEDS)
def test_trl_dapo_loss_with_token_truncated_vllm_is_matches_the_reference(dataset, seed, settings):
    rows = rows_of(dataset)
    policy = Policy(rows, seed)
    expected, _ = reference(rows, policy, settings)
    rollout = trl_rollout(dataset, pad_token_id=PAD)
    got = trl_loss(rollout, policy, trl_settings(settings, group_size=GROUP_SIZE))
    assert abs(got - expected) < TOLERANCE, (got, expected)


def test_trl_rollout_keeps_whole_groups_with_a_placeholder_for_a_row_without_tokens(dataset):
    rows = rows_of(dataset)
    rollout = trl_rollout(rows, pad_token_id=PAD)
    assert rollout["rollout_id"] == [row["rollout_id"] for row in rows]
    tokenless = [i for i, row in enumerate(rows) if not len(row["input_ids"])]
    assert tokenless
    for i in tokenless:
        assert rollout["completion_ids"][i] == [PAD] and rollout["env_mask"][i] == [0]
        assert rollout[ADVANTAGE_FIELD][i] is None
    for i, row in enumerate(rows):
        if len(row["input_ids"]):
            p = int(row["prompt_len"])
            assert rollout["prompt_ids"][i] + rollout["completion_ids"][i] == row["input_ids"].tolist()
            assert rollout["env_mask"][i] == (row["loss_mask"][p:] * int(row["sample_mask"])).tolist()
            assert len(rollout["logprobs"][i]) == len(rollout["completion_ids"][i])


# ---------------------------------------------------------------- Tinker
def tinker_loss(datums: list[dict], policy: Policy, loss_fn_config: dict) -> float:
    """Tinker's "ppo" loss, summed over the Datums of one forward_backward.

    tinker-docs.thinkingmachines.ai/tinker/losses/ppo: prob_ratio = exp(target_logprobs - sampling_logprobs)
    (sampling_logprobs: loss_fn_inputs["logprobs"]), clipped_ratio = clamp(prob_ratio, clip_low_threshold,
    clip_high_threshold), loss = -sum(min(prob_ratio · advantages, clipped_ratio · advantages)); position i of
    loss_fn_inputs is about token i + 1 of the sequence (docs: tinker/losses, "next-token alignment").
    """
    total = 0.0
    for datum in datums:
        inputs = datum["loss_fn_inputs"]
        n = len(inputs["target_tokens"])
        target_logprobs = torch.tensor(
            [at(policy.new, datum["rollout_id"], i + 1) for i in range(n)], dtype=torch.float64
        )
        ratio = torch.exp(target_logprobs - inputs["logprobs"].to(torch.float64))
        clipped = ratio.clamp(loss_fn_config["clip_low_threshold"], loss_fn_config["clip_high_threshold"])
        advantages = inputs["advantages"].to(torch.float64)
        total += float(-torch.minimum(ratio * advantages, clipped * advantages).sum())
    return total


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("seed", SEEDS)
def test_tinker_ppo_loss_with_folded_weights_matches_the_reference(dataset, seed, settings):
    rows = rows_of(dataset)
    policy = Policy(rows, seed)
    expected, _ = reference(rows, policy, settings)
    datums = tinker_datums(dataset, settings=settings, proximal=policy.proximal_list(rows))
    got = tinker_loss(datums, policy, tinker_loss_config(settings))
    assert abs(got - expected) < TOLERANCE, (got, expected)


def test_tinker_datums_shift_by_one_and_train_only_sampled_tokens_of_trainable_rows(dataset):
    rows = rows_of(dataset)
    datums = tinker_datums(rows, settings=GrpoLossSettings())
    trainable = [row for row in rows if int(row["sample_mask"]) == 1]
    assert [d["rollout_id"] for d in datums] == [row["rollout_id"] for row in trainable]
    tokens = sum(int(row["loss_mask"].sum()) for row in trainable)
    for datum, row in zip(datums, trainable, strict=True):
        ids = row["input_ids"].tolist()
        assert datum["model_input"].tolist() == ids[:-1]
        inputs = datum["loss_fn_inputs"]
        assert inputs["target_tokens"].tolist() == ids[1:]
        sampled = row["loss_mask"][1:].bool()
        assert (inputs["advantages"][~sampled] == 0).all()
        # without proximal the sampler is the trainer: w = 1, so the advantage is A / N and logprobs the sampler's
        np.testing.assert_allclose(inputs["advantages"][sampled].numpy(), float(row["advantage"]) / tokens, rtol=1e-6)
        assert inputs["logprobs"].tolist() == row["logprobs"][1:].tolist()


# ---------------------------------------------------------------- inputs
def test_a_table_of_rows_exports_as_the_published_dataset_does(dataset, published):
    rows = rows_of(dataset)
    store = ObjectStore(published)
    marker = read_dataset_marker(store)
    table = pa.concat_tables([read_dataset_part(store, part) for part in marker.parts])
    from_table, from_items = verl_batch(table, pad_token_id=PAD), verl_batch(rows, pad_token_id=PAD)
    assert from_table.keys() == from_items.keys()
    for key, value in from_table.items():
        assert torch.equal(value, from_items[key]) if torch.is_tensor(value) else value == from_items[key]
