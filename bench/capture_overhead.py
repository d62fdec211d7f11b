"""Capture overhead: generated tok/s of whole shards with capture on vs off, same engine, prompts and seeds.

One real vLLM engine (the bundled SmolLM2 unless ``--model``) serves every run. Each run plans a
fresh copy of one batch (same tasks, seeds and settings; only the batch id differs) and times
``generate_shard`` from its call to its return, so the capture-on figure is the whole shard:
reading the plan, the attempt claim, every engine call, staging, the ledger, receipts, the
commit marker and the orphan sweep. Capture off (``capture=False``) runs the same path minus
staging and ledger (no marker, nothing to sweep). One uncounted run of each mode warms up; the
counted runs then alternate on / off. fp32 with per-request seeds samples the same tokens in
both modes, which the script checks (identical work).

Prints each mode's median wall time and generated tok/s, and capture on ÷ capture off
throughput of the medians (target >= 0.98); the fastest run of each mode is printed too, the
figure least disturbed by other load on the host (a high spread means the host was busy).

    python bench/capture_overhead.py [--runs 10] [--tasks 16] [--group-size 2] [--max-turns 3] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vllm_engine import started_engine
from tasks.batch import Batch
from tasks.config import BatchConfig, EngineSpec, ModelSpec
from tasks.engines.background import BackgroundLoop
from tasks.engines.base import Engine
from tasks.generate import generate_shard
from tasks.models.provenance import model_provenance
from tasks.models.reference import model_reference, resolve_model_reference
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings

TARGET_RATIO = 0.98
ENGINE_OPTIONS = {"max_model_len": 2048}
WEIGHT_VERSION = 0


@dataclass(frozen=True)
class Run:
    """One timed shard: wall seconds from ``generate_shard``'s call to its return, and what it generated."""

    capture: bool
    seconds: float
    generated_tokens: int
    rollouts: int
    calls: int

    @property
    def rate(self) -> float:
        return self.generated_tokens / self.seconds


def batch_config(batch_id: str, model: ModelSpec, args: argparse.Namespace) -> BatchConfig:
    return BatchConfig(
        batch_id=batch_id,
        environment="guess_number",
        num_tasks=args.tasks,
        group_size=args.group_size,
        shards=1,
        model=model,
        engine=EngineSpec(name="vllm", options=ENGINE_OPTIONS),
        sampling=SamplingSettings(temperature=1.0, max_tokens=args.max_tokens),
        max_turns=args.max_turns,
        max_in_flight=args.tasks * args.group_size,
        weight_version=WEIGHT_VERSION,
        seed=1234,
    )


def timed_shard(root: str, config: BatchConfig, engine: Engine, loop: BackgroundLoop, *, capture: bool) -> Run:
    """Plan a fresh copy of the batch (untimed), then time its one shard end to end."""
    plan_batch(Batch.open(root, config.batch_id), config)
    started = time.perf_counter()
    summary = generate_shard(
        Batch.open(root, config.batch_id), 0, engine=engine, run=loop.run, capture=capture, progress=False
    )
    seconds = time.perf_counter() - started
    if capture and summary.already_committed:
        raise RuntimeError(f"{config.batch_id} was already committed: the run did no work")
    return Run(capture, seconds, summary.generated_tokens, summary.rollouts, summary.calls)


def timed_runs(
    root: str, config_of: Callable[[str], BatchConfig], engine: Engine, loop: BackgroundLoop, captures: Sequence[bool]
) -> list[Run]:
    """One untimed warm-up shard with capture off and one with it on, then one timed shard per entry of
    ``captures`` (capture on or off), each printed as it ends; ``config_of(batch_id)`` is a run's batch."""
    for capture in (False, True):
        warm = timed_shard(root, config_of(f"bench-warmup-{mode(capture).strip()}"), engine, loop, capture=capture)
        print(f"warm-up capture {mode(capture)}: {warm.seconds:6.2f}s (not counted)", flush=True)
    runs: list[Run] = []
    for index, capture in enumerate(captures):
        run = timed_shard(root, config_of(f"bench-{index:02d}"), engine, loop, capture=capture)
        runs.append(run)
        print(
            f"run {index:2d} capture {mode(capture)}: {run.rollouts} rollouts, {run.calls} calls, "
            f"{run.generated_tokens} tokens in {run.seconds:6.2f}s = {run.rate:7.1f} tok/s",
            flush=True,
        )
    return runs


def mode(capture: bool) -> str:
    return "on " if capture else "off"


def median(runs: list[Run], capture: bool, field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs if r.capture == capture)


def spread(runs: list[Run], capture: bool) -> float:
    rates = [r.rate for r in runs if r.capture == capture]
    return (max(rates) - min(rates)) / statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="counted runs, alternating on/off; even (default 10)")
    parser.add_argument("--tasks", type=int, default=16, help="tasks per shard (default 16)")
    parser.add_argument("--group-size", type=int, default=2, help="rollouts per task (default 2)")
    parser.add_argument("--max-turns", type=int, default=3, help="model calls per rollout at most (default 3)")
    parser.add_argument("--max-tokens", type=int, default=32, help="sampled tokens per call at most (default 32)")
    parser.add_argument("--model", default=None, help="Hugging Face model folder (default: the bundled SmolLM2)")
    args = parser.parse_args(argv)
    if args.runs < 2 or args.runs % 2:
        parser.error("--runs must be even and at least 2 (as many on as off)")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    logging.basicConfig(level=logging.WARNING)
    reference = model_reference(args.model)
    folder = resolve_model_reference(reference)
    model = ModelSpec(reference=reference, **model_provenance(folder))
    engine_run = started_engine(folder, label=reference, options=ENGINE_OPTIONS, weight_version=WEIGHT_VERSION)
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as root, engine_run as (engine, loop):
        captures = [index % 2 == 0 for index in range(args.runs)]  # on, off, on, ...
        runs = timed_runs(root, lambda batch_id: batch_config(batch_id, model, args), engine, loop, captures)
    on_rate, off_rate = median(runs, True, "rate"), median(runs, False, "rate")
    ratio = on_rate / off_rate
    same_work = len({r.generated_tokens for r in runs}) == 1
    print()
    print("each run timed from generate_shard's call to its return (capture on: claim, staging, ledger, commit, sweep)")
    print(
        f"median wall time:       capture on {median(runs, True, 'seconds'):.2f}s, "
        f"capture off {median(runs, False, 'seconds'):.2f}s"
    )
    print(f"median generated tok/s: capture on {on_rate:.1f}, capture off {off_rate:.1f}")
    print(f"spread (max-min)/median: on {spread(runs, True):.1%}, off {spread(runs, False):.1%}")
    fastest = {capture: min(r.seconds for r in runs if r.capture == capture) for capture in (True, False)}
    print(
        f"fastest run (least disturbed by other load): capture on {fastest[True]:.2f}s, off {fastest[False]:.2f}s, "
        f"on / off throughput {fastest[False] / fastest[True]:.3f}"
    )
    print(f"identical work in both modes (same generated tokens every run): {same_work}")
    ok = ratio >= TARGET_RATIO and same_work
    print(f"capture on / off throughput = {ratio:.3f}  (target >= {TARGET_RATIO}: {'PASS' if ok else 'FAIL'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
