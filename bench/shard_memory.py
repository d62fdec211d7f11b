"""Shard memory: peak RSS of a 2 000-rollout generate shard vs a 200-rollout one, on a FAKE engine.

A finished rollout's token sequence is released when its receipt is written, so a shard's
memory should be bounded by the rollouts in flight (``max_in_flight``), not by the shard's
size. This runs two shards of the same per-rollout shape (``guess_number``, every rollout
playing all ``--turns`` turns, ``max_in_flight`` fixed) through the real generate stage
(``generate_shard``: claim, staging, ledger, receipts, commit marker, sweep) on local disk in a
temp dir, each in a fresh subprocess so each peak RSS (``ru_maxrss``, the kernel's high-water
mark) is its own. The engine is the tests' FAKE (``FakeScriptedEngine``): no inference, it answers every
request at once with scripted text tokenized by the real bundled tokenizer.

Prints per shard: rollouts, calls, tokens, wall time, RSS before the shard (after imports and
an uncounted warm-up shard), peak RSS and the growth in between; then
peak(large) / peak(small) (target <= 1.5) and the growth per rollout. ``--tracemalloc`` adds a
third, diagnostic run of the large shard that lists what was allocated during the shard and is
still alive just before the ledger commit (the shard's high point), by source line. RSS grows
by more than that live data: allocators keep freed pages (pyarrow's default mimalloc pool most
of all; ``ARROW_DEFAULT_MEMORY_POOL=system`` compares), so the pool's own figures are printed too.

    python bench/shard_memory.py [--rollouts-small 200] [--rollouts-large 2000] [--turns 6]
                                 [--max-in-flight 64] [--tracemalloc]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.batch import Batch
from tasks.config import BatchConfig, ModelSpec
from tasks.sampling import SamplingSettings
from tests.generation.fakes import FakeScriptedEngine

TARGET_RATIO = 1.5
GROUP_SIZE = 4
MAX_TOKENS = 256
WARMUP_ROLLOUTS = 2 * GROUP_SIZE
WORDS = ("the", "secret", "is", "probably", "above", "below", "middle", "so", "I", "try", "next", "guess")


def scripted_guess(seed: int, hi: int) -> str:
    """~60 words chosen by ``seed``, ending in a guess above the game's range.

    ``guess_number`` answers "Lower." to it, so every rollout plays every turn: one shape for all.
    """
    words = " ".join(WORDS[(seed >> (2 * i)) % len(WORDS)] for i in range(60))
    return f"{words}. My guess is {hi + 1 + seed % 1000}."


def fake_engine(tokenizer: Any, *, hi: int) -> FakeScriptedEngine:
    """The FAKE engine of the tests (no inference, instant scripted replies), keeping no requests."""
    return FakeScriptedEngine(
        tokenizer, reply=lambda request: scripted_guess(request.seed, hi), max_model_len=4096, record=False
    )


def shard_config(batch_id: str, rollouts: int, turns: int, max_in_flight: int) -> BatchConfig:
    return BatchConfig(
        batch_id=batch_id,
        environment="guess_number",
        environment_options={"lo": 1, "hi": 100},
        num_tasks=rollouts // GROUP_SIZE,
        group_size=GROUP_SIZE,
        shards=1,
        model=ModelSpec(reference="fake-model"),
        sampling=SamplingSettings(temperature=1.0, max_tokens=MAX_TOKENS),
        max_turns=turns,
        max_in_flight=max_in_flight,
        seed=1234,
    )


def run_shard(root: str, config: BatchConfig, tokenizer: Any) -> tuple[Any, FakeScriptedEngine, float]:
    """Plan ``config`` and generate its one shard on a fresh fake engine; (summary, engine, seconds)."""
    from tasks.generate import generate_shard
    from tasks.plan import plan_batch

    plan_batch(Batch.open(root, config.batch_id), config)
    engine = fake_engine(tokenizer, hi=int(config.environment_options["hi"]))
    started = time.perf_counter()
    summary = generate_shard(Batch.open(root, config.batch_id), 0, engine=engine, run=asyncio.run, progress=False)
    return summary, engine, time.perf_counter() - started


def current_rss_mb() -> float:
    """Resident set size now (Linux ``/proc/self/statm``), in MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_rss_mb() -> float:
    """The process's peak resident set size so far (Linux reports ``ru_maxrss`` in KiB), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(rollouts: int, turns: int, max_in_flight: int, *, trace: bool, top: int) -> dict[str, Any]:
    """One shard of ``rollouts`` in this process (meant to be a fresh one), after an uncounted warm-up shard."""
    from tasks.models.bundled import load_bundled_tokenizer

    tokenizer = load_bundled_tokenizer()
    with tempfile.TemporaryDirectory(prefix="bench-shard-memory-") as root:
        run_shard(root, shard_config("warmup", WARMUP_ROLLOUTS, turns, max_in_flight), tokenizer)
        before = current_rss_mb()
        config = shard_config(f"shard-{rollouts}", rollouts, turns, max_in_flight)
        snapshots = _snapshot_before_commit() if trace else None
        summary, engine, seconds = run_shard(root, config, tokenizer)
    figures: dict[str, Any] = {
        "rollouts": summary.rollouts,
        "ok": summary.ok,
        "calls": summary.calls,
        "generated_tokens": summary.generated_tokens,
        "prompt_tokens": engine.prompt_tokens,
        "seconds": seconds,
        "rss_before_mb": before,
        "peak_rss_mb": peak_rss_mb(),
        "arrow_pool": _arrow_pool(),
    }
    if snapshots is not None:
        base, at_commit = snapshots
        stats = at_commit[0].compare_to(base, "lineno")
        figures["tracemalloc_top"] = [
            f"{s.size_diff / 2**20:8.2f} MiB {s.count_diff:+9d} blocks  {s.traceback[0]}" for s in stats[:top]
        ]
        figures["tracemalloc_total_mb"] = sum(s.size_diff for s in stats) / 2**20
    return figures


def _arrow_pool() -> str:
    """pyarrow's default pool: backend, bytes held now and at peak (what its allocator retains is not counted)."""
    import pyarrow as pa

    pool = pa.default_memory_pool()
    held, peak = pool.bytes_allocated() / 2**20, pool.max_memory() / 2**20
    return f"{pool.backend_name} {held:.1f} MiB held, {peak:.1f} MiB peak"


def _snapshot_before_commit() -> tuple[tracemalloc.Snapshot, list[tracemalloc.Snapshot]]:
    """Start tracing now; the returned list receives a snapshot taken just before the ledger commit.

    Diagnostic only (tracing slows the shard several-fold): wraps ``LedgerWriter.commit`` in this
    process, so the snapshot holds everything the shard still keeps at its high point.
    """
    from tasks.generate import attempt

    writer = attempt.LedgerWriter  # the ledger writer class the stage uses, wherever it lives
    original = writer.commit
    taken: list[tracemalloc.Snapshot] = []

    def commit(self: Any, **kwargs: Any) -> Any:
        taken.append(_filtered(tracemalloc.take_snapshot()))
        return original(self, **kwargs)

    writer.commit = commit  # type: ignore[method-assign]
    tracemalloc.start(1)
    return _filtered(tracemalloc.take_snapshot()), taken


def _filtered(snapshot: tracemalloc.Snapshot) -> tracemalloc.Snapshot:
    return snapshot.filter_traces(
        (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap*"))
    )


def in_subprocess(rollouts: int, args: argparse.Namespace, *, trace: bool = False) -> dict[str, Any]:
    command = [sys.executable, __file__, "--measure", str(rollouts), "--turns", str(args.turns)]
    command += ["--max-in-flight", str(args.max_in_flight), "--top", str(args.top)]
    if trace:
        command.append("--tracemalloc")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {rollouts}-rollout run failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(label: str, m: dict[str, Any]) -> None:
    tokens = m["prompt_tokens"] + m["generated_tokens"]
    print(
        f"{label}: {m['rollouts']:,} rollouts ({m['ok']:,} ok), {m['calls']:,} calls, "
        f"{m['generated_tokens']:,} generated tokens ({tokens:,} prompt + generated), {m['seconds']:.1f}s wall; "
        f"RSS before {m['rss_before_mb']:.0f} MiB, peak {m['peak_rss_mb']:.0f} MiB "
        f"(+{m['peak_rss_mb'] - m['rss_before_mb']:.0f} MiB during the shard); pyarrow pool {m['arrow_pool']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts-small", type=int, default=200, help="rollouts of the small shard (default 200)")
    parser.add_argument("--rollouts-large", type=int, default=2000, help="rollouts of the large shard (default 2000)")
    parser.add_argument("--turns", type=int, default=6, help="model calls per rollout (default 6)")
    parser.add_argument("--max-in-flight", type=int, default=64, help="rollouts in flight at once (default 64)")
    parser.add_argument(
        "--tracemalloc",
        action="store_true",
        help="also run the large shard traced and list what it still holds before the commit (default off)",
    )
    parser.add_argument("--top", type=int, default=12, help="source lines to list with --tracemalloc (default 12)")
    parser.add_argument("--measure", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.turns, args.max_in_flight, trace=args.tracemalloc, top=args.top)))
        return 0
    for name in ("rollouts_small", "rollouts_large"):
        if getattr(args, name) < GROUP_SIZE or getattr(args, name) % GROUP_SIZE:
            parser.error(f"--{name.replace('_', '-')} must be a positive multiple of the group size {GROUP_SIZE}")
    print(
        f"FAKE engine ({FakeScriptedEngine.name}: no inference, scripted replies, real tokenizer); guess_number, "
        f"{args.turns} turns per rollout, max_in_flight {args.max_in_flight}, local disk; each shard in a fresh process"
    )
    small = in_subprocess(args.rollouts_small, args)
    report("small shard", small)
    large = in_subprocess(args.rollouts_large, args)
    report("large shard", large)
    ratio = large["peak_rss_mb"] / small["peak_rss_mb"]
    growth = (large["peak_rss_mb"] - small["peak_rss_mb"]) / (large["rollouts"] - small["rollouts"] or 1)
    print(f"growth per extra rollout: {growth * 1024:.1f} KiB of peak RSS")
    ok = ratio <= TARGET_RATIO
    print(
        f"peak RSS large / small = {ratio:.2f}  ({args.rollouts_large} vs {args.rollouts_small} rollouts; "
        f"target <= {TARGET_RATIO}: {'PASS' if ok else 'FAIL'})"
    )
    if args.tracemalloc:
        traced = in_subprocess(args.rollouts_large, args, trace=True)
        print(
            f"\ntracemalloc, {traced['rollouts']:,}-rollout shard: {traced['tracemalloc_total_mb']:.1f} MiB allocated "
            "during the shard and still alive just before the ledger commit; largest by source line:"
        )
        for line in traced["tracemalloc_top"]:
            print(f"  {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
