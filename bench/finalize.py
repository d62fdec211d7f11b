"""Finalize benchmark: verify + linearize + publish throughput vs a raw pyarrow scan, and peak RSS.

Builds synthetic committed staging (default ~10^8 tokens: multi-turn rollouts of ~250-token
deltas, many shards) with the real ``StagingWriter`` / ``LedgerWriter`` on local disk, then, in
separate processes so memory is measured alone:

* raw scan: ``pyarrow.parquet.read_table`` of every staging segment (all columns);
* finalize: ``finalize_batch`` (every digest recomputed, every chain walked, dataset written);
* validate: ``validate_lineage`` then ``validate_dataset`` (both Great Expectations suites, their
  Data Docs and summaries written), after finalize, in one process.

Prints finalize tokens/s ÷ raw scan tokens/s (target >= 0.3), the share of finalize wall time
spent in the hashing functions (they run on the verifying thread while other threads read and
write), finalize peak RSS (target <= 1.5 GB), and validation beside it: seconds per suite, total
validation / finalize seconds (target <= 0.5) and validation peak RSS (target <= 1.5 GB). Each
stage's CPU seconds (user + system, all threads) are printed beside its wall time: on a machine
shared with other work, wall times move with the load and CPU seconds much less.
``--keep DIR`` builds into ``DIR``, or reuses the batch an earlier run built there for the same
``--tokens``/``--shards`` (resetting its dataset and reports, so finalize and validation run again).

    python bench/finalize.py [--tokens 1e8] [--shards 40] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tasks.batch import Batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_RATIO = 0.3
TARGET_RSS_GB = 1.5
TARGET_VALIDATE_SHARE = 0.5  # validation seconds / finalize seconds
TURNS = 8
CARRY, SAMPLED = 50, 200
VOCAB = 49152
BUILT = "bench-build.json"  # what build() staged under a --keep directory, for the next run to reuse


def build(root: str, tokens: float, shards: int) -> dict:
    """Plan a synthetic batch and stage/commit every shard without an engine."""
    from tasks import ids
    from tasks.config import BatchConfig, ModelSpec
    from tasks.records.ledger import CallRecord, Receipt, StagedDelta, canonical_json
    from tasks.sampling import SamplingSettings
    from tasks.storage.ledger_writer import LedgerWriter
    from tasks.storage.staging import StagingWriter

    per_rollout = TURNS * (CARRY + SAMPLED)
    rollouts = max(int(tokens // per_rollout), shards * 2)
    group_size = 2
    config = BatchConfig(
        batch_id="bench-finalize",
        environment="arithmetic",
        num_tasks=rollouts // group_size,
        group_size=group_size,
        shards=shards,
        model=ModelSpec(reference="synthetic"),
        sampling=SamplingSettings(temperature=1.0, max_tokens=SAMPLED),
        max_turns=TURNS,
    )
    from tasks.plan import plan_batch

    batch = Batch.open(root, config.batch_id)
    plan_batch(batch, config)
    store = batch.store
    rng = np.random.default_rng(0)
    staged_tokens = 0
    started = time.perf_counter()
    for shard in range(shards):
        plan = batch.shard_plan(shard)
        ledger = LedgerWriter(store, batch_id=config.batch_id, shard=shard, attempt=0)
        staged: list[tuple[Any, list]] = []
        with StagingWriter(store, shard=shard, attempt=0, max_rows=1024) as writer:
            for planned in plan:
                sequence = np.zeros(0, np.int64)
                parent = None
                calls = []
                for turn in range(TURNS):
                    carry = rng.integers(0, VOCAB, CARRY)
                    sampled = rng.integers(0, VOCAB, SAMPLED)
                    delta = StagedDelta.build(
                        batch_id=config.batch_id,
                        rollout_id=planned.rollout_id,
                        call_id=ids.call_id(planned.rollout_id, 0, turn),
                        parent_call_id=parent.call_id if parent else None,
                        parent_chain_hash=parent.chain_hash if parent else None,
                        prefix_token_ids=sequence,
                        prompt_token_ids=np.concatenate([sequence, carry]),
                        generated_token_ids=sampled,
                        generated_logprobs=-rng.exponential(0.3, SAMPLED).astype(np.float32),
                        weight_version=0,
                        finish_reason="stop",
                        temperature=1.0,
                        top_p=1.0,
                        top_k=-1,
                    )
                    calls.append((delta, writer.submit(delta)))
                    sequence = np.concatenate([sequence, delta.token_ids_delta])
                    parent = delta
                    staged_tokens += delta.delta_len
                staged.append((planned, calls))
        for planned, calls in staged:  # the writer is closed: every segment is written
            for turn, (delta, future) in enumerate(calls):
                coordinates = future.result()
                ledger.add_call(
                    CallRecord.for_staged(
                        delta,
                        staging_segment=coordinates.segment,
                        staging_row=coordinates.row,
                        admitted_at=float(turn),
                    )
                )
            ledger.add_receipt(
                Receipt(
                    rollout_id=planned.rollout_id,
                    group_id=planned.group_id,
                    attempt=0,
                    reward=float(rng.integers(0, 2)),
                    reward_info=canonical_json({}),
                    terminal_call_id=calls[-1][0].call_id,
                    terminal_selection="declared",
                    terminal_attribution_reason="selected",
                    status="ok",
                    failure_reason=None,
                    num_calls=TURNS,
                )
            )
        ledger.commit(staging_segments=writer.segments)
        print(
            f"  built shard {shard + 1}/{shards} ({staged_tokens:,} tokens, {time.perf_counter() - started:.0f}s)",
            flush=True,
        )
    return {"batch_id": config.batch_id, "tokens": staged_tokens, "rollouts": rollouts}


def reuse(root: str, tokens: float, shards: int) -> dict | None:
    """The batch an earlier run built under ``root`` for the same request, its dataset output removed; None if none."""
    try:
        built = json.loads(Path(root, BUILT).read_text())
    except FileNotFoundError:
        return None
    if built.pop("requested") != [tokens, shards]:
        raise SystemExit(f"{root} holds a batch built for other --tokens/--shards; use another --keep directory")
    for output in ("dataset", "reports"):
        shutil.rmtree(Path(root, "batches", built["batch_id"], output), ignore_errors=True)
    print(f"reusing the batch built under {root} ({built['tokens']:,} tokens); its dataset and reports were reset")
    return built


def measure_raw_scan(root: str, batch_id: str) -> dict:
    import pyarrow.parquet as pq

    files = sorted(Path(root, "batches", batch_id, "staging").rglob("seg-*.parquet"))
    started = time.perf_counter()
    tokens = 0
    for path in files:
        table = pq.read_table(path)
        tokens += int(np_sum(table.column("delta_len")))
    return {"seconds": time.perf_counter() - started, "tokens": tokens, "peak_rss_gb": peak_rss_gb()}


def measure_finalize(root: str, batch_id: str) -> dict:
    from tasks.finalize.stage import FinalizeOptions, finalize_batch
    from tasks.records import digest as dg
    from tasks.records import digest_batch

    spent = [0.0]
    hashing = [(digest_batch, name) for name in ("call_digests", "chain_hashes", "cumulative_hash")]
    hashing += [(dg, "compute_extras_digest")]
    for module, name in hashing:
        original = getattr(module, name)

        def timed(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(module, name, timed)
    started, cpu = time.perf_counter(), cpu_seconds()
    published = finalize_batch(Batch.open(root, batch_id), FinalizeOptions(audit=False))
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds() - cpu,
        "hash_seconds": spent[0],
        "rows": published.marker.rows,
        "trainable_rows": published.marker.trainable_rows,
        "peak_rss_gb": peak_rss_gb(),
    }


def measure_validate(root: str, batch_id: str) -> dict:
    """Both suites over the finalized batch, as the pipeline runs them, each timed; GX's import counted in."""
    from tasks.validate import validate_dataset, validate_lineage

    seconds, statuses = {}, {}
    cpu = cpu_seconds()
    for suite, validate in (("lineage", validate_lineage), ("dataset", validate_dataset)):
        started = time.perf_counter()
        outcome = validate(Batch.open(root, batch_id))
        seconds[suite] = time.perf_counter() - started
        statuses[suite] = outcome.status
    return {"seconds": seconds, "cpu_seconds": cpu_seconds() - cpu, "statuses": statuses, "peak_rss_gb": peak_rss_gb()}


def np_sum(column) -> int:
    import pyarrow.compute as pc

    return pc.sum(column).as_py() or 0


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def in_subprocess(function: str, root: str, batch_id: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--measure", function, "--root", root, "--batch-id", batch_id],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e8)
    parser.add_argument("--shards", type=int, default=40)
    parser.add_argument(
        "--keep", default=None, help="build into this directory instead of a temp one; reuse what it already holds"
    )
    parser.add_argument("--measure", choices=tuple(MEASURES), help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--batch-id", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(MEASURES[args.measure](args.root, args.batch_id)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-finalize-") as tmp:
        root = args.keep or tmp
        built = reuse(root, args.tokens, args.shards) if args.keep else None
        if built is None:
            print(f"building ~{args.tokens:.0e} tokens of committed staging in {args.shards} shards under {root}")
            built = build(root, args.tokens, args.shards)
            Path(root, BUILT).write_text(json.dumps({**built, "requested": [args.tokens, args.shards]}))
        raw = in_subprocess("raw", root, built["batch_id"])
        final = in_subprocess("finalize", root, built["batch_id"])
        checked = in_subprocess("validate", root, built["batch_id"])
    raw_tps = raw["tokens"] / raw["seconds"]
    final_tps = built["tokens"] / final["seconds"]
    ratio = final_tps / raw_tps
    hash_share = final["hash_seconds"] / final["seconds"]
    print()
    print(
        f"staged tokens {built['tokens']:,} in {built['rollouts']:,} rollouts; dataset rows {final['rows']:,} "
        f"({final['trainable_rows']:,} trainable)"
    )
    print(
        f"raw pyarrow scan: {raw['seconds']:.1f}s = {raw_tps / 1e6:.1f} M tok/s (peak RSS {raw['peak_rss_gb']:.2f} GB)"
    )
    print(
        f"finalize:         {final['seconds']:.1f}s = {final_tps / 1e6:.1f} M tok/s, hashing {hash_share:.0%} "
        f"(cpu {final['cpu_seconds']:.1f}s)"
    )
    ok_ratio, ok_rss = ratio >= TARGET_RATIO, final["peak_rss_gb"] <= TARGET_RSS_GB
    print(f"finalize / raw scan = {ratio:.2f}  (target >= {TARGET_RATIO}: {'PASS' if ok_ratio else 'FAIL'})")
    print(
        f"finalize peak RSS   = {final['peak_rss_gb']:.2f} GB  (target <= {TARGET_RSS_GB}: "
        f"{'PASS' if ok_rss else 'FAIL'})"
    )
    validate_seconds = sum(checked["seconds"].values())
    share = validate_seconds / final["seconds"]
    per_suite = ", ".join(
        f"{suite} {secs:.1f}s ({checked['statuses'][suite]})" for suite, secs in checked["seconds"].items()
    )
    print(f"validate:         {validate_seconds:.1f}s (cpu {checked['cpu_seconds']:.1f}s) = {per_suite}")
    ok_share, ok_validate_rss = share <= TARGET_VALIDATE_SHARE, checked["peak_rss_gb"] <= TARGET_RSS_GB
    print(f"validate / finalize = {share:.2f}  (target <= {TARGET_VALIDATE_SHARE}: {'PASS' if ok_share else 'FAIL'})")
    print(
        f"validate peak RSS   = {checked['peak_rss_gb']:.2f} GB  (target <= {TARGET_RSS_GB}: "
        f"{'PASS' if ok_validate_rss else 'FAIL'})"
    )
    return 0 if ok_ratio and ok_rss and ok_share and ok_validate_rss else 1


MEASURES = {"raw": measure_raw_scan, "finalize": measure_finalize, "validate": measure_validate}


if __name__ == "__main__":
    raise SystemExit(main())
