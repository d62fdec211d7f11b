"""Staging benchmark: bytes per staged token, delta vs full-sequence storage, and write throughput.

Synthetic multi-turn rollouts (docs/architecture.md §4.1): every turn carries ~30 user/tool tokens and
samples ~170, token ids from a 49152-token vocabulary with a Zipf-like skew, processed logprobs
mostly near 0 with a negative tail (float32). Each delta is built with ``StagedDelta.build``
(all hashes) and staged through ``StagingWriter`` on local disk, turn by turn across all
rollouts; a child is built only once its parent's commit future resolved (the durability
boundary of the generate stage), so rollouts pipeline against the writer as they do there.

    python bench/staging.py [--rollouts 1000] [--turns 8 32] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.figures import print_table
from tasks.ids import call_id, rollout_id
from tasks.records import digest as dg
from tasks.records.ledger import StagedDelta
from tasks.storage.objects import ObjectStore
from tasks.storage.staging import CommitCoordinates, StagingWriter, encode_segment

VOCAB = 49152
CARRY_TOKENS = 30
SAMPLED_TOKENS = 170
TARGET_BYTES_PER_TOKEN = 6.0
TARGET_DELTA_RATIO_32 = 8.0
TARGET_THROUGHPUT_RATIO = 0.5
HASH_FUNCTIONS = (
    "chain_hash_of_encoded",
    "cumulative_hash_of_encoded",
    "digest_of_encoded_call",
    "compute_extras_digest",
)
LIST_COLUMNS = ("token_ids_delta", "token_mask_delta", "logprobs_delta")


@dataclass(frozen=True)
class Workload:
    """Every rollout's whole token sequence and sampled logprobs; calls are slices of them."""

    rollouts: int
    turns: int
    tokens: np.ndarray  # (rollouts, turns * turn_len) int64
    logprobs: np.ndarray  # (rollouts, turns * SAMPLED_TOKENS) float32

    @property
    def turn_len(self) -> int:
        return CARRY_TOKENS + SAMPLED_TOKENS


@dataclass
class StageResult:
    seconds: float
    hash_seconds: float
    tokens: int
    deltas: list[StagedDelta]
    coordinates: list[CommitCoordinates]
    segment_bytes: int
    segments: int


def make_workload(rollouts: int, turns: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, VOCAB + 1, dtype=np.float64)
    weights = 1.0 / (ranks + 2.7) ** 1.1  # Zipf-Mandelbrot-like skew over the vocabulary
    token_of_rank = rng.permutation(VOCAB)
    cdf = np.cumsum(weights / weights.sum())
    total = rollouts * turns * (CARRY_TOKENS + SAMPLED_TOKENS)
    draws = np.minimum(np.searchsorted(cdf, rng.random(total)), VOCAB - 1)
    tokens = token_of_rank[draws].astype(np.int64).reshape(rollouts, -1)
    sampled = rollouts * turns * SAMPLED_TOKENS
    # Processed logprobs: most sampled tokens are near-certain, a minority sit in a long tail.
    scale = rng.choice(np.array([0.005, 0.2, 2.0]), size=sampled, p=[0.6, 0.25, 0.15])
    logprobs = (-rng.exponential(scale)).astype(np.float32).reshape(rollouts, -1)
    return Workload(rollouts=rollouts, turns=turns, tokens=tokens, logprobs=logprobs)


def build_delta(
    work: Workload, r: int, turn: int, parent: StagedDelta | None, *, batch_id: str = "bench"
) -> StagedDelta:
    """Call ``turn`` of rollout ``r`` of ``work``, chained to ``parent`` (the rollout's call before; None for its
    first): its prompt is the sequence so far and the turn's carried tokens, its generation the turn's sampled
    tokens. ``StagedDelta.build`` computes every hash (the staging bench times it)."""
    rollout, sequence, prev = rollout_id(r, 0), work.tokens[r], turn * work.turn_len
    return StagedDelta.build(
        batch_id=batch_id,
        rollout_id=rollout,
        call_id=call_id(rollout, 0, turn),
        parent_call_id=None if parent is None else parent.call_id,
        parent_chain_hash=None if parent is None else parent.chain_hash,
        prefix_token_ids=sequence[:prev],
        prompt_token_ids=sequence[: prev + CARRY_TOKENS],
        generated_token_ids=sequence[prev + CARRY_TOKENS : prev + work.turn_len],
        generated_logprobs=work.logprobs[r, turn * SAMPLED_TOKENS : (turn + 1) * SAMPLED_TOKENS],
        weight_version=1,
        finish_reason="stop",
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
    )


@contextlib.contextmanager
def hash_timer() -> Iterator[list[float]]:
    """Accumulate the wall time spent in the digest functions ``StagedDelta.build`` calls."""
    spent = [0.0]
    originals = {name: getattr(dg, name) for name in HASH_FUNCTIONS}

    def timed(function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return wrapper

    for name, function in originals.items():
        setattr(dg, name, timed(function))
    try:
        yield spent
    finally:
        for name, function in originals.items():
            setattr(dg, name, function)


def stage(work: Workload, root: Path) -> StageResult:
    """Build and stage every call, turn by turn; timed end to end including the last write."""
    store = ObjectStore(str(root))
    previous: list[StagedDelta | None] = [None] * work.rollouts
    deltas: list[StagedDelta] = []
    futures: list[Future[CommitCoordinates]] = []
    start = time.perf_counter()
    parents: list[Future[CommitCoordinates] | None] = [None] * work.rollouts
    with hash_timer() as hashing, StagingWriter(store, shard=0, attempt=0) as writer:
        for turn in range(work.turns):
            for r in range(work.rollouts):
                parent = parents[r]
                if parent is not None:
                    parent.result()  # a child is admitted only once its parent is durable
                delta = build_delta(work, r, turn, previous[r])
                previous[r] = delta
                deltas.append(delta)
                parents[r] = writer.submit(delta)
                futures.append(parents[r])
    seconds = time.perf_counter() - start
    segments = writer.segments
    return StageResult(
        seconds=seconds,
        hash_seconds=hashing[0],
        tokens=sum(d.delta_len for d in deltas),
        deltas=deltas,
        coordinates=[f.result() for f in futures],
        segment_bytes=sum(s.object.size for s in segments),
        segments=len(segments),
    )


def writer_only_seconds(result: StageResult, root: Path) -> float:
    """Stage the already built deltas again: the writer alone (encode, write, fsync), no build."""
    start = time.perf_counter()
    with StagingWriter(ObjectStore(str(root)), shard=0, attempt=0) as writer:
        for delta in result.deltas:
            writer.submit(delta)
    return time.perf_counter() - start


def segment_rows(result: StageResult) -> list[list[int]]:
    """Indices into ``result.deltas`` of each segment's rows, in row order."""
    groups: dict[str, list[int]] = {}
    for index, coords in enumerate(result.coordinates):
        groups.setdefault(coords.segment, []).append(index)
    return list(groups.values())


def list_column(arrays: list[np.ndarray], value_type: pa.DataType) -> pa.Array:
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int32, count=len(arrays))
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int32)])
    flat = pa.array(np.concatenate(arrays), type=value_type)
    return pa.ListArray.from_arrays(pa.array(offsets), flat)


def raw_write_seconds(result: StageResult, root: Path) -> float:
    """Write the same three token arrays per segment with plain ``pq.write_table`` (zstd)."""
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for index, rows in enumerate(segment_rows(result)):
        deltas = [result.deltas[i] for i in rows]
        table = pa.table(
            {
                "token_ids_delta": list_column([d.token_ids_delta for d in deltas], pa.int64()),
                "token_mask_delta": list_column([d.token_mask_delta for d in deltas], pa.float32()),
                "logprobs_delta": list_column([d.logprobs_delta for d in deltas], pa.float32()),
            }
        )
        pq.write_table(table, root / f"raw-{index:06d}.parquet", compression="zstd")
    return time.perf_counter() - start


def full_sequence_bytes(result: StageResult, work: Workload, *, encode=encode_segment) -> int:
    """Bytes of the same segments if each row held its call's whole sequence instead of the delta."""
    total = 0
    for rows in segment_rows(result):
        deltas = [result.deltas[i] for i in rows]
        table = StagedDelta.to_table(deltas)
        ids, masks, logprobs = [], [], []
        for d in deltas:
            r = int(d.rollout_id[1:7])
            turns = d.cum_len // work.turn_len
            ids.append(work.tokens[r, : d.cum_len])
            mask = np.zeros((turns, work.turn_len), np.float32)
            mask[:, CARRY_TOKENS:] = 1.0
            lp = np.zeros((turns, work.turn_len), np.float32)
            lp[:, CARRY_TOKENS:] = work.logprobs[r, : turns * SAMPLED_TOKENS].reshape(turns, SAMPLED_TOKENS)
            masks.append(mask.ravel())
            logprobs.append(lp.ravel())
        for name, arrays, value_type in (
            ("token_ids_delta", ids, pa.int64()),
            ("token_mask_delta", masks, pa.float32()),
            ("logprobs_delta", logprobs, pa.float32()),
        ):
            position = table.schema.get_field_index(name)
            table = table.set_column(position, table.schema.field(name), list_column(arrays, value_type))
        total += len(encode(table))
    return total


def default_encoding_bytes(result: StageResult) -> int:
    """Bytes of the staged segments under pyarrow's default Parquet settings (zstd), for comparison."""
    total = 0
    for rows in segment_rows(result):
        sink = pa.BufferOutputStream()
        pq.write_table(StagedDelta.to_table([result.deltas[i] for i in rows]), sink, compression="zstd")
        total += sink.getvalue().size
    return total


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def warm_up() -> None:
    """Pay one-time costs before anything is timed: pyarrow imports pandas on its first numpy
    conversion (~0.35 s here), which would otherwise land in whichever timed path runs first."""
    with tempfile.TemporaryDirectory(prefix="bench-staging-warm-") as tmp:
        result = stage(make_workload(50, 2, seed=1), Path(tmp) / "staged")
        raw_write_seconds(result, Path(tmp) / "raw")
        writer_only_seconds(result, Path(tmp) / "writer")


def run(rollouts: int, turns_list: list[int]) -> bool:
    rows = []
    all_pass = True
    warm_up()
    for turns in turns_list:
        work = make_workload(rollouts, turns)
        with tempfile.TemporaryDirectory(prefix="bench-staging-") as tmp:
            result = stage(work, Path(tmp) / "staged")
            raw_seconds = raw_write_seconds(result, Path(tmp) / "raw")
            writer_seconds = writer_only_seconds(result, Path(tmp) / "writer")
        full_bytes = full_sequence_bytes(result, work)
        default_bytes = default_encoding_bytes(result)
        bytes_per_token = result.segment_bytes / result.tokens
        ratio_full = full_bytes / result.segment_bytes
        stage_tps = result.tokens / result.seconds
        raw_tps = result.tokens / raw_seconds
        throughput_ratio = stage_tps / raw_tps
        writer_ratio = raw_seconds / writer_seconds
        hash_share = result.hash_seconds / result.seconds
        checks = [
            ("bytes/token", f"{bytes_per_token:.2f}", f"<= {TARGET_BYTES_PER_TOKEN}", bytes_per_token <= 6.0),
            ("full/delta bytes", f"{ratio_full:.1f}x", f">= {TARGET_DELTA_RATIO_32}x" if turns >= 32 else "-", None),
            ("stage/raw tput", f"{throughput_ratio:.2f}", f">= {TARGET_THROUGHPUT_RATIO}", None),
            ("writer-only/raw tput", f"{writer_ratio:.2f}", "-", None),
            ("hashing share", f"{hash_share:.0%}", "-", None),
        ]
        if turns >= 32:
            checks[1] = (*checks[1][:3], ratio_full >= TARGET_DELTA_RATIO_32)
        checks[2] = (*checks[2][:3], throughput_ratio >= TARGET_THROUGHPUT_RATIO)
        for name, value, target, ok in checks:
            if ok is not None:
                all_pass &= ok
            rows.append((f"{turns} turns", name, value, target, "-" if ok is None else verdict(ok)))
        print(
            f"[{turns} turns] {rollouts} rollouts, {len(result.deltas)} calls, {result.tokens:,} delta tokens, "
            f"{result.segments} segments, {result.segment_bytes:,} bytes staged "
            f"(pyarrow defaults: {default_bytes / result.tokens:.2f} B/token), full sequences {full_bytes:,} bytes; "
            f"staging {stage_tps / 1e6:.2f} M tok/s in {result.seconds:.2f}s (hashing {hash_share:.0%}), "
            f"writer alone {result.tokens / writer_seconds / 1e6:.2f} M tok/s, raw pyarrow {raw_tps / 1e6:.2f} M tok/s"
        )
    print()
    print_table(("workload", "metric", "value", "target", "result"), rows)
    return all_pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=1000, help="rollouts per workload (default 1000)")
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 32], help="turns per rollout (default 8 32)")
    parser.add_argument("--quick", action="store_true", help="100 rollouts: a smoke run in a few seconds")
    args = parser.parse_args(argv)
    return 0 if run(100 if args.quick else args.rollouts, args.turns) else 1


if __name__ == "__main__":
    raise SystemExit(main())
