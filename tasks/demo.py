"""``make demo``: a whole batch on the embedded defaults — plan, generate every shard, finalize.

Local storage, the bundled SmolLM2-135M-Instruct, vLLM on this machine; sized to finish in a few
minutes on 2 CPU cores. One engine serves every shard (``generate_shards``). Prints where the dataset is and a summary.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.config import BatchConfig, EngineSpec, ModelSpec
from tasks.engines.base import SamplingSettings
from tasks.generate import generate_shards
from tasks.models.provenance import model_provenance
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
from tasks.pipeline import finalize_and_publish
from tasks.plan import batch_store, plan_batch
from tasks.storage import layout
from tasks.version import code_version


@dataclass(frozen=True)
class DemoSize:
    environment: str = "guess_number"
    environment_options: tuple[tuple[str, int], ...] = (("lo", 1), ("hi", 10))  # small enough to be won
    num_tasks: int = 8
    group_size: int = 4
    shards: int = 2
    max_turns: int = 5
    max_tokens: int = 32
    temperature: float = 1.0


def run_demo(root: str, *, batch_id: str | None = None, size: DemoSize | None = None) -> dict:
    """Run the batch and return its summary (also printed)."""
    size = size or DemoSize()
    batch_id = batch_id or time.strftime("demo-%Y%m%d-%H%M%S")
    started = time.monotonic()
    config = BatchConfig(
        batch_id=batch_id,
        environment=size.environment,
        environment_options=dict(size.environment_options),
        num_tasks=size.num_tasks,
        group_size=size.group_size,
        shards=size.shards,
        model=ModelSpec(reference=BUNDLED_REFERENCE, **model_provenance(resolve_model_reference(BUNDLED_REFERENCE))),
        engine=EngineSpec(name="vllm", options={"max_model_len": 2048}),
        sampling=SamplingSettings(temperature=size.temperature, max_tokens=size.max_tokens),
        max_turns=size.max_turns,
        code_version=code_version(),
    )
    print(f"[1/3] plan: batch {batch_id}, {config.num_rollouts} rollouts in {config.shards} shards", flush=True)
    plan_batch(root, config)
    print("[2/3] generate: every shard on one vLLM engine serving the bundled SmolLM2-135M-Instruct", flush=True)
    for summary in generate_shards(root, batch_id, range(config.shards)):
        print(
            f"      shard {summary.shard}: {summary.ok} ok, {summary.poisoned} poisoned, "
            f"{summary.calls} calls, {summary.generated_tokens} tokens in {summary.seconds:.1f}s",
            flush=True,
        )
    print("[3/3] finalize: lineage suite, verify and linearize, advantages, logprob audit, dataset suite, publish")
    published = finalize_and_publish(root, batch_id).published
    store = batch_store(root, batch_id)
    metrics = json.loads(store.read_bytes(layout.DATASET_METRICS))
    summary = {
        "batch_id": batch_id,
        "dataset": f"{published.url}/dataset",
        "reports": f"{store.url}/{layout.REPORTS_INDEX}",
        "rollouts": metrics["planned_rollouts"],
        "trainable_rows": metrics["trainable_rows"],
        "masked_rows": metrics["masked_rows"],
        "invalid_reasons": metrics["invalid_reasons"],
        "mean_reward": (metrics.get("reward") or {}).get("mean"),
        "tokens": metrics["tokens"],
        "sampled_tokens": metrics["sampled_tokens"],
        "audit_mean_abs_logprob_diff": (metrics.get("audit") or {}).get("mean_abs_diff"),
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    print_summary(summary)
    return summary


def print_summary(summary: dict) -> None:
    reasons = ", ".join(f"{k}: {v}" for k, v in summary["invalid_reasons"].items()) or "none"
    rows = [
        ("dataset", summary["dataset"]),
        ("reports", summary["reports"]),
        ("rollouts", summary["rollouts"]),
        ("trainable / masked rows", f"{summary['trainable_rows']} / {summary['masked_rows']}"),
        ("masked reasons", reasons),
        ("mean reward", _fmt(summary["mean_reward"])),
        ("tokens (sampled)", f"{summary['tokens']} ({summary['sampled_tokens']})"),
        ("logprob audit |diff|", _fmt(summary["audit_mean_abs_logprob_diff"])),
        ("wall time", f"{summary['wall_seconds']} s"),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"  {name.ljust(width)}  {value}")
    print()
    print(f"Load it: datasets.load_dataset('parquet', data_files='{Path(summary['dataset'])}/part-*.parquet')")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
