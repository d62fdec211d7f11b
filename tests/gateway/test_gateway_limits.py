"""The gateway's limits over real HTTP: body bytes, messages, tools, content, concurrency, keys, refusals kept.

Behind the gateway is a FAKE answer (it echoes the last message, no model), as in
``test_gateway_http.py``. Requests a client library sends go through the official ``openai``
client; what no library sends (a lying or endless body) through raw httpx or a raw socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import openai
import pytest

from tasks.gateway.app import MAX_RECORDED_REFUSALS, Reply, RolloutRoute, Rollouts
from tasks.gateway.body import INLINE_PARSE_BYTES, parse_json
from tasks.gateway.limits import GatewayLimits
from tasks.gateway.protocol import ChatRequest
from tasks.gateway.server import serving
from tasks.generate.agent_rollouts import refusal_notes
from tasks.sampling import SamplingSettings

PLAN = SamplingSettings(temperature=0.8, top_p=1.0, max_tokens=32)
CAP = 64 * 1024  # the body cap of these tests: small, so that going past it is quick
LIMITS = GatewayLimits(max_body_bytes=CAP, max_messages=4, max_tools=2, max_message_chars=100, max_total_chars=150)
PATH = "/rollouts/{}/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]

Check = Callable[[Rollouts, str, dict[str, RolloutRoute]], Awaitable[None]]


def serve(check: Check, *, limits: GatewayLimits = LIMITS, answer=None) -> None:
    """Serve rollouts ``r1`` and ``r2`` (10 calls each) under ``limits``; ``check(rollouts, url, routes)``."""

    async def echo(request: ChatRequest) -> Reply:
        return Reply("c1", request.messages[-1]["content"][::-1], [], "stop", prompt_tokens=3, completion_tokens=2)

    async def main() -> None:
        rollouts = Rollouts(model="m")
        routes = {r: rollouts.open(r, sampling=PLAN, max_calls=10, answer=answer or echo) for r in ("r1", "r2")}
        async with serving(rollouts, limits) as url:
            await check(rollouts, url, routes)

    asyncio.run(main())


def client(url: str, rollout_id: str, key: str, **options) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/rollouts/{rollout_id}/v1", api_key=key, **options)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def raw_exchange(url: str, head: bytes, body: bytes) -> tuple[int, dict[str, str], bytes, bool]:
    """Send ``head`` and ``body`` on a raw connection, never more; the answer's status, headers, body,
    and whether the server then closed the connection."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + body)
        await writer.drain()
        async with asyncio.timeout(10):
            status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode().strip().split("\r\n")
            headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
            content = await reader.readexactly(int(headers["content-length"]))
            try:
                async with asyncio.timeout(0.2):
                    closed = await reader.read(1) == b""
            except TimeoutError:
                closed = False
        return int(status_line.split()[1]), headers, content, closed
    finally:
        writer.close()


def request_head(key: str, rollout_id: str = "r1", **headers: str) -> bytes:
    lines = [f"POST {PATH.format(rollout_id)} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {key}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_declared_body_over_the_cap_is_refused_before_a_byte_of_it_is_sent():
    async def check(rollouts, url, routes):
        # Content-Length says 100 MiB and no byte of the body follows: the 413 still comes.
        head = request_head(routes["r1"].key, Content_Type="application/json", Content_Length=str(100 * 1024 * 1024))
        status, headers, content, _ = await raw_exchange(url, head, b"")
        assert status == 413 and json.loads(content)["error"]["code"] == "request_too_large"
        assert "connection" not in headers  # a declared rest is discarded, so that a client reads its 413
        # The official client, retries on: a 413 is not retried, and reaches it as the 413 it is.
        retrying = client(url, "r1", routes["r1"].key)
        with pytest.raises(openai.APIStatusError) as refused:
            await retrying.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 2 * CAP}])
        assert refused.value.status_code == 413 and refused.value.code == "request_too_large"
        assert [r.code for r in rollouts.end("r1").refusals] == ["request_too_large"] * 2

    serve(check)


def test_a_chunked_body_is_cut_at_the_cap_and_its_connection_closed():
    async def check(rollouts, url, routes):
        # Chunks adding up to one byte past the cap, and no end of the body: the server does not wait for one.
        chunk = b"x" * 4096
        chunks = b"".join(b"%x\r\n%b\r\n" % (len(chunk), chunk) for _ in range(CAP // len(chunk)))
        chunks += b"1\r\nx\r\n"
        head = request_head(routes["r1"].key, Content_Type="application/json", Transfer_Encoding="chunked")
        status, headers, content, closed = await raw_exchange(url, head, chunks)
        assert status == 413 and json.loads(content)["error"]["code"] == "request_too_large"
        assert headers["connection"] == "close" and closed

        # An endless-looking stream through httpx: the client is stopped long before it sent it all.
        sent = 0

        async def stream() -> AsyncIterator[bytes]:
            nonlocal sent
            while sent < 256 * CAP:
                sent += len(chunk)
                yield chunk

        async with httpx.AsyncClient(timeout=10) as raw:
            try:
                answer = await raw.post(url + PATH.format("r1"), content=stream(), headers=bearer(routes["r1"].key))
                assert answer.status_code == 413  # or the reset of the closed connection reached the client first
            except httpx.TransportError:
                pass
        assert sent < 64 * CAP, sent
        assert [r.code for r in rollouts.end("r1").refusals] == ["request_too_large"] * 2

    serve(check)


@pytest.mark.parametrize(
    ("messages", "tools", "code", "param"),
    [
        (HELLO * 5, None, "too_many_messages", "messages"),
        (HELLO, [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3)], "too_many_tools", "tools"),
        ([{"role": "user", "content": "x" * 101}], None, "message_too_long", "messages"),
        ([{"role": "user", "content": "x" * 80}] * 2, None, "messages_too_long", "messages"),
    ],
)
def test_too_many_messages_or_tools_or_too_much_content_is_a_400_with_its_code(messages, tools, code, param):
    async def check(rollouts, url, routes):
        extra = {"tools": tools} if tools else {}
        with pytest.raises(openai.BadRequestError) as refused:
            await client(url, "r1", routes["r1"].key).chat.completions.create(model="m", messages=messages, **extra)
        assert (refused.value.code, refused.value.param) == (code, param)
        assert [r.code for r in rollouts.end("r1").refusals] == [code]

    serve(check)


def test_a_request_within_every_limit_is_answered():
    async def check(rollouts, url, routes):
        messages = [{"role": "user", "content": "x" * 75}, {"role": "user", "content": "y" * 75}]
        tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(2)]
        reply = await client(url, "r1", routes["r1"].key).chat.completions.create(
            model="m", messages=messages, tools=tools
        )
        assert reply.choices[0].message.content == "y" * 75

    serve(check)


def test_requests_beyond_the_concurrency_cap_get_a_429_the_client_retries():
    release = asyncio.Event()
    limits = GatewayLimits(max_concurrent_requests=2)

    async def held(request: ChatRequest) -> Reply:
        await release.wait()
        return Reply("c1", "done", [], "stop", prompt_tokens=3, completion_tokens=1)

    async def check(rollouts, url, routes):
        once = client(url, "r1", routes["r1"].key, max_retries=0)
        in_flight = [asyncio.create_task(once.chat.completions.create(model="m", messages=HELLO)) for _ in range(2)]
        await _until(lambda: routes["r1"].in_flight == 2)
        with pytest.raises(openai.RateLimitError) as busy:
            await once.chat.completions.create(model="m", messages=HELLO)
        assert busy.value.code == "too_many_concurrent_requests" and busy.value.response.headers["retry-after"] == "1"
        # Transient: with its default retries the client gets its answer once a call in flight has ended.
        retrying = asyncio.create_task(
            client(url, "r1", routes["r1"].key).chat.completions.create(model="m", messages=HELLO)
        )
        await asyncio.sleep(0.2)
        release.set()
        replies = [*(await asyncio.gather(*in_flight)), await retrying]
        assert [r.choices[0].message.content for r in replies] == ["done"] * 3
        route = rollouts.end("r1")
        assert route.in_flight == 0 and route.calls == 3
        assert {r.code for r in route.refusals} == {"too_many_concurrent_requests"}  # the retried one's first try too

    serve(check, limits=limits, answer=held)


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.01)


def test_an_unknown_rollout_id_is_answered_byte_for_byte_as_a_wrong_key():
    async def check(rollouts, url, routes):
        async with httpx.AsyncClient(base_url=url) as raw:
            answers = [
                await raw.post(PATH.format("r1"), json={"messages": HELLO}, headers=bearer(routes["r2"].key)),
                await raw.post(PATH.format("r1"), json={"messages": HELLO}, headers=bearer("guess")),
                await raw.post(PATH.format("r1"), json={"messages": HELLO}),
                await raw.post(
                    PATH.format("no-such-rollout"), json={"messages": HELLO}, headers=bearer(routes["r1"].key)
                ),
                await raw.post(PATH.format("no-such-rollout"), json={"messages": HELLO}),
                await raw.get("/rollouts/no-such-rollout/v1/models", headers=bearer(routes["r1"].key)),
                await raw.get("/rollouts/r1/v1/models", headers=bearer("guess")),
            ]
        shown = {(a.status_code, a.headers["content-type"], a.content) for a in answers}
        assert len(shown) == 1
        (status, _, content), *_ = shown
        assert status == 401 and json.loads(content)["error"]["code"] == "invalid_api_key"
        assert rollouts.auth_failures == len(answers)
        assert rollouts.end("r1").refusals == [] and rollouts.end("r2").refusals == []

    serve(check)


def test_refusals_kept_on_a_rollout_are_capped_and_the_rest_counted_for_its_receipt():
    async def check(rollouts, url, routes):
        async with httpx.AsyncClient(base_url=url, headers=bearer(routes["r1"].key)) as raw:
            for _ in range(MAX_RECORDED_REFUSALS + 8):
                answer = await raw.post(PATH.format("r1"), json={"messages": HELLO, "temperature": 2.0})
                assert answer.status_code == 400
        route = rollouts.end("r1")
        assert len(route.refusals) == MAX_RECORDED_REFUSALS and route.refusals_dropped == 8
        notes = refusal_notes(route)
        assert len(notes["refused_requests"]) == MAX_RECORDED_REFUSALS and notes["refused_requests_dropped"] == 8
        assert refusal_notes(rollouts.end("r2")) is None

    serve(check)


def test_a_body_that_is_not_json_or_nested_past_the_parser_is_a_400_invalid_json():
    async def check(rollouts, url, routes):
        async with httpx.AsyncClient(base_url=url, headers=bearer(routes["r1"].key)) as raw:
            for body in (b"{not json", b"[" * 60_000, "\u00e9".encode("latin-1")):
                answer = await raw.post(PATH.format("r1"), content=body)
                assert (answer.status_code, answer.json()["error"]["code"]) == (400, "invalid_json"), body[:10]

    serve(check)


class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor, counting what is submitted to it (``asyncio.to_thread`` runs there)."""

    submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def test_a_large_body_is_parsed_in_a_worker_thread_and_a_small_one_inline():
    small = json.dumps({"messages": HELLO}).encode()
    large = json.dumps({"messages": [{"role": "user", "content": "x" * INLINE_PARSE_BYTES}]}).encode()

    async def main() -> list[int]:
        executor = CountingExecutor(1)
        asyncio.get_running_loop().set_default_executor(executor)
        counts = []
        for body in (small, large):
            assert await parse_json(body) == json.loads(body)
            counts.append(executor.submitted)
        return counts

    assert asyncio.run(main()) == [0, 1]


@pytest.mark.parametrize("field", ["max_body_bytes", "max_messages", "max_concurrent_requests"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_limits_are_positive_integers(field, value):
    with pytest.raises(ValueError, match=field):
        GatewayLimits(**{field: value})
