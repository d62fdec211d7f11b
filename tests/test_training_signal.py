"""The training signal's advice follows the cause: failed agents, poisoned captures, or equal rewards."""

from __future__ import annotations

from tasks.training_signal import (
    EQUAL_REWARDS_ADVICE,
    FAILED_ADVICE,
    POISONED_ADVICE,
    RolloutOutcome,
    TrainingSignal,
)


def outcome(group: str, status: str = "ok", reward: float | None = 1.0, reason: str | None = None) -> RolloutOutcome:
    return RolloutOutcome(group, status, reward if status == "ok" else None, reason, truncated=False)


def lines(*outcomes: RolloutOutcome) -> str:
    return "\n".join(TrainingSignal.of(outcomes).describe())


def test_failed_agents_are_told_to_check_the_command_and_its_stderr():
    text = lines(*(outcome(g, "failed", reason="agent_exit") for g in ("a", "a", "b", "b")))
    assert (
        "NO TRAINING SIGNAL: all 2 groups have zero reward variance (every advantage is 0); "
        "no group has two usable rollouts (4 failed): see why below"
    ) in text
    assert f"4 failed (their agent or environment gave no reward): {FAILED_ADVICE}" in text
    assert EQUAL_REWARDS_ADVICE not in text and POISONED_ADVICE not in text


def test_poisoned_captures_are_told_where_their_reasons_are_explained():
    text = lines(outcome("a", "poisoned", reason="context_length"), outcome("a", "poisoned", reason="template_error"))
    assert "no group has two usable rollouts (2 poisoned): see why below" in text
    assert "unusable rollouts (masked or dropped in the dataset): context_length 1, template_error 1" in text
    assert (
        f"2 poisoned (a captured call failed, or the scored call could not be named or proven): {POISONED_ADVICE}"
        in (text)
    )
    assert EQUAL_REWARDS_ADVICE not in text and FAILED_ADVICE not in text


def test_usable_rollouts_with_equal_rewards_keep_the_easier_or_harder_advice():
    text = lines(outcome("a", reward=0.0), outcome("a", reward=0.0), outcome("b", reward=1.0), outcome("b", reward=1.0))
    assert (
        "all 2 groups have zero reward variance (every advantage is 0); their usable rollouts' rewards are all " in text
    )
    assert text.endswith(
        f"equal: {EQUAL_REWARDS_ADVICE}\ntruncation rate 0.0% (the last call of a usable rollout hit max_tokens)"
    )
    assert "failed (" not in text and "poisoned (" not in text


def test_a_mix_names_each_cause_with_its_advice():
    text = lines(
        outcome("a", reward=0.0),
        outcome("a", reward=0.0),
        outcome("b", "failed", reason="agent_timeout"),
        outcome("b", "poisoned", reason="prefix_mismatch"),
    )
    assert (
        "1 of them have fewer than two usable rollouts (1 failed and 1 poisoned: see why below), "
        f"1 only equal rewards ({EQUAL_REWARDS_ADVICE})"
    ) in text
    assert f"1 failed (their agent or environment gave no reward): {FAILED_ADVICE}" in text
    assert POISONED_ADVICE in text


def test_some_signal_left_still_names_the_failures():
    text = lines(outcome("a", reward=0.0), outcome("a", reward=1.0), outcome("b", "failed", reason="agent_exit"))
    assert "1 of 2 groups have zero reward variance (no signal)" in text and "NO TRAINING SIGNAL" not in text
    assert f"1 failed (their agent or environment gave no reward): {FAILED_ADVICE}" in text


def test_a_dataset_s_failed_rollouts_are_its_rollout_failed_rows():
    metrics = {
        "planned_rollouts": 4,
        "trainable_rows": 0,
        "groups": 2,
        "groups_dropped": 0,
        "groups_zero_variance": 0,
        "groups_single_valid": 2,
        "invalid_reasons": {"rollout_failed": 3, "capture_poisoned": 1},
    }
    signal = TrainingSignal.of_dataset_metrics(metrics)
    assert signal.failed_by_reason == {"rollout_failed": 3} and signal.failed == 3 and signal.poisoned == 1
    text = "\n".join(signal.describe())
    assert "no group has two usable rollouts (3 failed and 1 poisoned): see why below" in text
