"""Capture overhead: generated tok/s with capture on vs off, same prompts, seeds and engine.

One vLLM engine serves every run; a first, uncounted run warms it up. Runs then alternate
capture on / off; each run generates a fresh
copy of the same batch (same tasks, seeds and settings; only the batch id differs), so both
modes do identical work — fp32 with per-request seeds samples the same tokens, which the
script checks. Capture off is the same code path minus staging and ledger writes.

    python bench/capture_overhead.py [--runs 10] [--tasks 16] [--group-size 2] [--max-turns 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.config import BatchConfig, EngineSpec, ModelSpec
from tasks.engines import create_engine
from tasks.engines.background import BackgroundLoop
from tasks.engines.base import SamplingSettings
from tasks.generate import generate_shard
from tasks.models.bundled import resolve_model
from tasks.plan import plan_batch

TARGET_RATIO = 0.98


def batch_config(batch_id: str, model: Path, args: argparse.Namespace) -> BatchConfig:
    return BatchConfig(
        batch_id=batch_id,
        environment="guess_number",
        num_tasks=args.tasks,
        group_size=args.group_size,
        shards=1,
        model=ModelSpec(path=str(model)),
        engine=EngineSpec(name="vllm", options={"max_model_len": 2048}),
        sampling=SamplingSettings(temperature=1.0, max_tokens=args.max_tokens),
        max_turns=args.max_turns,
        max_in_flight=args.tasks * args.group_size,
        seed=1234,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="total runs, alternating on/off (default 10)")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default=None, help="HF model folder (default: the bundled SmolLM2)")
    args = parser.parse_args(argv)
    if args.runs < 10:
        parser.error("--runs must be at least 10 (5 per mode)")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    logging.basicConfig(level=logging.WARNING)
    model = resolve_model(args.model)
    rates: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, set[int]] = {True: set(), False: set()}
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as root, BackgroundLoop("bench-engine") as loop:
        engine = loop.run(create_engine("vllm", model_path=model, options={"max_model_len": 2048}), timeout=900)
        try:
            warmup = batch_config("bench-warmup", model, args)
            plan_batch(root, warmup)
            generate_shard(root, warmup.batch_id, 0, engine=engine, run=loop.run, capture=False, progress=False)
            for run in range(args.runs):
                capture = run % 2 == 0
                config = batch_config(f"bench-{run:02d}", model, args)
                plan_batch(root, config)
                summary = generate_shard(
                    root, config.batch_id, 0, engine=engine, run=loop.run, capture=capture, progress=False
                )
                rate = summary.generated_tokens / summary.seconds
                rates[capture].append(rate)
                tokens[capture].add(summary.generated_tokens)
                mode = "on " if capture else "off"
                print(
                    f"run {run:2d} capture {mode}: {summary.generated_tokens} tokens in {summary.seconds:6.2f}s "
                    f"= {rate:7.1f} tok/s",
                    flush=True,
                )
        finally:
            loop.run(engine.close(), timeout=120)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    ratio = on / off
    spread = (max(rates[True]) - min(rates[True])) / on, (max(rates[False]) - min(rates[False])) / off
    same_work = tokens[True] == tokens[False] and len(tokens[True]) == 1
    print()
    print(f"median generated tok/s: capture on {on:.1f}, capture off {off:.1f}")
    print(f"spread (max-min)/median: on {spread[0]:.1%}, off {spread[1]:.1%}")
    print(f"identical work in both modes (same generated tokens every run): {same_work}")
    ok = ratio >= TARGET_RATIO and same_work
    print(f"capture on / off = {ratio:.3f}  (target >= {TARGET_RATIO}: {'PASS' if ok else 'FAIL'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
