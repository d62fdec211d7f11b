"""Sampling masks: what recording each sampled token's kept set costs, side by side on one vLLM engine.

One real vLLM engine (the bundled SmolLM2 unless ``--model``) answers the same requests (same prompts and
seeds, top-p / top-k sampling) in alternating rounds:

* masks on: the engine as the product runs it, asking ``min(sampling_mask_candidates, top_k + 1)`` top
  logprobs per token and reading each kept set from them;
* masks off: the same engine asking none (``sampling_mask_candidates`` 0). The product refuses such a call
  (``sampling_mask_missing``): this only measures what asking and reading costs.

fp32 with per-request seeds samples the same tokens either way, which the script checks. Per round it
times the whole batch of requests; rounds run on, off, off, on, ... so drift cancels within each pair. It
then stages the masks-on results both with and without their kept sets (the product's segment encoding)
and prints: mask bytes per sampled token, staged bytes per token with masks on and off and their ratio
(goal <= 1.10), the kept-set sizes, and capture time on / off per pair with its median and a 95 %
bootstrap interval.

    python bench/sampling_masks.py [--rounds 8] [--requests 16] [--max-tokens 128] [--top-p 0.9] [--top-k 50]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vllm_engine import started_engine
from tasks.engines.base import GenerationRequest, GenerationResult
from tasks.models.reference import BUNDLED_REFERENCE, model_reference, resolve_model_reference
from tasks.records.ledger import StagedDelta
from tasks.records.sampling_mask import KEPT_NOTE
from tasks.sampling import SamplingSettings
from tasks.storage.staging import encode_segment

ENGINE_OPTIONS = {"max_model_len": 2048}
TOPICS = ("the sea", "a clock", "bread", "winter", "a bridge", "paper", "rain", "a garden")


def _requests(engine, args: argparse.Namespace) -> list[GenerationRequest]:
    sampling = SamplingSettings(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens
    )
    prompts = []
    for i in range(args.requests):
        chat = [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (#{i})."}]
        ids = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(tuple(int(t) for t in ids))
    return [GenerationRequest(f"r{i}", prompt, sampling, seed=1000 + i) for i, prompt in enumerate(prompts)]


def _round(engine, loop, requests: list[GenerationRequest], candidates: int) -> tuple[float, list[GenerationResult]]:
    engine._mask_candidates = candidates  # the bench's one knob: how many candidates the engine asks for

    async def all_of() -> list[GenerationResult]:
        return list(await asyncio.gather(*(engine.generate(request) for request in requests)))

    started = time.perf_counter()
    results = loop.run(all_of(), timeout=1800)
    return time.perf_counter() - started, results


def _staged_bytes(requests: list[GenerationRequest], results: list[GenerationResult], *, masks: bool) -> int:
    deltas = []
    for request, result in zip(requests, results, strict=True):
        kept = result.kept if masks else None
        deltas.append(
            StagedDelta.build(
                batch_id="b-bench",
                rollout_id=f"{request.request_id}-r",
                call_id=request.request_id,
                parent_call_id=None,
                parent_chain_hash=None,
                prefix_token_ids=[],
                prompt_token_ids=list(request.prompt_token_ids),
                generated_token_ids=list(result.token_ids),
                generated_logprobs=np.asarray(result.logprobs, np.float32),
                weight_version=0,
                finish_reason=result.finish_reason,
                temperature=request.sampling.temperature,
                top_p=request.sampling.top_p,
                top_k=request.sampling.top_k,
                extras={KEPT_NOTE: kept.note()} if kept else None,
                kept=kept,
            )
        )
    return len(encode_segment(StagedDelta.to_table(deltas)))


def _interval(ratios: list[float], *, draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the median of ``ratios`` (resampled with replacement)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="on/off pairs timed (default 8)")
    parser.add_argument("--requests", type=int, default=16, help="requests per round (default 16)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--candidates", type=int, default=64, help="sampling_mask_candidates when on (default 64)")
    parser.add_argument("--model", default=BUNDLED_REFERENCE, help="model reference (default: the bundled model)")
    args = parser.parse_args(argv)
    folder = resolve_model_reference(model_reference(args.model))
    with started_engine(folder, label=args.model, options=ENGINE_OPTIONS, weight_version=0) as (engine, loop):
        requests = _requests(engine, args)
        _round(engine, loop, requests, args.candidates)  # warm-up, uncounted
        pairs: list[tuple[float, float]] = []
        on_results: list[GenerationResult] = []
        for i in range(args.rounds):
            order = (args.candidates, 0) if i % 2 == 0 else (0, args.candidates)
            timed = {candidates: _round(engine, loop, requests, candidates) for candidates in order}
            (on_seconds, on_results), (off_seconds, off_results) = timed[args.candidates], timed[0]
            if [r.token_ids for r in on_results] != [r.token_ids for r in off_results]:
                raise SystemExit("masks on and off sampled different tokens: the comparison is not like for like")
            pairs.append((on_seconds, off_seconds))
            print(f"round {i + 1}: on {on_seconds:.2f}s  off {off_seconds:.2f}s  on/off {on_seconds / off_seconds:.3f}")
    sampled = sum(len(r.token_ids) for r in on_results)
    tokens = sum(len(q.prompt_token_ids) + len(r.token_ids) for q, r in zip(requests, on_results, strict=True))
    sizes = np.concatenate([r.kept.counts for r in on_results])
    with_masks = _staged_bytes(requests, on_results, masks=True)
    without = _staged_bytes(requests, on_results, masks=False)
    ratios = [on / off for on, off in pairs]
    low, high = _interval(ratios)
    print(
        f"requests {len(requests)} x {args.max_tokens} tokens, T={args.temperature} top_p={args.top_p} "
        f"top_k={args.top_k}; {sampled} sampled tokens, {tokens} tokens staged (prompt + sampled)"
    )
    print(
        f"kept-set size per sampled token: mean {sizes.mean():.1f}, p50 {np.median(sizes):.0f}, "
        f"p99 {np.percentile(sizes, 99):.0f}, max {sizes.max()}"
    )
    print(f"mask bytes per sampled token: {(with_masks - without) / sampled:.2f}")
    print(
        f"staged bytes per token: masks on {with_masks / tokens:.2f}, off {without / tokens:.2f}, "
        f"on/off {with_masks / without:.3f} (goal <= 1.10)"
    )
    print(
        f"capture time masks on / off: median {statistics.median(ratios):.3f} over {len(ratios)} pairs, "
        f"95 % interval [{low:.3f}, {high:.3f}]; spread of on rounds "
        f"{(max(p[0] for p in pairs) - min(p[0] for p in pairs)) / statistics.median(p[0] for p in pairs):.1%}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
