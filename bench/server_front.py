"""What the key guard of ``rollout-ledger serve`` costs per call: guarded server ÷ the same server without it.

``serve`` needs no authenticating proxy: vLLM's ``--middleware`` hook puts
:class:`~tasks.engines.vllm_server.serving.auth.RequireKey` around vLLM's own app (the "front" is that
middleware, in the server's process, on its port). So the comparison is two servers of the bundled
model started side by side in one run: *guarded*, exactly as ``serve`` starts it, and *plain*, the
same command line and environment (the same key, which vLLM's own check still asks on ``/v1``
and ``/inference``) without ``--middleware``. Calls alternate between the two, one at a time on
one kept-alive connection each, the order swapped every round:

* ``generate``: token-in ``/inference/v1/generate``, the same prompt ids and seed, ``--max-tokens``
  tokens (the project's own kind of call);
* ``models``: ``GET /v1/models``, almost no work: the worst case for the ratio.

Prints p50 and mean ms per call of each workload on each server, guarded ÷ plain of both and the
median of each round's own ratio (robust to the load drifting during the run), then the guard's
own time per admitted request in process (around an ASGI app that does nothing). The ratios are
reported, never asserted (on a shared CPU their noise is larger than the guard).

    python bench/server_front.py [--calls 200] [--max-tokens 4] [--warmup 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.engines.vllm.options import VllmOptions
from tasks.engines.vllm_server.engine import GENERATE_PATH
from tasks.engines.vllm_server.serving.auth import RequireKey
from tasks.engines.vllm_server.serving.keys import KEY_ENV
from tasks.engines.vllm_server.serving.launch import VllmServer, free_port, server_argv, server_env
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference

KEY = "bench-key-0123456789"
OPTIONS = VllmOptions(max_model_len=2048)
PROMPT = [1, 504, 3458, 282, 260, 2254, 30, 2]  # any ids of the vocabulary: token in


def start_plain(folder: Path, port: int, log_path: Path) -> VllmServer:
    """``serve``'s server without the ``--middleware`` guard (vLLM's own key check only)."""
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    argv = server_argv(folder, OPTIONS, host="127.0.0.1", port=port, on_cpu=on_cpu)
    at = argv.index("--middleware")
    del argv[at : at + 2]
    env = server_env(OPTIONS, api_key=KEY, on_cpu=on_cpu)
    return VllmServer.launch(argv, env, url=f"http://127.0.0.1:{port}", log_path=log_path)


def workloads(model: str, max_tokens: int) -> dict[str, Callable[[httpx.Client, int], None]]:
    """Each workload's one call on a client (the round number varies the request id only)."""

    def generate(client: httpx.Client, round_: int) -> None:
        body = {"request_id": f"bench-{round_}", "model": model, "token_ids": PROMPT}
        body["sampling_params"] = {"max_tokens": max_tokens, "min_tokens": max_tokens, "seed": 7}
        answer = client.post(GENERATE_PATH, json=body).raise_for_status().json()
        assert len(answer["choices"][0]["token_ids"]) == max_tokens

    def models(client: httpx.Client, round_: int) -> None:
        client.get("/v1/models").raise_for_status()

    return {"generate": generate, "models": models}


def alternate(clients: dict[str, httpx.Client], call: Callable[[httpx.Client, int], None], calls: int, warmup: int):
    """Seconds of each call on each server, the two servers taking turns (order swapped every round)."""
    seconds: dict[str, list[float]] = {name: [] for name in clients}
    names = list(clients)
    for round_ in range(warmup + calls):
        for name in names if round_ % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            call(clients[name], round_)
            if round_ >= warmup:
                seconds[name].append(time.perf_counter() - started)
    return seconds


def guard_seconds(requests: int = 100_000) -> float:
    """Seconds :class:`RequireKey` (with the serve records it wraps) adds to one admitted ``GET /v1/models``
    (around an ASGI app that does nothing)."""
    os.environ[KEY_ENV] = KEY

    async def nothing(scope, receive, send) -> None:
        return None

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/models",
        "root_path": "",
        "headers": [(b"authorization", f"Bearer {KEY}".encode())],
    }

    async def run(app) -> float:
        started = time.perf_counter()
        for _ in range(requests):
            await app(scope, None, None)
        return time.perf_counter() - started

    guard = RequireKey(nothing)
    return (asyncio.run(run(guard)) - asyncio.run(run(nothing))) / requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls of each workload on each server")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens each generate call makes")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls first, on each server")
    args = parser.parse_args(argv)
    folder = resolve_model_reference(BUNDLED_REFERENCE)
    with tempfile.TemporaryDirectory(prefix="server-front-") as home:
        guarded = VllmServer.start(folder, OPTIONS, port=free_port(), api_key=KEY, log_path=Path(home) / "guarded.log")
        plain = start_plain(folder, free_port(), Path(home) / "plain.log")
        try:
            print(f"starting two vLLM servers (logs in {home}) ...", flush=True)
            guarded.wait_ready()
            plain.wait_ready()
            headers = {"Authorization": f"Bearer {KEY}"}
            with (
                httpx.Client(base_url=guarded.url, headers=headers, timeout=600) as through_guard,
                httpx.Client(base_url=plain.url, headers=headers, timeout=600) as straight,
            ):
                assert through_guard.get("/metrics", headers={"Authorization": ""}).status_code == 401
                assert straight.get("/metrics", headers={"Authorization": ""}).status_code == 200
                model = through_guard.get("/v1/models").raise_for_status().json()["data"][0]["id"]
                clients = {"guarded": through_guard, "plain": straight}
                print(f"{args.calls} calls per workload and server, one at a time, alternating")
                print(f"{'workload':<9} {'server':<8} {'p50 ms':>8} {'mean ms':>8}")
                for workload, call in workloads(model, args.max_tokens).items():
                    seconds = alternate(clients, call, args.calls, args.warmup)
                    for name, values in seconds.items():
                        p50, mean = statistics.median(values) * 1e3, statistics.fmean(values) * 1e3
                        print(f"{workload:<9} {name:<8} {p50:>8.2f} {mean:>8.2f}")
                    guarded_calls, plain_calls = seconds["guarded"], seconds["plain"]
                    p50_ratio = statistics.median(guarded_calls) / statistics.median(plain_calls)
                    mean_ratio = statistics.fmean(guarded_calls) / statistics.fmean(plain_calls)
                    paired = statistics.median(g / p for g, p in zip(guarded_calls, plain_calls, strict=True))
                    print(
                        f"{workload:<9} guarded ÷ plain: p50 {p50_ratio:.3f}, mean {mean_ratio:.3f}, "
                        f"median of each round's ratio {paired:.3f}"
                    )
        finally:
            guarded.stop()
            plain.stop()
    print(f"the guard itself, per admitted request: {guard_seconds() * 1e6:.2f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
