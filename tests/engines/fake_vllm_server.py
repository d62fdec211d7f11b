"""A fake vLLM server for fast tests of engine ``vllm_server``: named as a fake, no model runs.

:class:`FakeVllmServer` answers the endpoints the engine reads (``/v1/models``, ``/server_info``,
``/weight_info``, ``/is_paused``) and ``/inference/v1/generate`` over real HTTP (uvicorn in a
thread), shaped like vLLM 0.32's answers: each reply is ``str(seed % 8 + 1)`` tokenized by the
REAL bundled tokenizer plus its eos token, so generate's chat templates and splicing are real.
A test sets its state (weight version, paused, identity, an ``abort`` finish, missing spans),
stops it as a killed server goes, and starts it again on the same port as a restarted one.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time
import uuid
from collections.abc import Container
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tasks.engines.weight_records import LOADED_AT_START, RECORDS_PATH, Load, WeightRecords, version_number
from tasks.models.bundled import load_tokenizer
from tasks.models.provenance import hashed_weights
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference

MODEL = resolve_model_reference(BUNDLED_REFERENCE)
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."  # vLLM's
MODEL_WEIGHTS_SHA256 = hashed_weights(MODEL)
tokenizer = functools.cache(lambda: load_tokenizer(MODEL))  # one load for every fake server of a test run


class FakeVllmServer:
    """One fake server on a loopback port; ``state`` is read at every request."""

    def __init__(self, *, weight_version: str = "default") -> None:
        self.tokenizer = tokenizer()
        self.weight_version = weight_version
        self.paused = False
        self.finish_reason: str | None = None  # an override, e.g. "abort"
        self.spans = True
        self.identity = ""
        self.delay_s = 0.0
        self.engine_dead = False  # as vLLM once its engine core is gone: calls answer 500, /health 503
        self.refuse_status: int | None = None  # calls answer this HTTP error, the server stays healthy
        self.abort_calls: Container[int] = ()  # which generate calls (1, 2, ... in arrival order) answer ``abort``
        self.generated = 0
        self.answered: dict[str, tuple[str, str, str]] = {}  # request id -> (identity, weight version, finish)
        self.sessions: list[str | None] = []
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeVllmServer:
        """Listen (again) on the port, as a new server process: a new start identity, weights named ``default``."""
        if self._server is not None:
            self.weight_version = "default"
        self.identity = str(uuid.uuid4())
        app = Starlette(
            routes=[
                Route("/v1/models", self._models),
                Route("/server_info", self._server_info),
                Route("/weight_info", self._weight_info),
                Route("/is_paused", self._is_paused),
                Route("/health", self._health),
                Route(RECORDS_PATH, self._weight_records),
                Route("/inference/v1/generate", self._generate, methods=["POST"]),
            ]
        )
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", timeout_keep_alive=30, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.02)
        return self

    @property
    def started(self) -> bool:
        """Whether it listens now."""
        return self._server is not None and self._server.started and not self._server.should_exit

    def stop(self) -> None:
        """Stop listening and drop every connection, as a killed server does."""
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._server.force_exit = True
        self._thread.join(timeout=20)

    async def _models(self, request: Request) -> JSONResponse:
        entry = {"id": str(MODEL), "root": str(MODEL), "max_model_len": 2048}
        return JSONResponse({"object": "list", "data": [entry]})

    async def _server_info(self, request: Request) -> JSONResponse:
        config = {"instance_id": self.identity, "model_config": {"logprobs_mode": "processed_logprobs"}}
        return JSONResponse({"vllm_config": config})

    async def _weight_info(self, request: Request) -> JSONResponse:
        return JSONResponse({"weight_version": self.weight_version})

    async def _is_paused(self, request: Request) -> JSONResponse:
        return JSONResponse({"is_paused": self.paused})

    async def _weight_records(self, request: Request) -> JSONResponse:
        """The weight records of a rollout-ledger serve that named its start-up weights each version it reports."""
        load = Load(LOADED_AT_START, MODEL_WEIGHTS_SHA256, str(MODEL))
        version = version_number(self.weight_version)
        return JSONResponse(WeightRecords({version: (load,)}, version, load, self.paused).to_json())

    async def _health(self, request: Request) -> Response:
        return Response(status_code=503 if self.engine_dead else 200)

    async def _generate(self, request: Request) -> JSONResponse:
        body: dict[str, Any] = await request.json()
        if self.engine_dead or self.refuse_status is not None:
            status = 500 if self.engine_dead else self.refuse_status
            error = {"message": ENGINE_DEAD_MESSAGE, "type": "InternalServerError", "param": None, "code": status}
            return JSONResponse({"error": error}, status_code=status)
        self.sessions.append(request.headers.get("x-session-id"))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.generated += 1
        sampling = body["sampling_params"]
        text = str(sampling["seed"] % 8 + 1)
        reply = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        ids = reply[: sampling["max_tokens"]]
        finish = "stop" if ids == reply else "length"
        if self.generated in self.abort_calls:
            finish = "abort"
        finish = self.finish_reason or finish
        self.answered[body["request_id"]] = (self.identity, self.weight_version, finish)
        choice = {
            "index": 0,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": ids,
            "logprobs": {"content": [{"token_id": i, "logprob": -0.5} for i in ids]},
            "weight_versions": [{"version": self.weight_version, "start": 0, "end": len(ids)}] if self.spans else None,
        }
        return JSONResponse(
            {
                "request_id": f"generate-tokens-{body['request_id']}",
                "prompt_token_ids": body["token_ids"],
                "choices": [choice],
            }
        )
