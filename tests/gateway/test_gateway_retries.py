"""A client's retries and a rollout's end, over real HTTP with the official ``openai`` client.

Behind the gateway is a FAKE answer (it counts the calls it is asked for and answers when the test
says so, no model): these tests are about which requests start a call. A retry of a call whose
answer never reached its client (a timeout, a dropped connection) is answered from that call; the
same body sent again on purpose is a new call; no call starts once the rollout has ended, and
:meth:`RolloutRoute.settled` waits for the calls still running.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import openai
import pytest

from tasks.gateway.app import Reply, RolloutRoute, Rollouts
from tasks.gateway.protocol import ChatRequest, GatewayError
from tasks.gateway.server import serving
from tasks.sampling import SamplingSettings

PLAN = SamplingSettings(temperature=0.8, top_p=1.0, max_tokens=32)
HELLO = [{"role": "user", "content": "hello"}]


class HeldAnswer:
    """A FAKE capture path: counts the calls it is asked for; each waits for :attr:`release`, then answers
    ``c<n>`` (or raises ``error``)."""

    def __init__(self, error: GatewayError | None = None) -> None:
        self.asked = 0
        self.finished = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.error = error

    async def __call__(self, request: ChatRequest) -> Reply:
        self.asked += 1
        number = self.asked
        self.started.set()
        await self.release.wait()
        self.finished += 1
        if self.error is not None:
            raise self.error
        return Reply(f"c{number}", f"answer {number}", [], "stop", prompt_tokens=3, completion_tokens=2)


Check = Callable[[str, RolloutRoute, Rollouts, HeldAnswer], Awaitable[None]]


def serve(check: Check, answer: HeldAnswer | None = None) -> None:
    """Serve rollout ``r1`` (4 calls) behind a :class:`HeldAnswer`; ``check(url, route, rollouts, answer)``."""

    async def main() -> None:
        held = answer or HeldAnswer()
        rollouts = Rollouts(model="m")
        route = rollouts.open("r1", sampling=PLAN, max_calls=4, answer=held)
        async with serving(rollouts) as url:
            await check(url, route, rollouts, held)

    asyncio.run(main())


def client(url: str, route: RolloutRoute, **options) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/rollouts/{route.rollout_id}/v1", api_key=route.key, **options)


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.01)


def test_a_retry_after_a_client_timeout_is_answered_from_the_call_it_repeats():
    async def check(url, route, rollouts, answer):
        retrying = client(url, route, timeout=0.3, max_retries=3)
        asking = asyncio.create_task(retrying.chat.completions.create(model="m", messages=HELLO))
        await until(lambda: answer.asked == 1)
        await asyncio.sleep(0.8)  # the first try timed out; a retry has come, or is coming
        answer.release.set()
        reply = await asking
        assert reply.id == "chatcmpl-c1" and reply.choices[0].message.content == "answer 1"
        assert (answer.asked, route.calls) == (1, 1)  # one call, whatever the number of tries

    serve(check)


class DroppingTransport(httpx.AsyncHTTPTransport):
    """Sends the first request, then drops its connection once the call was admitted (``admitted`` set)."""

    def __init__(self, admitted: asyncio.Event) -> None:
        super().__init__()
        self.admitted = admitted
        self.tries = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.tries += 1
        if self.tries > 1:
            return await super().handle_async_request(request)
        sent = asyncio.create_task(super().handle_async_request(request))
        await self.admitted.wait()
        sent.cancel()  # closes the connection, the answer unread
        with pytest.raises(asyncio.CancelledError):
            await sent
        raise httpx.ReadError("the connection dropped")


def test_a_retry_after_a_dropped_connection_is_answered_from_the_admitted_call():
    async def check(url, route, rollouts, answer):
        transport = DroppingTransport(answer.started)
        async with httpx.AsyncClient(transport=transport) as http:
            retrying = client(url, route, http_client=http)  # the default retries
            asking = asyncio.create_task(retrying.chat.completions.create(model="m", messages=HELLO))
            await until(lambda: transport.tries == 2)
            await asyncio.sleep(0.1)
            answer.release.set()
            reply = await asking
        assert reply.id == "chatcmpl-c1" and (answer.asked, route.calls) == (1, 1)

    serve(check)


def test_the_same_body_asked_again_on_purpose_is_a_new_call():
    async def check(url, route, rollouts, answer):
        once = client(url, route, max_retries=0)
        together = [asyncio.create_task(once.chat.completions.create(model="m", messages=HELLO)) for _ in range(2)]
        await until(lambda: answer.asked == 2)  # both clients wait: two calls
        answer.release.set()
        first, second = await asyncio.gather(*together)
        again = await once.chat.completions.create(model="m", messages=HELLO)  # after its answer arrived
        assert {first.id, second.id, again.id} == {"chatcmpl-c1", "chatcmpl-c2", "chatcmpl-c3"}
        assert route.calls == 3

    serve(check)


def test_a_failed_call_whose_client_left_gives_its_retry_the_same_error():
    error = GatewayError(500, "the call failed (tokenizer_error): x", kind="server_error", code="tokenizer_error")

    async def check(url, route, rollouts, answer):
        impatient = client(url, route, timeout=0.3, max_retries=0)
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(model="m", messages=HELLO)
        await until(lambda: not route.in_flight)  # the server saw the client go
        answer.release.set()
        await until(lambda: answer.finished == 1)
        with pytest.raises(openai.InternalServerError) as failed:
            await client(url, route, max_retries=0).chat.completions.create(model="m", messages=HELLO)
        assert failed.value.code == "tokenizer_error" and (answer.asked, route.calls) == (1, 1)

    serve(check, HeldAnswer(error))


def test_the_receipt_can_wait_for_a_call_whose_client_left_and_a_late_request_starts_none():
    async def check(url, route, rollouts, answer):
        impatient = client(url, route, timeout=0.3, max_retries=0)
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(model="m", messages=HELLO)
        rollouts.end("r1")  # the episode returned while its call runs on
        settled = asyncio.create_task(route.settled())
        await asyncio.sleep(0.2)
        assert not settled.done() and answer.finished == 0
        with pytest.raises(openai.BadRequestError) as late:  # even a retry of the running call
            await client(url, route, max_retries=0).chat.completions.create(model="m", messages=HELLO)
        assert late.value.code == "rollout_ended"
        answer.release.set()
        await settled
        assert (answer.asked, answer.finished, route.calls) == (1, 1, 1)

    serve(check)


def test_a_request_whose_body_arrives_after_the_rollout_ended_is_refused_and_starts_no_call():
    async def check(url, route, rollouts, answer):
        body = json.dumps({"model": "m", "messages": HELLO}).encode()
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        head = (
            f"POST /rollouts/r1/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {route.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode())  # past the route's door, the body still to come
        await writer.drain()
        await until(lambda: route.in_flight == 1)
        rollouts.end("r1")
        writer.write(body)
        await writer.drain()
        async with asyncio.timeout(10):
            answer_head = (await reader.readuntil(b"\r\n\r\n")).decode()
        writer.close()
        assert answer_head.startswith("HTTP/1.1 400") and route.calls == 0 and answer.asked == 0
        assert [r.code for r in route.refusals] == ["rollout_ended"]

    serve(check)
