"""Cost of exactness on a vLLM server: captured calls ÷ plain calls, and the server engine ÷ the in-process one.

One ``vllm serve`` of the bundled model (``rollout-ledger serve``'s launcher) answers both modes,
on the same prompts and seeds; fp32 with per-request seeds samples the same tokens whatever the
batch and whether logprobs are asked for, so both modes do the same work (the script checks the
token counts agree):

* plain: ``/inference/v1/generate`` without logprobs, the answer read as JSON and nothing kept;
* captured: engine ``vllm_server``'s call: ``processed_logprobs`` of every sampled token, the
  answer checked (ids, one logprob per token of that token, prompt ids, weight spans) and
  converted to float32, the text decoded.

At each concurrency (``--concurrency``, default 1 16 64) the modes alternate ``--runs`` times;
the script prints each mode's median generated tok/s, captured ÷ plain, and the bytes of one
answer in each mode. Then it starts the in-process engine (``vllm``) and prints the median
latency of one call at concurrency 1 through each engine and their ratio. Staging and the
ledger are measured on their own by ``bench/staging.py`` and ``bench/capture_overhead.py``.

    python bench/server_exactness.py [--runs 3] [--prompts 64] [--max-tokens 32] [--concurrency 1 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.engines import create_engine
from tasks.engines.background import BackgroundLoop
from tasks.engines.base import GenerationRequest
from tasks.engines.vllm.options import VllmOptions
from tasks.engines.vllm_server.engine import GENERATE_PATH
from tasks.engines.vllm_server.serving.launch import VllmServer, free_port
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
from tasks.sampling import SamplingSettings

TARGET_RATIO_AT_64 = 0.9
ENGINE_OPTIONS = {"max_model_len": 2048}


def requests_for(tokenizer, count: int, max_tokens: int) -> list[GenerationRequest]:
    requests = []
    for index in range(count):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me fact number {index} about the sea."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        prompt = tuple(tokenizer.encode(text, add_special_tokens=False))
        sampling = SamplingSettings(temperature=1.0, max_tokens=max_tokens)
        requests.append(GenerationRequest(f"bench-{index}", prompt, sampling, seed=index, session_id=f"r{index}"))
    return requests


def plain_body(request: GenerationRequest, served_model: str, *, logprobs: bool) -> dict:
    sampling = {"max_tokens": request.sampling.max_tokens, "seed": request.seed} | ({"logprobs": 0} if logprobs else {})
    body = {"request_id": request.request_id, "model": served_model, "token_ids": list(request.prompt_token_ids)}
    return body | {"sampling_params": sampling} | ({"return_token_ids": True} if logprobs else {})


async def plain_call(client: httpx.AsyncClient, request: GenerationRequest, served_model: str) -> tuple[int, int]:
    """One call without logprobs: (tokens generated, answer bytes)."""
    response = await client.post(GENERATE_PATH, json=plain_body(request, served_model, logprobs=False))
    response.raise_for_status()
    return len(response.json()["choices"][0]["token_ids"]), len(response.content)


async def captured_call(engine, request: GenerationRequest) -> tuple[int, int]:
    return len((await engine.generate(request)).token_ids), 0


async def timed(calls, concurrency: int) -> tuple[float, int]:
    """Seconds to run the coroutine factories ``calls`` with at most ``concurrency`` at once, and the tokens made."""
    gate = asyncio.Semaphore(concurrency)

    async def one(call):
        async with gate:
            return await call()

    started = time.perf_counter()
    results = await asyncio.gather(*(one(call) for call in calls))
    return time.perf_counter() - started, sum(tokens for tokens, _ in results)


async def compare_modes(server_url: str, key: str, args: argparse.Namespace) -> None:
    options = {"urls": [server_url], "api_key_file": args.key_file}
    engine = await create_engine("vllm_server", model_path=resolve_model_reference(BUNDLED_REFERENCE), options=options)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=server_url, headers=headers, timeout=600) as client:
        requests = requests_for(engine.tokenizer, args.prompts, args.max_tokens)
        _, plain_bytes = await plain_call(client, requests[0], engine.served_model)
        captured = await client.post(GENERATE_PATH, json=plain_body(requests[0], engine.served_model, logprobs=True))
        print(f"answer size of one call: plain {plain_bytes} B, captured {len(captured.content)} B")
        print(f"{'concurrency':>11} {'plain tok/s':>12} {'captured tok/s':>15} {'captured/plain':>15}")
        for concurrency in args.concurrency:
            plain, kept = [], []
            for _ in range(args.runs):
                seconds, plain_tokens = await timed(
                    [lambda r=r: plain_call(client, r, engine.served_model) for r in requests], concurrency
                )
                plain.append(seconds)
                seconds, tokens = await timed([lambda r=r: captured_call(engine, r) for r in requests], concurrency)
                kept.append(seconds)
                assert tokens == plain_tokens, f"the modes sampled different work: {tokens} vs {plain_tokens} tokens"
            plain_rate, captured_rate = tokens / statistics.median(plain), tokens / statistics.median(kept)
            print(f"{concurrency:>11} {plain_rate:>12.0f} {captured_rate:>15.0f} {captured_rate / plain_rate:>15.3f}")
            if concurrency == 64:
                verdict = "met" if captured_rate / plain_rate >= TARGET_RATIO_AT_64 else "NOT met"
                print(f"target captured/plain >= {TARGET_RATIO_AT_64} at concurrency 64: {verdict}")
        args.server_latency = await call_latency(engine, requests[: args.latency_calls])
    await engine.close()


async def call_latency(engine, requests: list[GenerationRequest]) -> float:
    """Median seconds of one call, one at a time."""
    seconds = []
    for request in requests:
        started = time.perf_counter()
        await engine.generate(replace(request, request_id=f"{request.request_id}-lat-{len(seconds)}"))
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each mode at each concurrency")
    parser.add_argument("--prompts", type=int, default=64, help="calls per run")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each call generates")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], help="calls in flight at once")
    parser.add_argument("--latency-calls", type=int, default=16, help="calls timed one at a time per engine")
    args = parser.parse_args(argv)
    folder = resolve_model_reference(BUNDLED_REFERENCE)
    with tempfile.TemporaryDirectory(prefix="server-exactness-") as home:
        key_file = Path(home) / "key"
        key_file.write_text("bench-key")
        args.key_file = str(key_file)
        server = VllmServer.start(
            folder,
            VllmOptions(**ENGINE_OPTIONS),
            port=free_port(),
            api_key="bench-key",
            log_path=Path(home) / "server.log",
        )
        try:
            print(f"starting a vLLM server (log {server.log_path}) ...", flush=True)
            server.wait_ready()
            asyncio.run(compare_modes(server.url, "bench-key", args))
        finally:
            server.stop()
    print("starting the in-process vLLM engine ...", flush=True)
    loop = BackgroundLoop("bench-in-process")
    engine = loop.run(create_engine("vllm", model_path=folder, options=ENGINE_OPTIONS), timeout=600)
    try:
        requests = requests_for(engine.tokenizer, args.latency_calls, args.max_tokens)
        in_process = loop.run(call_latency(engine, requests), timeout=600)
    finally:
        loop.run(engine.close(), timeout=120)
        loop.close()
    print(
        f"one call, concurrency 1: vllm_server {args.server_latency * 1000:.1f} ms, in-process vllm "
        f"{in_process * 1000:.1f} ms, vllm_server / in-process {args.server_latency / in_process:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
