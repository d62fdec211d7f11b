"""Ledger flush benchmark: call records made durable after every group commit vs every 10 s.

A crash of the generate process loses the call records buffered in the ledger since its last
flush. ``StagingWriter(on_committed=ledger.flush)`` flushes after every group commit (a crash
loses at most that commit's calls); today's generate stage flushes at most every 10 s, after a
rollout completes (``LEDGER_FLUSH_SECONDS``). Two measurements, side by side per setting:

* write: ``--calls`` calls in rollouts of ``--turns`` calls, dealt to concurrent lanes (asyncio
  tasks, as in the generate stage) that run their rollouts back to back, by default with no
  engine time: at ``--max-delay-ms`` 50 (the config's default) each commit waits for its timer,
  at 0 the writer is saturated (the hook's worst case); ``--engine-ms`` adds an engine time per
  call (exponential), which spreads the calls over more, smaller commits. A call submits its
  prebuilt delta (30 carried + 170 sampled tokens per turn, bench/staging.py's workload) and, in
  the staging writer thread once its segment is written, adds its call record to the ledger
  (CallRecorder.record's done-callback); a finished rollout adds its receipt from a worker
  thread. Figures: calls/s from the first submit to the final ledger flush, call latency (submit
  to record added), staging segments, ledger files, calls per calls file, and the calls not
  durable when the last receipt was added (what a crash then would lose).
* read: one shard of ``--read-calls`` calls staged in commits of N rows, its ledger flushed after
  every commit (one calls file per commit, receipts files as rollouts finish) vs only when 1024
  rows are buffered and at the end (what a 10 s flush gives a busy shard), both committed without
  compaction; the time to read the committed ledger through LedgerReader (checksums, rows,
  records, rollouts), median of ``--read-repeats``.
* compacted: the shard flushed after every commit once more, committed with compaction (the
  default: its small files rewritten into 1024-row files the marker names); its read time
  against both shards above, and the time its commit takes against the same commit without
  compaction (one run each).
* memory: ``--memory-calls`` call records (unique ids and hashes, rollouts of ``--turns`` calls,
  their receipts) through a LedgerWriter flushed every ``--memory-group`` calls, into a dict (the
  writer's cost, no backend's); the bytes it holds for compaction just before commit
  (``held_for_compaction``: encoded 1024-row files plus the Arrow tables since; the flush size
  changes only the tables' share), per call, and the commit's time with and without compaction.

Backends: local disk (temp dir) and a moto S3 server on loopback, started as a subprocess (its
CPU competes with the bench's on a small machine; real S3 has higher latency per PUT and GET).

    python bench/ledger_flush.py [--backends local s3] [--lanes 8 64] [--max-delay-ms 50 0]
                                 [--calls 1280] [--turns 4] [--engine-ms 0] [--repeats 3]
                                 [--read-calls 8192] [--read-groups 8 64] [--read-repeats 3]
                                 [--memory-calls 100000] [--memory-group 256]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.figures import percentile_ms, print_table, ratio
from bench.moto_s3 import moto_s3
from bench.staging import build_delta, make_workload
from tasks import layout
from tasks.errors import ObjectConflictError
from tasks.ids import call_id, group_id, rollout_id
from tasks.records.ledger import CallRecord, Receipt, StagedDelta
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.marker import MarkedFile, parse_shard_object
from tasks.storage.objects import ObjectStore, WrittenObject, sha256_hex
from tasks.storage.staging import CommitCoordinates, StagingWriter, WrittenSegment

BATCH = "bench-ledger-flush"
SHARD = 0
PERIOD_SECONDS = 10.0  # tasks.generate.rollouts.LEDGER_FLUSH_SECONDS
NEVER_MS = 3_600_000.0
MODES = ("commit", "10 s")  # flush after every group commit; every 10 s after a rollout completes


@dataclass(frozen=True)
class WriteRun:
    seconds: float
    calls: int
    latencies: list[float]
    segments: int
    files: dict[str, int]
    unflushed_at_end: int

    @property
    def calls_per_second(self) -> float:
        return self.calls / self.seconds


@dataclass(frozen=True)
class ReadRun:
    files: int
    calls_files: int
    seconds: float
    commit_seconds: float


def build_chains(rollouts: int, turns: int, seed: int = 0) -> list[list[StagedDelta]]:
    """Every rollout's chained deltas (all hashes built here, before anything is timed)."""
    work = make_workload(rollouts, turns, seed=seed)
    chains = []
    for r in range(rollouts):
        chain: list[StagedDelta] = []
        for turn in range(turns):
            chain.append(build_delta(work, r, turn, chain[-1] if chain else None, batch_id=BATCH))
        chains.append(chain)
    return chains


def receipt_of(chain: list[StagedDelta]) -> Receipt:
    return receipt_for(chain[0].rollout_id, chain[-1].call_id, len(chain))


def receipt_for(rollout: str, terminal_call: str, calls: int) -> Receipt:
    return Receipt(
        rollout_id=rollout,
        group_id=group_id(int(rollout[1:7])),
        attempt=0,
        reward=1.0,
        reward_info="{}",
        terminal_call_id=terminal_call,
        terminal_selection="declared",
        terminal_attribution_reason=None,
        status="ok",
        failure_reason=None,
        num_calls=calls,
    )


def add_call_when_staged(
    ledger: LedgerWriter, delta: StagedDelta, then: Callable[[], None] | None = None
) -> Callable[[Future[CommitCoordinates]], None]:
    """CallRecorder.record's done-callback: in the staging writer thread, the call record goes to the ledger."""

    def callback(future: Future[CommitCoordinates]) -> None:
        coordinates = future.result()
        ledger.add_call(
            CallRecord.for_staged(
                delta, staging_segment=coordinates.segment, staging_row=coordinates.row, admitted_at=1.0e9
            )
        )
        if then is not None:
            then()

    return callback


def small_files(ledger: LedgerWriter) -> list[MarkedFile]:
    """The ledger files flushes wrote (not those compaction wrote at commit)."""
    return [f for f in ledger.written_files if not parse_shard_object(f.path, SHARD).compacted]


def durable_calls(ledger: LedgerWriter) -> int:
    return sum(f.rows for f in small_files(ledger) if f.kind == "calls")


def files_by_kind(ledger: LedgerWriter) -> dict[str, int]:
    return {kind: sum(f.kind == kind for f in small_files(ledger)) for kind in layout.LEDGER_KINDS}


# --- write: staging + ledger throughput ----------------------------------------------------------


async def run_lanes(
    lanes: list[list[list[StagedDelta]]],
    staging: StagingWriter,
    ledger: LedgerWriter,
    *,
    periodic: bool,
    engine_ms: float,
) -> tuple[list[float], int]:
    """Run every lane's rollouts; the latencies of every call and the calls not durable after the last receipt.

    Each call first waits an engine time drawn from an exponential of mean ``engine_ms`` (none at 0).
    """
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    last_flush = [time.monotonic()]

    async def lane(index: int, chains: list[list[StagedDelta]]) -> None:
        rng = np.random.default_rng(index)
        for chain in chains:
            for delta in chain:
                if engine_ms:
                    await asyncio.sleep(rng.exponential(engine_ms) / 1000.0)
                done: asyncio.Future[None] = loop.create_future()
                start = time.perf_counter()
                staging.submit(
                    delta,
                    done_callback=add_call_when_staged(
                        ledger, delta, lambda done=done: loop.call_soon_threadsafe(done.set_result, None)
                    ),
                )
                await done
                latencies.append(time.perf_counter() - start)
            await asyncio.to_thread(ledger.add_receipt, receipt_of(chain))
            if periodic and time.monotonic() - last_flush[0] >= PERIOD_SECONDS:
                last_flush[0] = time.monotonic()
                await asyncio.to_thread(ledger.flush)

    async with asyncio.TaskGroup() as group:
        for index, chains in enumerate(lanes):
            group.create_task(lane(index, chains))
    calls = sum(len(chain) for chains in lanes for chain in chains)
    return latencies, calls - durable_calls(ledger)


def write_run(
    store: ObjectStore, lanes: list[list[list[StagedDelta]]], mode: str, max_delay_ms: float, engine_ms: float = 0.0
) -> WriteRun:
    """One timed run of ``lanes`` through a fresh staging writer and ledger; the ledger committed afterwards."""
    ledger = LedgerWriter(store, batch_id=BATCH, shard=SHARD, attempt=0)
    start = time.perf_counter()
    staging = StagingWriter(
        store,
        shard=SHARD,
        attempt=0,
        max_delay_ms=max_delay_ms,
        on_committed=ledger.flush if mode == "commit" else None,
    )
    with staging:
        latencies, unflushed = asyncio.run(
            run_lanes(lanes, staging, ledger, periodic=mode != "commit", engine_ms=engine_ms)
        )
    ledger.flush()
    seconds = time.perf_counter() - start
    ledger.commit(staging_segments=staging.segments)
    return WriteRun(
        seconds=seconds,
        calls=len(latencies),
        latencies=latencies,
        segments=len(staging.segments),
        files=files_by_kind(ledger),
        unflushed_at_end=unflushed,
    )


# --- read: many small ledger files vs a few big ones ---------------------------------------------


def write_read_shard(
    store: ObjectStore, chains: list[list[StagedDelta]], group: int, *, per_commit: bool, compact: bool
) -> float:
    """Stage ``chains`` turn by turn in commits of ``group`` rows, receipting rollouts as their last call lands;
    the seconds the ledger's commit took."""
    ledger = LedgerWriter(store, batch_id=BATCH, shard=SHARD, attempt=0, compact=compact)
    order = [chain[turn] for turn in range(len(chains[0])) for chain in chains]
    last = {chain[-1].call_id: chain for chain in chains}
    with StagingWriter(
        store,
        shard=SHARD,
        attempt=0,
        max_rows=group,
        max_delay_ms=NEVER_MS,
        on_committed=ledger.flush if per_commit else None,
    ) as staging:
        for begin in range(0, len(order), group):
            commit = order[begin : begin + group]
            for delta in commit:
                staging.submit(delta, done_callback=add_call_when_staged(ledger, delta))
            staging.flush()
            for delta in commit:
                if delta.call_id in last:
                    ledger.add_receipt(receipt_of(last[delta.call_id]))
    ledger.flush()
    start = time.perf_counter()
    ledger.commit(staging_segments=staging.segments)
    return time.perf_counter() - start


def read_seconds(store: ObjectStore, repeats: int) -> float:
    """Median time to read the committed ledger: LedgerReader, its records, and every rollout bundled."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        reader = LedgerReader(store, SHARD)
        rollouts = sum(1 for _ in reader.rollouts())
        times.append(time.perf_counter() - start)
        assert rollouts == len(reader.receipts)
    return statistics.median(times)


def read_run(
    store: ObjectStore, chains: list[list[StagedDelta]], group: int, per_commit: bool, repeats: int, *, compact: bool
) -> ReadRun:
    commit_seconds = write_read_shard(store, chains, group, per_commit=per_commit, compact=compact)
    marker = LedgerReader(store, SHARD).marker
    ledger_files = [f for f in marker.files if f.kind != "staging"]
    return ReadRun(
        files=len(ledger_files),
        calls_files=sum(f.kind == "calls" for f in ledger_files),
        seconds=read_seconds(store, repeats),
        commit_seconds=commit_seconds,
    )


# --- memory: what a writer holds for compaction --------------------------------------------------


@dataclass(frozen=True)
class MemoryRun:
    calls: int
    receipts: int
    small_files: int
    held_bytes: int
    commit_seconds: float
    commit_seconds_plain: float


def synthetic_calls(count: int, turns: int) -> list[CallRecord]:
    """``count`` call records in rollouts of ``turns``, each with its own ids and random digests (token-free rows
    as the ledger holds them; no staging behind them, which the ledger writer never reads). Built as trusted
    copies of two checked records: only ids, hex digests and coordinates change."""
    (chain,) = build_chains(1, 2, seed=3)
    root, child = (
        CallRecord.for_staged(
            delta, staging_segment=layout.staging_segment(SHARD, 0, 0), staging_row=0, admitted_at=1.0
        )
        for delta in chain
    )
    rng = np.random.default_rng(0)
    records = []
    for n in range(count):
        rollout, turn = rollout_id(n // turns, 0), n % turns
        digests = rng.bytes(128)
        records.append(
            CallRecord.trusted(
                vars(child if turn else root)
                | {
                    "rollout_id": rollout,
                    "call_id": call_id(rollout, 0, turn),
                    "parent_call_id": None if turn == 0 else call_id(rollout, 0, turn - 1),
                    "digest": digests[:32].hex(),
                    "chain_hash": digests[32:64].hex(),
                    "cumulative_hash": digests[64:96].hex(),
                    "extras_digest": digests[96:].hex(),
                    "staging_segment": layout.staging_segment(SHARD, 0, n // 64),
                    "staging_row": n % 64,
                    "admitted_at": 1.0e9 + n,
                }
            )
        )
    return records


class DictStore:
    """The one method a LedgerWriter calls, into a dict: the memory run measures the writer, not a backend
    (fsspec's memory:// looks a path up among every object it holds)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def write_once(self, relative: str, data: bytes) -> WrittenObject:
        created = self.objects.setdefault(relative, data) is data
        if not created and self.objects[relative] != data:
            raise ObjectConflictError(relative)
        return WrittenObject(path=relative, size=len(data), sha256=sha256_hex(data), created=created)


def memory_run(records: list[CallRecord], turns: int, group: int) -> MemoryRun:
    """The records through writers flushed every ``group`` calls, without and with compaction."""
    held = 0
    seconds: dict[bool, float] = {}
    for compact in (False, True):
        store = DictStore()
        ledger = LedgerWriter(store, batch_id=BATCH, shard=SHARD, attempt=0, compact=compact)  # type: ignore[arg-type]
        for n, record in enumerate(records, 1):
            ledger.add_call(record)
            if n % turns == 0:
                ledger.add_receipt(receipt_for(record.rollout_id, record.call_id, turns))
            if n % group == 0:
                ledger.flush()
        ledger.flush()
        if compact:
            held = ledger.held_for_compaction
        segments = [
            WrittenSegment(store.write_once(layout.staging_segment(SHARD, 0, s), b"not read"), rows=64)
            for s in range(-(-len(records) // 64))
        ]
        start = time.perf_counter()
        ledger.commit(staging_segments=segments)
        seconds[compact] = time.perf_counter() - start
        files = small_files(ledger)
    return MemoryRun(
        calls=len(records),
        receipts=len(records) // turns,
        small_files=len(files),
        held_bytes=held,
        commit_seconds=seconds[True],
        commit_seconds_plain=seconds[False],
    )


# --- backends ---------------------------------------------------------------------------------------


class Backend:
    """Fresh batch directories on one backend: a temp dir's subfolders, or a moto bucket's prefixes."""

    def __init__(self, name: str, root: str) -> None:
        self.name = name
        self.root = root

    def fresh(self) -> ObjectStore:
        url = f"{self.root}/{uuid.uuid4().hex[:12]}"
        store = ObjectStore(url, skip_instance_cache=True) if url.startswith("s3://") else ObjectStore(url)
        return store.child(layout.batch_dir(BATCH))


@contextlib.contextmanager
def backends(names: list[str]) -> Iterator[list[Backend]]:
    with contextlib.ExitStack() as stack:
        found = []
        for name in names:
            if name == "local":
                found.append(Backend(name, stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ledger-"))))
            elif name == "s3":
                found.append(Backend(name, stack.enter_context(moto_s3())))
            else:
                raise ValueError(f"unknown backend {name!r}: local or s3")
        yield found


# --- report -----------------------------------------------------------------------------------------


def write_figures(runs: dict[str, list[WriteRun]]) -> list[tuple[str, ...]]:
    """(metric, every commit, every 10 s, ratio) rows: medians over the runs; latencies pooled."""
    commit, period = runs["commit"], runs["10 s"]
    tput = [statistics.median(r.calls_per_second for r in rs) for rs in (commit, period)]
    paired = statistics.median(a.calls_per_second / b.calls_per_second for a, b in zip(commit, period, strict=True))
    rows = [("calls/s", f"{tput[0]:.0f}", f"{tput[1]:.0f}", f"{ratio(*tput)} (paired runs {paired:.2f})")]
    for q in (50, 99):
        lat = [percentile_ms([x for r in rs for x in r.latencies], q) for rs in (commit, period)]
        rows.append((f"call latency p{q} ms", f"{lat[0]:.1f}", f"{lat[1]:.1f}", ratio(*lat)))
    mid = [sorted(rs, key=lambda r: r.calls_per_second)[len(rs) // 2] for rs in (commit, period)]
    rows.append(
        ("staging segments", str(mid[0].segments), str(mid[1].segments), ratio(mid[0].segments, mid[1].segments))
    )
    files = [sum(r.files.values()) for r in mid]
    rows.append(
        ("ledger files", *(f"{f} ({r.files['calls']} calls)" for f, r in zip(files, mid, strict=True)), ratio(*files))
    )
    per_file = [r.calls / max(1, r.files["calls"]) for r in mid]
    rows.append(("calls per calls file", f"{per_file[0]:.1f}", f"{per_file[1]:.1f}", ratio(*per_file)))
    rows.append(("calls not durable at last receipt", str(mid[0].unflushed_at_end), str(mid[1].unflushed_at_end), "-"))
    return rows


def bench_writes(args: argparse.Namespace, found: list[Backend]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for backend in found:
        for lane_count in args.lanes:
            chains = build_chains(max(lane_count, args.calls // args.turns), args.turns, seed=lane_count)
            lanes = [chains[i::lane_count] for i in range(lane_count)]
            for delay in args.max_delay_ms:
                runs: dict[str, list[WriteRun]] = {mode: [] for mode in MODES}
                for repeat in range(args.repeats):  # alternate the order: drift on a noisy machine hits both
                    for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                        runs[mode].append(write_run(backend.fresh(), lanes, mode, delay, args.engine_ms))
                print(
                    f"[write {backend.name}, {lane_count} lanes, max_delay {delay:g} ms] {runs['commit'][0].calls} "
                    f"calls, {args.repeats} runs per mode; calls/s every commit "
                    + " ".join(f"{r.calls_per_second:.0f}" for r in runs["commit"])
                    + ", every 10 s "
                    + " ".join(f"{r.calls_per_second:.0f}" for r in runs["10 s"]),
                    flush=True,
                )
                setting = (backend.name, str(lane_count), f"{delay:g} ms")
                for i, figure in enumerate(write_figures(runs)):
                    rows.append((*setting, *figure) if i == 0 else ("", "", "", *figure))
    return rows


def bench_reads(args: argparse.Namespace, found: list[Backend]) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """The read table (small files vs 10 s, neither compacted) and the compacted table."""
    rows: list[tuple[str, ...]] = []
    compacted_rows: list[tuple[str, ...]] = []
    turns = args.turns
    chains = build_chains(max(1, args.read_calls // turns), turns, seed=1)
    for backend in found:
        for group in args.read_groups:
            small = read_run(backend.fresh(), chains, group, True, args.read_repeats, compact=False)
            big = read_run(backend.fresh(), chains, group, False, args.read_repeats, compact=False)
            compacted = read_run(backend.fresh(), chains, group, True, args.read_repeats, compact=True)
            print(
                f"[read {backend.name}, {len(chains) * turns} calls, {group} rows per commit] ledger files "
                f"{small.files} ({small.calls_files} calls) vs {big.files} ({big.calls_files} calls), "
                f"compacted {compacted.files} ({compacted.calls_files} calls); read {small.seconds * 1000:.0f} ms "
                f"vs {big.seconds * 1000:.0f} ms, compacted {compacted.seconds * 1000:.0f} ms",
                flush=True,
            )
            rows.append(
                (
                    backend.name,
                    str(group),
                    f"{small.files} / {big.files}",
                    f"{small.seconds * 1000:.0f}",
                    f"{big.seconds * 1000:.0f}",
                    ratio(small.seconds, big.seconds),
                    f"{(small.seconds - big.seconds) / max(1, small.files - big.files) * 1000:.2f}",
                )
            )
            compacted_rows.append(
                (
                    backend.name,
                    str(group),
                    f"{compacted.files} / {small.files} / {big.files}",
                    f"{compacted.seconds * 1000:.0f}",
                    f"{small.seconds * 1000:.0f}",
                    f"{big.seconds * 1000:.0f}",
                    ratio(compacted.seconds, small.seconds),
                    ratio(compacted.seconds, big.seconds),
                    f"{compacted.commit_seconds * 1000:.0f} / {small.commit_seconds * 1000:.0f}",
                )
            )
    return rows, compacted_rows


def bench_memory(args: argparse.Namespace) -> list[tuple[str, ...]]:
    records = synthetic_calls(args.memory_calls, args.turns)
    run = memory_run(records, args.turns, args.memory_group)
    print(
        f"[memory, {run.calls} calls, flushed every {args.memory_group}] {run.small_files} small files; "
        f"held for compaction {run.held_bytes / 2**20:.1f} MiB",
        flush=True,
    )
    return [
        ("calls / receipts", f"{run.calls} / {run.receipts}"),
        ("small ledger files", str(run.small_files)),
        ("held for compaction at commit", f"{run.held_bytes / 2**20:.1f} MiB"),
        ("held per call (receipts included)", f"{run.held_bytes / run.calls:.0f} B"),
        ("commit ms, compacting / not", f"{run.commit_seconds * 1000:.0f} / {run.commit_seconds_plain * 1000:.0f}"),
    ]


def run(args: argparse.Namespace) -> None:
    with backends(args.backends) as found:
        for backend in found:  # imports, first writes, the S3 client: untimed
            write_run(backend.fresh(), [build_chains(2, 2, seed=9)], "commit", 0.0)
        write_rows = bench_writes(args, found)
        read_rows, compacted_rows = bench_reads(args, found) if args.read_calls else ([], [])
    memory_rows = bench_memory(args) if args.memory_calls else []
    print()
    print("write: staging + ledger, ledger flushed after every group commit vs every 10 s (median of runs)")
    print_table(("backend", "lanes", "max_delay", "metric", "every commit", "every 10 s", "commit / 10 s"), write_rows)
    if read_rows:
        print()
        print("read: one shard's committed ledger, one calls file per group commit vs 1024-row files (median)")
        print_table(
            (
                "backend",
                "rows/commit",
                "ledger files (commit / 10 s)",
                "read ms (commit)",
                "read ms (10 s)",
                "commit / 10 s",
                "ms per extra file",
            ),
            read_rows,
        )
        print()
        print("compacted: the per-commit shard committed with compaction (1024-row files), against both (median)")
        print_table(
            (
                "backend",
                "rows/commit",
                "ledger files (compacted / commit / 10 s)",
                "read ms (compacted)",
                "read ms (commit)",
                "read ms (10 s)",
                "compacted / commit",
                "compacted / 10 s",
                "commit ms (compacting / not)",
            ),
            compacted_rows,
        )
    if memory_rows:
        print()
        print("memory: a writer's rows held for compaction (LedgerWriter.held_for_compaction)")
        print_table(("metric", "value"), memory_rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["local", "s3"], help="local and/or s3 (moto on loopback)")
    parser.add_argument("--lanes", type=int, nargs="+", default=[8, 64], help="concurrent submitters (default 8 64)")
    parser.add_argument(
        "--max-delay-ms", type=float, nargs="+", default=[50.0, 0.0], help="staging max_delay_ms (default 50 0)"
    )
    parser.add_argument(
        "--calls", type=int, default=1280, help="calls per write run, dealt to the lanes (default 1280)"
    )
    parser.add_argument("--turns", type=int, default=4, help="calls per rollout (default 4)")
    parser.add_argument(
        "--engine-ms", type=float, default=0.0, help="mean engine time per call, exponential (default 0: none)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="write runs per mode and setting (default 3)")
    parser.add_argument("--read-calls", type=int, default=8192, help="calls of the read shard; 0 skips (default 8192)")
    parser.add_argument("--read-groups", type=int, nargs="+", default=[8, 64], help="rows per commit (default 8 64)")
    parser.add_argument("--read-repeats", type=int, default=3, help="reads per shard (default 3)")
    parser.add_argument(
        "--memory-calls", type=int, default=100_000, help="calls of the memory run; 0 skips (default 100000)"
    )
    parser.add_argument("--memory-group", type=int, default=256, help="calls per flush in the memory run (default 256)")
    args = parser.parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
