"""``rollout-ledger demo``: the demo batch without Airflow — plan, generate every shard, finalize.

The batch fields' defaults (:mod:`tasks.batch_fields`; the same batch ``make demo`` runs through the
Airflow DAG): local storage, the bundled SmolLM2-135M-Instruct, vLLM on this machine, a few minutes
on 2 CPU cores.
One engine serves every shard (``generate_shards``). Prints where the dataset is and a summary.
"""

from __future__ import annotations

import time

from tasks import layout
from tasks.batch import Batch
from tasks.generate import generate_shards
from tasks.pipeline import finalize_and_publish
from tasks.plan import plan_from_values


def run_demo(root: str, *, batch_id: str | None = None) -> dict:
    """Run the batch the fields' defaults describe (what ``make demo`` runs through Airflow) and return its summary."""
    batch_id = batch_id or time.strftime("demo-%Y%m%d-%H%M%S")
    started = time.monotonic()
    batch = Batch.open(root, batch_id)
    config = plan_from_values(batch, {}, source="demo batch").config
    print(f"[1/3] plan: batch {batch_id}, {config.num_rollouts} rollouts in {config.shards} shards", flush=True)
    print("[2/3] generate: every shard on one vLLM engine serving the bundled SmolLM2-135M-Instruct", flush=True)
    for summary in generate_shards(batch, range(config.shards)):
        print(
            f"      shard {summary.shard}: {summary.ok} ok, {summary.poisoned} poisoned, "
            f"{summary.calls} calls, {summary.generated_tokens} tokens in {summary.seconds:.1f}s",
            flush=True,
        )
    print("[3/3] finalize: lineage suite, verify and linearize, advantages, logprob audit, dataset suite, publish")
    finalize_and_publish(batch)
    summary = batch_summary(batch, wall_seconds=time.monotonic() - started)
    print_summary(summary)
    return summary


def batch_summary(batch: Batch, *, wall_seconds: float) -> dict:
    """The headline numbers of a published batch: where it is, rows, reasons, reward, tokens, audit."""
    manifest = batch.published_dataset()
    if manifest is None:
        raise ValueError(f"batch {batch.batch_id} is not published: no {batch.url_of(layout.DATASET_MARKER)}")
    metrics = batch.dataset_metrics(manifest)
    return {
        "batch_id": batch.batch_id,
        "dataset": batch.url_of(layout.DATASET_DIR),
        "reports": batch.url_of(layout.REPORTS_INDEX),
        "rollouts": metrics["planned_rollouts"],
        "trainable_rows": metrics["trainable_rows"],
        "masked_rows": metrics["masked_rows"],
        "invalid_reasons": metrics["invalid_reasons"],
        "mean_reward": (metrics.get("reward") or {}).get("mean"),
        "tokens": metrics["tokens"],
        "sampled_tokens": metrics["sampled_tokens"],
        "audit_mean_abs_logprob_diff": (metrics.get("audit") or {}).get("mean_abs_diff"),
        "wall_seconds": round(wall_seconds, 1),
    }


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
    dataset = summary["dataset"].removeprefix("file://")
    print(f"Load it: datasets.load_dataset('parquet', data_files='{dataset}/part-*.parquet')")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
