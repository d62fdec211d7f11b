"""Record factories for the storage tests, and a writer process the tests race and kill.

Run as a script (``python _writer_process.py MODE URL ...``) with the repository on
``PYTHONPATH``. Every mode prints one JSON line per step to stdout and flushes it, so the
parent test knows exactly how far the process got before it kills it.

* ``race URL PREFIX TAG SIZE [BLOCK_SIZE]``: for each ``go N`` line on stdin, write a payload
  unique to TAG and N to ``PREFIX/obj-N`` with ``write_once``; report the outcome.
* ``stage-then-hang URL SHARD ATTEMPT``: stage two rollouts through the real StagingWriter,
  report the coordinates once the segment is written, then hang before any ledger write.
* ``ledger-then-hang URL SHARD ATTEMPT``: rollout A fully receipted and flushed; rollout B's
  calls flushed (a second calls file), then hang before B's receipt is written.
* ``loop URL SHARD ATTEMPT``: two-call rollouts back to back, flushing the ledger after every
  second receipt and reporting it, until killed.
* ``compact-then-hang URL SHARD ATTEMPT``: rollouts A and B receipted, C not, the ledger flushed
  after every row; commit compacts, and the process reports the files it wrote and hangs where
  it would write the marker.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tasks import layout
from tasks.errors import ObjectConflictError
from tasks.ids import call_id, rollout_id
from tasks.records.ledger import CallRecord, FailureRow, Receipt, StagedDelta
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.objects import ObjectStore, WrittenObject
from tasks.storage.staging import CommitCoordinates, StagingWriter, WrittenSegment

BATCH = "batch-test"
EOS = 2


def make_chain(rollout: str, n_calls: int, *, attempt: int = 0, batch_id: str = BATCH) -> list[StagedDelta]:
    """``n_calls`` chained deltas of one rollout: a root, then children that carry the full prefix."""
    deltas: list[StagedDelta] = []
    tokens = np.zeros(0, dtype=np.int64)
    parent: StagedDelta | None = None
    for ordinal in range(n_calls):
        prompt = np.concatenate([tokens, np.array([100 + ordinal, 101, 102], dtype=np.int64)])
        generated = np.array([200 + ordinal, 201, EOS], dtype=np.int64)
        delta = StagedDelta.build(
            batch_id=batch_id,
            rollout_id=rollout,
            call_id=call_id(rollout, attempt, ordinal),
            parent_call_id=None if parent is None else parent.call_id,
            parent_chain_hash=None if parent is None else parent.chain_hash,
            prefix_token_ids=tokens,
            prompt_token_ids=prompt,
            generated_token_ids=generated,
            generated_logprobs=[-0.5, -0.25, -0.125],
            weight_version=1,
            finish_reason="stop",
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
        )
        deltas.append(delta)
        tokens = np.concatenate([prompt, generated])
        parent = delta
    return deltas


def make_call(delta: StagedDelta, coords: CommitCoordinates) -> CallRecord:
    return CallRecord.for_staged(delta, staging_segment=coords.segment, staging_row=coords.row, admitted_at=1.0e9)


def make_receipt(rollout: str, terminal_call: str | None, *, attempt: int = 0, status: str = "ok") -> Receipt:
    ok = status == "ok"
    return Receipt(
        rollout_id=rollout,
        group_id="g000000",
        attempt=attempt,
        reward=1.0 if ok else None,
        reward_info="{}",
        terminal_call_id=terminal_call,
        terminal_selection="declared" if terminal_call is not None else None,
        terminal_attribution_reason=None,
        status=status,
        failure_reason=None if ok else "capture_failed",
        num_calls=1,
    )


def make_failure(rollout: str, call: str, *, batch_id: str = BATCH) -> FailureRow:
    return FailureRow(
        batch_id=batch_id, rollout_id=rollout, call_id=call, parent_call_id=None, reason="staging_failed", detail="x"
    )


def stage(
    store: ObjectStore, deltas: list[StagedDelta], *, shard: int, attempt: int
) -> tuple[list[CommitCoordinates], list[WrittenSegment]]:
    """Stage ``deltas`` through the real writer; returns their coordinates and the written segments."""
    with StagingWriter(store, shard=shard, attempt=attempt) as writer:
        futures = [writer.submit(d) for d in deltas]
        coords = [f.result(timeout=60) for f in futures]
    return coords, writer.segments


def run_attempt(
    store: ObjectStore,
    shard: int,
    chains: dict[str, int],
    *,
    attempt: int,
    receipted: set[str],
    writer: LedgerWriter | None = None,
) -> tuple[LedgerWriter, list[WrittenSegment]]:
    """Stage and record ``chains`` (rollout -> number of calls) and receipt the rollouts in ``receipted``.

    Nothing is flushed or committed: the caller decides whether the attempt lives or dies.
    """
    deltas = {r: make_chain(r, n, attempt=attempt) for r, n in chains.items()}
    flat = [d for chain in deltas.values() for d in chain]
    coords, segments = stage(store, flat, shard=shard, attempt=attempt)
    writer = writer or LedgerWriter(store, batch_id=BATCH, shard=shard, attempt=attempt)
    for delta, where in zip(flat, coords, strict=True):
        writer.add_call(make_call(delta, where))
    for rollout, chain in deltas.items():
        if rollout in receipted:
            writer.add_receipt(make_receipt(rollout, chain[-1].call_id, attempt=attempt))
    return writer, segments


class WriterProcess:
    """Parent side: runs this script in ``mode`` and delivers its JSON lines through :meth:`next`."""

    def __init__(self, mode: str, *args: str) -> None:
        repo = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, __file__, mode, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ | {"PYTHONPATH": str(repo)},
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def __enter__(self) -> WriterProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Never leave a child behind, whatever the test did."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def next(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            raise TimeoutError(f"writer process said nothing for {timeout}s (exit code {self.proc.poll()})") from None

    def drain(self) -> list[dict[str, Any]]:
        """Lines already received and not yet taken."""
        lines = []
        while not self._lines.empty():
            lines.append(json.loads(self._lines.get_nowait()))
        return lines

    def kill(self) -> None:
        """SIGKILL: no cleanup, no flush, no atexit; exactly what a lost node does to a task."""
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL
        self._pump_thread.join(timeout=30)  # everything it printed before dying is now queued

    def stop(self) -> None:
        """Ask the ``race`` loop to end and wait for it."""
        if self.proc.poll() is None:
            self.send("quit")
        self.proc.wait(timeout=30)


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _hang() -> None:
    while True:
        time.sleep(60)


def race(url: str, prefix: str, tag: str, size: int, block_size: int | None) -> None:
    options = {"skip_instance_cache": True, "fixed_upload_size": True} if url.startswith("s3://") else {}
    store = ObjectStore(url, block_size=block_size, **options)
    _say(ready=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            return
        round_no = int(line.split()[1])
        seed = hashlib.sha256(f"{tag}-{round_no}".encode()).digest()
        payload = (seed * (size // len(seed) + 1))[:size]
        start = time.time()
        try:
            outcome = "created" if store.write_once(f"{prefix}/obj-{round_no}", payload).created else "identical"
        except ObjectConflictError:
            outcome = "conflict"
        _say(round=round_no, outcome=outcome, sha256=hashlib.sha256(payload).hexdigest(), start=start, end=time.time())


def stage_then_hang(url: str, shard: int, attempt: int) -> None:
    store = ObjectStore(url)
    deltas = [d for i in range(2) for d in make_chain(rollout_id(i, 0), 2, attempt=attempt)]
    coords, segments = stage(store, deltas, shard=shard, attempt=attempt)
    _say(staged=[c.segment for c in coords], segments=[s.object.path for s in segments])
    _hang()


def ledger_then_hang(url: str, shard: int, attempt: int) -> None:
    store = ObjectStore(url)
    a, b = rollout_id(0, 0), rollout_id(0, 1)
    chain_a, chain_b = make_chain(a, 2, attempt=attempt), make_chain(b, 2, attempt=attempt)
    staging = StagingWriter(store, shard=shard, attempt=attempt)
    ledger = LedgerWriter(store, batch_id=BATCH, shard=shard, attempt=attempt)

    def stage_and_record(deltas: list[StagedDelta]) -> None:
        futures = [staging.submit(d) for d in deltas]
        staging.flush()
        for delta, future in zip(deltas, futures, strict=True):
            ledger.add_call(make_call(delta, future.result()))

    stage_and_record([*chain_a, chain_b[0]])
    ledger.add_receipt(make_receipt(a, chain_a[-1].call_id, attempt=attempt))
    ledger.flush()
    _say(receipted=a)
    # B's second call lands in a later segment and a later calls file; the process dies before B's receipt.
    stage_and_record([chain_b[1]])
    ledger.flush()
    _say(unreceipted=b, files=[f.path for f in ledger.written_files])
    _hang()


def loop(url: str, shard: int, attempt: int) -> None:
    """Run two-call rollouts one after another until killed; report each explicit flush."""
    store = ObjectStore(url)
    staging = StagingWriter(store, shard=shard, attempt=attempt, max_delay_ms=1.0)
    ledger = LedgerWriter(store, batch_id=BATCH, shard=shard, attempt=attempt, max_rows=3)
    for task in range(1_000_000):
        rollout = rollout_id(task, 0)
        chain = make_chain(rollout, 2, attempt=attempt)
        for delta in chain:
            ledger.add_call(make_call(delta, staging.submit(delta).result()))
        ledger.add_receipt(make_receipt(rollout, chain[-1].call_id, attempt=attempt))
        if task % 2:
            ledger.flush()
            _say(durable_through=task)


class _HangAtMarker:
    """Forwards to a store; at the shard marker's write, reports every object written and hangs."""

    def __init__(self, inner: ObjectStore, shard: int) -> None:
        self.inner = inner
        self.shard = shard
        self.written: list[str] = []

    def write_once(self, relative: str, data: bytes) -> WrittenObject:
        if relative == layout.shard_marker(self.shard):
            _say(written=self.written)
            _hang()
        self.written.append(relative)
        return self.inner.write_once(relative, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def compact_then_hang(url: str, shard: int, attempt: int) -> None:
    store = ObjectStore(url)
    ledger = LedgerWriter(_HangAtMarker(store, shard), batch_id=BATCH, shard=shard, attempt=attempt, max_rows=2)  # type: ignore[arg-type]
    chains = {rollout_id(0, n): make_chain(rollout_id(0, n), 2, attempt=attempt) for n in range(3)}
    flat = [d for chain in chains.values() for d in chain]
    coords, segments = stage(store, flat, shard=shard, attempt=attempt)
    for delta, where in zip(flat, coords, strict=True):
        ledger.add_call(make_call(delta, where))
        ledger.flush()
        if delta.rollout_id != rollout_id(0, 2) and delta is chains[delta.rollout_id][-1]:
            ledger.add_receipt(make_receipt(delta.rollout_id, delta.call_id, attempt=attempt))
            ledger.flush()
    ledger.commit(staging_segments=segments)


if __name__ == "__main__":
    mode, url, *rest = sys.argv[1:]
    if mode == "race":
        race(url, rest[0], rest[1], int(rest[2]), int(rest[3]) if len(rest) > 3 else None)
    elif mode == "stage-then-hang":
        stage_then_hang(url, int(rest[0]), int(rest[1]))
    elif mode == "ledger-then-hang":
        ledger_then_hang(url, int(rest[0]), int(rest[1]))
    elif mode == "loop":
        loop(url, int(rest[0]), int(rest[1]))
    elif mode == "compact-then-hang":
        compact_then_hang(url, int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
