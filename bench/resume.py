"""Resume after a kill (issue 38): what finishing a killed shard costs, resumed at its turn vs restarted from turn 0.

One real vLLM engine (the bundled SmolLM2) serves every run. The workload is ``guess_number`` on
``[1, 10^12]``: its secret is practically never guessed, so every rollout runs all ``--turns`` turns
(the script checks it). For each kill point k, two batches are planned alike but for ``resume``
(``turn`` | ``restart``; it is part of the planned config, written once, so a copied batch folder
could not differ in it), in two roots under the same batch id (same rollout and call ids, same
seeds). The first attempt of each is killed the same way: the engine, wrapped, raises a
``FatalEngineCrash`` (a ``BaseException``, as a dying process does: it escapes every ``except
Exception``) once every rollout has asked for its call k+1, i.e. has k committed calls and nothing
in the engine. The two killed attempts' committed calls are compared (their cumulative token
hashes: fp32 with per-request seeds samples the same tokens). Then a new attempt of each
(``generate_shard`` again, on the same engine) finishes the shard, timed from its call to its
return; which way finishes first alternates with k.

Prints, per k: the engine calls, tokens sampled and prompt tokens sent after the kill each way
(counted at the engine), resume ÷ restart of each, next to (n-k)/n, the calls replayed and the
wall time to finish; the replay cost: each ``CallCapture.call`` answered from the book is timed
(no engine call, nothing staged), with the time to rebuild the books from storage
(``resume_points``) and a live call's for scale. Both finished batches are finalized (audit off)
and their datasets compared: same rows, ``input_ids``, ``loss_mask``, rewards and masks each way
(logprobs: the largest difference, replayed ones being the killed attempt's). Exit status 1 when
the datasets differ, a kill left rollouts at another turn, or a rollout ended early.

    python bench/resume.py [--turns 4] [--kill-at 1 2 3] [--rollouts 4] [--group-size 2] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tasks.generate.rollouts as rollouts_module
from bench.figures import percentile_ms, print_table, ratio
from bench.vllm_engine import started_engine
from tasks.batch import Batch
from tasks.capture.calls import CallCapture
from tasks.config import BatchConfig, EngineSpec, ModelSpec
from tasks.engines.background import BackgroundLoop
from tasks.engines.base import Engine, GenerationRequest, GenerationResult
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shard
from tasks.models.provenance import model_provenance
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
from tasks.plan import plan_batch
from tasks.records.dataset_row import DatasetRow
from tasks.sampling import SamplingSettings
from tasks.storage.dataset_manifest import read_dataset_part, read_staged_marker
from tasks.storage.recovery import recover_earlier_attempts
from tests.generation.fakes import DelegatingEngine, FatalEngineCrash

ENGINE_OPTIONS = {"max_model_len": 2048}
WEIGHT_VERSION = 0
SECRET_RANGE = {"lo": 1, "hi": 10**12}  # guess_number's widest: the secret is practically never found
MODES = ("turn", "restart")
IDLE_SECONDS = 10.0  # a parked kill gives up waiting for the others after this long with the engine idle


class KillAtTurn(DelegatingEngine):
    """The real engine until every rollout asks for its call ``turn + 1``; then all those calls die at once.

    A rollout asks for its next call only once its last one is staged and recorded, so at the kill
    every rollout has ``turn`` committed calls and none in the engine. Should some rollouts end
    before (a guess found), the others die once the engine has been idle for :data:`IDLE_SECONDS`.
    """

    def __init__(self, inner: Engine, turn: int, rollouts: int) -> None:
        super().__init__(inner)
        self.turn, self.rollouts = turn, rollouts
        self.asked: Counter[str] = Counter()
        self.parked = 0
        self.in_engine = 0
        self.last_answer = time.monotonic()
        self.release: asyncio.Event | None = None

    def decode(self, token_ids: Any, tokenizer: Any = None) -> str:
        return self.inner.decode(token_ids, tokenizer)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.release = self.release or asyncio.Event()
        self.asked[request.session_id or request.request_id] += 1
        if self.asked[request.session_id or request.request_id] <= self.turn:
            self.in_engine += 1
            try:
                return await self.inner.generate(request)
            finally:
                self.in_engine -= 1
                self.last_answer = time.monotonic()
        self.parked += 1
        if self.parked == self.rollouts:
            self.release.set()
        while not self.release.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), 1.0)
            if not self.in_engine and time.monotonic() - self.last_answer > IDLE_SECONDS:
                self.release.set()
        raise FatalEngineCrash(f"killed at turn {self.turn}")


class CountingEngine(DelegatingEngine):
    """The real engine, counting what is asked of it: calls, prompt tokens, sampled tokens."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner)
        self.calls = self.prompt_tokens = self.sampled_tokens = 0

    def decode(self, token_ids: Any, tokenizer: Any = None) -> str:
        return self.inner.decode(token_ids, tokenizer)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self.inner.generate(request)
        self.calls += 1
        self.prompt_tokens += len(request.prompt_token_ids)
        self.sampled_tokens += len(result.token_ids)
        return result


@dataclass
class CallTimes:
    """Seconds of every ``CallCapture.call`` (replayed or live) and of every book rebuild, while installed."""

    replayed: list[float] = field(default_factory=list)
    live: list[float] = field(default_factory=list)
    rebuilds: list[float] = field(default_factory=list)
    rebuilt_calls: int = 0


@contextlib.contextmanager
def timed_calls() -> Iterator[CallTimes]:
    """Time ``CallCapture.call`` and the generate stage's ``resume_points`` (the measured code is unchanged).

    A stepped environment renders prompts on the loop, so a replayed call never waits on anything
    else: its time is its own.
    """
    times = CallTimes()
    call, points = CallCapture.call, rollouts_module.resume_points

    async def timed_call(self: CallCapture, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        outcome = await call(self, *args, **kwargs)
        (times.replayed if outcome.replayed else times.live).append(time.perf_counter() - started)
        return outcome

    async def timed_points(unreceipted: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        found = await points(unreceipted, *args, **kwargs)
        times.rebuilds.append(time.perf_counter() - started)
        times.rebuilt_calls += sum(len(point.entries) for point in found.values())
        return found

    CallCapture.call, rollouts_module.resume_points = timed_call, timed_points  # type: ignore[method-assign]
    try:
        yield times
    finally:
        CallCapture.call, rollouts_module.resume_points = call, points  # type: ignore[method-assign]


@dataclass(frozen=True)
class Killed:
    """The killed first attempt: each unreceipted rollout's committed calls (call id → cumulative token hash)."""

    calls: dict[str, dict[str, str]]
    receipted: int


@dataclass(frozen=True)
class Finished:
    """The attempt that finished the shard after the kill, as the engine and the shard summary saw it."""

    mode: str
    seconds: float
    engine_calls: int
    sampled_tokens: int
    prompt_tokens: int
    replayed_calls: int
    resumed: int
    divergences: int
    times: CallTimes


def batch_config(args: argparse.Namespace, k: int, mode: str, model: ModelSpec) -> BatchConfig:
    return BatchConfig(
        batch_id=f"bench-resume-k{k}",
        environment="guess_number",
        environment_options=SECRET_RANGE,
        num_tasks=args.rollouts // args.group_size,
        group_size=args.group_size,
        shards=1,
        model=model,
        engine=EngineSpec(name="vllm", options=ENGINE_OPTIONS),
        sampling=SamplingSettings(temperature=1.0, max_tokens=args.max_tokens),
        max_turns=args.turns,
        max_in_flight=args.rollouts,
        weight_version=WEIGHT_VERSION,
        seed=1234,
        resume=mode,
    )


def kill(root: str, config: BatchConfig, engine: Engine, loop: BackgroundLoop, k: int) -> Killed:
    """Plan the batch and run its first attempt until the kill at turn ``k``; what it committed."""
    batch = Batch.open(root, config.batch_id)
    plan_batch(batch, config)
    killer = KillAtTurn(engine, k, config.num_tasks * config.group_size)
    try:
        generate_shard(batch, 0, engine=killer, run=loop.run, progress=False)
    except FatalEngineCrash:
        pass
    else:
        raise RuntimeError(f"{config.batch_id}: the first attempt was not killed (every rollout ended before turn {k})")
    recovery = recover_earlier_attempts(Batch.open(root, config.batch_id).store, 0, attempt=1)
    calls = {
        rollout: {c.record.call_id: c.record.cumulative_hash for c in committed}
        for rollout, committed in recovery.unreceipted.items()
    }
    return Killed(calls, len(recovery.rollouts))


def finish(root: str, config: BatchConfig, engine: Engine, loop: BackgroundLoop) -> Finished:
    """A new attempt of the killed shard, timed from ``generate_shard``'s call to its return."""
    counting = CountingEngine(engine)
    with timed_calls() as times:
        started = time.perf_counter()
        summary = generate_shard(Batch.open(root, config.batch_id), 0, engine=counting, run=loop.run, progress=False)
        seconds = time.perf_counter() - started
    if summary.attempt != 1 or summary.already_committed:
        raise RuntimeError(f"{config.batch_id}: expected attempt 1 to commit the shard, got {summary}")
    return Finished(
        mode=config.resume,
        seconds=seconds,
        engine_calls=counting.calls,
        sampled_tokens=counting.sampled_tokens,
        prompt_tokens=counting.prompt_tokens,
        replayed_calls=summary.replayed_calls,
        resumed=summary.resumed,
        divergences=summary.divergences,
        times=times,
    )


def dataset_rows(root: str, batch_id: str) -> list[DatasetRow]:
    """Finalize the batch (audit off) and read its dataset rows back, in rollout order."""
    batch = Batch.open(root, batch_id)
    finalize_batch(batch, FinalizeOptions(audit=False))
    marker = read_staged_marker(batch.store)
    assert marker is not None
    rows = [row for part in marker.parts for row in DatasetRow.from_table(read_dataset_part(batch.store, part))]
    return sorted(rows, key=lambda row: row.rollout_id)


def same_tokens(a: list[DatasetRow], b: list[DatasetRow]) -> bool:
    """Same rollouts, tokens, loss masks, rewards, sample masks and reasons, turn for turn."""
    return len(a) == len(b) and all(
        (x.rollout_id, x.reward, x.sample_mask, x.mask_reason, x.num_turns, x.prompt_len)
        == (y.rollout_id, y.reward, y.sample_mask, y.mask_reason, y.num_turns, y.prompt_len)
        and np.array_equal(x.input_ids, y.input_ids)
        and np.array_equal(x.loss_mask, y.loss_mask)
        for x, y in zip(a, b, strict=True)
    )


def logprob_difference(a: list[DatasetRow], b: list[DatasetRow]) -> float:
    return max(
        (float(np.max(np.abs(x.logprobs - y.logprobs), initial=0.0)) for x, y in zip(a, b, strict=True)),
        default=0.0,
    )


def ms(seconds: list[float], q: float) -> str:
    return f"{percentile_ms(seconds, q):.1f}" if seconds else "-"


@dataclass(frozen=True)
class KillPoint:
    """Everything measured at one k."""

    k: int
    killed_alike: bool
    at_turn: bool
    finished: dict[str, Finished]
    rows: int
    full_rows: int
    same: bool
    logprob_diff: float


def run_kill_point(
    args: argparse.Namespace, k: int, index: int, model: ModelSpec, base: str, engine: Engine, loop: BackgroundLoop
) -> KillPoint:
    configs = {mode: batch_config(args, k, mode, model) for mode in MODES}
    roots = {mode: os.path.join(base, f"k{k}-{mode}") for mode in MODES}
    killed = {mode: kill(roots[mode], configs[mode], engine, loop, k) for mode in MODES}
    alike = killed["turn"].calls == killed["restart"].calls
    at_turn = all(
        not found.receipted
        and len(found.calls) == args.rollouts
        and all(len(calls) == k for calls in found.calls.values())
        for found in killed.values()
    )
    committed = sum(len(calls) for calls in killed["turn"].calls.values())
    print(
        f"k={k}: each first attempt killed with {len(killed['turn'].calls)} rollouts unreceipted, "
        f"{committed} calls committed ({k} per rollout: {at_turn}); "
        f"the same calls (ids and token hashes) in both batches: {alike}",
        flush=True,
    )
    order = MODES if index % 2 == 0 else MODES[::-1]
    finished = {mode: finish(roots[mode], configs[mode], engine, loop) for mode in order}
    for mode in order:
        f = finished[mode]
        print(
            f"  finished resume={mode:<7} in {f.seconds:6.2f}s: {f.engine_calls} engine calls, "
            f"{f.sampled_tokens} tokens sampled, {f.replayed_calls} calls replayed ({f.resumed} rollouts resumed, "
            f"{f.divergences} divergences)",
            flush=True,
        )
    rows = {mode: dataset_rows(roots[mode], configs[mode].batch_id) for mode in MODES}
    full = sum(r.sample_mask == 1 and r.num_turns == args.turns for r in rows["turn"])
    return KillPoint(
        k=k,
        killed_alike=alike,
        at_turn=at_turn,
        finished=finished,
        rows=len(rows["turn"]),
        full_rows=full,
        same=same_tokens(rows["turn"], rows["restart"]),
        logprob_diff=logprob_difference(rows["turn"], rows["restart"]),
    )


def report(args: argparse.Namespace, points: list[KillPoint]) -> bool:
    n = args.turns
    print()
    print(f"after the kill, counted at the engine; ratio = resume=turn ÷ resume=restart; expected (n-k)/n, n={n}")
    header = ("k", "figure", "turn", "restart", "ratio", "(n-k)/n")
    rows: list[tuple[str, ...]] = []
    for p in points:
        t, r = p.finished["turn"], p.finished["restart"]
        expected = f"{(n - p.k) / n:.2f}"
        counted = (
            ("engine calls", t.engine_calls, r.engine_calls, expected),
            ("tokens sampled", t.sampled_tokens, r.sampled_tokens, expected),
            ("prompt tokens sent", t.prompt_tokens, r.prompt_tokens, "-"),
        )
        rows += [
            (str(p.k) if i == 0 else "", name, str(a), str(b), ratio(a, b), e)
            for i, (name, a, b, e) in enumerate(counted)
        ]
        rows.append(("", "calls replayed", str(t.replayed_calls), str(r.replayed_calls), "-", "-"))
        rows.append(
            ("", "wall time to finish s", f"{t.seconds:.2f}", f"{r.seconds:.2f}", ratio(t.seconds, r.seconds), "-")
        )
    print_table(header, rows)
    print()
    replayed = [s for p in points for s in p.finished["turn"].times.replayed]
    live = [s for p in points for s in p.finished["turn"].times.live]
    rebuild = sum(s for p in points for s in p.finished["turn"].times.rebuilds)
    rebuilt = sum(p.finished["turn"].times.rebuilt_calls for p in points)
    print(f"replay cost (resume=turn, every k): {len(replayed)} replayed calls, no engine call, nothing staged")
    print(
        f"  replayed call (CallCapture.call):     p50 {ms(replayed, 50)} ms  p90 {ms(replayed, 90)} ms  "
        f"max {ms(replayed, 100)} ms"
    )
    print(
        f"  books rebuilt from storage:           {rebuild * 1000:.1f} ms for {rebuilt} calls = "
        f"{rebuild * 1000 / max(1, rebuilt):.2f} ms per call (resume_points: ledger records, staged deltas, decode)"
    )
    print(
        f"  replay cost per call:                 {(sum(replayed) + rebuild) * 1000 / max(1, len(replayed)):.2f} ms "
        f"(call + rebuild share)"
    )
    print(
        f"  a live call of the same attempts:     p50 {ms(live, 50)} ms  p90 {ms(live, 90)} ms "
        f"(engine, staging, ledger; {args.rollouts} rollouts in flight)"
    )
    print()
    ok = True
    for p in points:
        print(
            f"k={p.k}: {p.rows} dataset rows each way, {p.full_rows} trainable with all {n} turns; "
            f"same dataset tokens both ways (input_ids, loss_mask, rewards, masks): {'YES' if p.same else 'NO'}; "
            f"logprobs max |turn - restart| {p.logprob_diff:.1e}"
        )
        ok = ok and p.same and p.killed_alike and p.at_turn and p.full_rows == p.rows == args.rollouts
    tokens = ", ".join(
        f"k={p.k} {ratio(p.finished['turn'].sampled_tokens, p.finished['restart'].sampled_tokens)} "
        f"(expected {(n - p.k) / n:.2f})"
        for p in points
    )
    print(f"tokens sampled after the kill, resume ÷ restart: {tokens}")
    print(f"same dataset tokens both ways at every k, kills alike and at their turn: {'PASS' if ok else 'FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=4, help="turns (model calls) of every rollout, n (default 4)")
    parser.add_argument(
        "--kill-at", type=int, nargs="+", default=None, help="turns k to kill at, 1..n-1 (default: 1, n/2, n-1)"
    )
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts in the shard, all in flight (default 4)")
    parser.add_argument("--group-size", type=int, default=2, help="rollouts per task (default 2)")
    parser.add_argument("--max-tokens", type=int, default=24, help="sampled tokens per call at most (default 24)")
    args = parser.parse_args(argv)
    kills = args.kill_at or sorted({1, args.turns // 2, args.turns - 1})
    if args.turns < 2 or any(not 1 <= k < args.turns for k in kills):
        parser.error("--turns must be at least 2 and every --kill-at in 1..turns-1")
    if args.rollouts % args.group_size:
        parser.error("--rollouts must be a multiple of --group-size")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    logging.basicConfig(level=logging.WARNING)
    folder = resolve_model_reference(BUNDLED_REFERENCE)
    model = ModelSpec(reference=BUNDLED_REFERENCE, **model_provenance(folder))
    print(
        f"guess_number on [1, 10^12] (the secret is practically never found: every rollout runs all {args.turns} "
        f"turns), {args.rollouts} rollouts in one shard, all in flight, up to {args.max_tokens} tokens a call, "
        f"fp32 with per-call seeds; killed at turn k = {', '.join(map(str, kills))}",
        flush=True,
    )
    points: list[KillPoint] = []
    engine_run = started_engine(folder, label=BUNDLED_REFERENCE, options=ENGINE_OPTIONS, weight_version=WEIGHT_VERSION)
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as base, engine_run as (engine, loop):
        for index, k in enumerate(kills):
            points.append(run_kill_point(args, k, index, model, base, engine, loop))
    return 0 if report(args, points) else 1


if __name__ == "__main__":
    raise SystemExit(main())
