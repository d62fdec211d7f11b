"""The weight records of a ``rollout-ledger serve`` server, kept in the server's own process.

:class:`ServeRecords` wraps vLLM's app inside the key guard (:class:`~.auth.RequireKey`), so
its two routes need the key like every other: ``GET /rollout-ledger/weights[?since=N]`` answers
the records (:class:`~tasks.engines.weight_records.WeightRecords`, versions N and above), and
``POST /rollout-ledger/weights/next`` announces the weights the next load brings (``rollout-ledger
refit`` does, before its load: the folder and the sha256 it computed where it ran).

How the records follow the server: when the app starts, the folder it serves is hashed (in a
thread; a records request waits for it). Then the routes that pass through say what happens:
a load (:func:`is_load`) puts the announced weights in place when it succeeds, an unannounced
load when nobody announced it, a failed load when it fails (and, while generation runs, an
unannounced load from the moment it begins); ``/pause`` and ``/resume`` say whether generation
runs; :data:`VERSION_PATHS` change the version, read back from vLLM's engine. Whenever
generation runs, the weights in place join the loads of the current version.

The server hashes what a refit loaded itself: once an announced load has succeeded, it hashes the
folder the load request names (:func:`reloaded_folder`: vLLM's ``reload_weights`` through
``/collective_rpc`` names its ``weights_path``; no other load names a folder of the whole model's
weights) from its own file system, in a thread. The load keeps both hashes, and is verified
only when the server's equals the announced one for the announced folder
(:attr:`~tasks.engines.weight_records.Load.verified_sha256`): a different copy at the same path on
the server's machine, a folder rewritten between the refit's hash and the load, a load of another
folder or of no folder the server can name is recorded as declared. Until the hash is done the
load is in place as declared, and the answer of every watched route reaches the client only after
the records say what the request did: a refit's next step (``/update_weight_version``) never races
the record of its load.

Invariant: a version whose tokens came from two different weights, from weights nobody hashed,
from weights whose two hashes differ or from a failed load never has its loads all verified to one
sha256: clients take it as declared, not verified. Every record is made after vLLM acted, so a
reader racing a change sees the version without that load's record yet, or not at all: declared,
never verified by mistake.

Records live as long as the process: a restarted server starts again at version 0 with its
start-up folder, as vLLM does. One API server process keeps one set of records (vLLM's
``--api-server-count`` above 1 would split them; ``serve`` runs one).
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any
from urllib.parse import parse_qsl

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tasks.engines.weight_records import (
    ANNOUNCE_PATH,
    FAILED_LOAD,
    LOADED_AT_START,
    LOADED_BY_REFIT,
    RECORDS_PATH,
    UNANNOUNCED_LOAD,
    Announcement,
    Load,
    RecordsFormatError,
    WeightRecords,
    version_number,
)
from tasks.models.provenance import hashed_weights

RPC_PATH = "/collective_rpc"  # runs a method on every worker: reload_weights(weights_path=...) among them
RELOAD_FROM_FOLDER_KWARGS = frozenset({"weights_path", "is_checkpoint_format"})  # reload_weights reading a folder
# Routes of vLLM 0.32 that change the weights in place: a POST to any of them is a load.
LOAD_PATHS = frozenset(
    {
        RPC_PATH,
        "/start_weight_update",  # weight transfers (NCCL, IPC, ...): the weights come from a trainer, not a folder
        "/start_draft_weight_update",  # the same for a speculative decoding draft model
        "/update_weights",
        "/finish_weight_update",
        "/weight_checker",  # action "reset" resets the weights
        "/sleep",  # level 2 discards the weights
        "/wake_up",
        "/v1/load_lora_adapter",  # LoRA adapters (VLLM_ALLOW_RUNTIME_LORA_UPDATING): on top of the weights in place
        "/v1/unload_lora_adapter",
        "/adapters",  # the same through SageMaker's routes
    }
)
LORA_UNLOAD_PREFIX = "/adapters/"  # DELETE /adapters/{name}: SageMaker's LoRA unload, also a load
VERSION_PATHS = frozenset({"/update_weight_version", "/finish_weight_update"})  # they name a new version
PAUSE_PATH, RESUME_PATH = "/pause", "/resume"
MAX_ANNOUNCEMENT_BYTES = 65536


def is_load(method: str, path: str) -> bool:
    """Whether a request to ``path`` may change the weights in place."""
    return (method == "POST" and path in LOAD_PATHS) or (method == "DELETE" and path.startswith(LORA_UNLOAD_PREFIX))


class ServeRecords:
    """ASGI app around vLLM's: answers the records routes, watches the loads and RL routes, passes everything
    through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._versions: dict[int, list[Load]] = {}
        self._version = 0
        self._paused = False
        self._in_place: Load | None = None  # set once the start-up folder is hashed
        self._announced: Announcement | None = None
        self._start_up: asyncio.Future[Load] | None = None
        self._state: Any = None  # the app's state: vLLM's engine client, which knows the version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            self._start(scope)
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in (RECORDS_PATH, ANNOUNCE_PATH):
            await self._own_route(path, scope, receive, send)
        elif is_load(scope["method"], path) or (
            scope["method"] == "POST" and path in VERSION_PATHS | {PAUSE_PATH, RESUME_PATH}
        ):
            await self._watched(path, scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _start(self, scope: Scope) -> None:
        """Hash the start-up folder (vLLM's ``--model``) in a thread, once."""
        if self._start_up is not None:
            return
        self._state = getattr(scope.get("app"), "state", None)
        folder = getattr(getattr(self._state, "args", None), "model", None)
        self._start_up = asyncio.ensure_future(asyncio.to_thread(_start_up_load, folder))

    async def _weights_in_place(self) -> Load:
        """The weights in place; the first time, the start-up load (recorded as version 0's)."""
        if self._in_place is None:
            start_up = await self._start_up if self._start_up is not None else Load(LOADED_AT_START)
            if self._in_place is None:
                self._in_place = start_up
                self._generation_runs()
        return self._in_place

    def _generation_runs(self) -> None:
        """Record the weights in place among the loads of the current version, unless generation is paused."""
        if self._paused or self._in_place is None:
            return
        loads = self._versions.setdefault(self._version, [])
        if self._in_place not in loads:
            loads.append(self._in_place)

    async def _own_route(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        if path == RECORDS_PATH and scope["method"] == "GET":
            since = _since(scope)
            records = self.records(await self._weights_in_place(), since=since) if since is not None else None
            answer = (
                JSONResponse(records.to_json())
                if records is not None
                else JSONResponse({"error": "since must be an int >= 0"}, status_code=400)
            )
        elif path == ANNOUNCE_PATH and scope["method"] == "POST":
            await self._weights_in_place()
            try:
                self._announced = _announcement(await _body(receive))
                answer = JSONResponse({"announced": self._announced.to_json()})
            except RecordsFormatError as exc:
                answer = JSONResponse({"error": str(exc)}, status_code=400)
        else:
            answer = JSONResponse({"error": f"{scope['method']} {path} is not a route"}, status_code=405)
        await answer(scope, receive, send)

    def records(self, in_place: Load, *, since: int = 0) -> WeightRecords:
        """The records of versions ``since`` and above, and what is in place now."""
        versions = {version: tuple(loads) for version, loads in self._versions.items() if version >= since}
        return WeightRecords(versions, self._version, in_place, self._paused)

    async def _watched(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass a request to a load or RL route through, record what it changed, then let its answer go."""
        await self._weights_in_place()
        load = is_load(scope["method"], path)
        if load and not self._paused:  # tokens sampled from now on may come from any weights
            self._in_place = Load(UNANNOUNCED_LOAD)
            self._generation_runs()
        folder = None
        if path == RPC_PATH:
            body, receive = await _replayed(receive)
            folder = reloaded_folder(body)
        answer = _HeldAnswer(send)
        succeeded = False
        try:
            await self.app(scope, receive, answer.hold)
            succeeded = answer.status < 400
        finally:
            if load:
                await self._loaded(succeeded, folder)
        if succeeded and path in VERSION_PATHS:
            self._version = await self._served_version()
        if succeeded and path == PAUSE_PATH:
            self._paused = True
        if succeeded and path == RESUME_PATH:
            self._paused = False
        self._generation_runs()
        await answer.release()

    async def _loaded(self, succeeded: bool, folder: str | None) -> None:
        """A load that names ``folder`` (or none) ended: the announced weights are in place, hashed here, or an
        unannounced load, or what a failed load left."""
        announced, self._announced = self._announced, None
        if not succeeded:
            self._in_place = Load(FAILED_LOAD, folder=folder or (announced.folder if announced else None))
        elif announced is None:
            self._in_place = Load(UNANNOUNCED_LOAD, folder=folder)
        else:
            unhashed = Load(LOADED_BY_REFIT, None, folder, announced)
            self._in_place = unhashed  # declared until the server's hash is done
            sha = None if folder is None else await asyncio.to_thread(hashed_weights, folder)
            if self._in_place is unhashed:  # no other load ended while the folder was hashed
                self._in_place = Load(LOADED_BY_REFIT, sha, folder, announced)

    async def _served_version(self) -> int:
        """The version vLLM's engine names now (what ``/weight_info`` answers)."""
        engine = getattr(self._state, "engine_client", None)
        if engine is None:
            raise RuntimeError("the server's app has no engine client to read its weight version from")
        return version_number(await engine.get_weight_version())


class _HeldAnswer:
    """The ``send`` of a watched request: holds its answer's messages until :meth:`release`."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._messages: list[Message] = []
        self.status = 500  # until the app starts its answer

    async def hold(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        self._messages.append(message)

    async def release(self) -> None:
        for message in self._messages:
            await self._send(message)


def reloaded_folder(body: bytes) -> str | None:
    """The folder a ``/collective_rpc`` request loads: the ``weights_path`` of vLLM's ``reload_weights``; ``None``
    for another method, a reload without one (the workers reload whatever folder they loaded last) or with any
    other argument (a ``weights_iterator`` would bring weights from elsewhere)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("method") != "reload_weights" or value.get("args"):
        return None
    kwargs = value.get("kwargs")
    if not isinstance(kwargs, dict) or not set(kwargs) <= RELOAD_FROM_FOLDER_KWARGS:
        return None
    folder = kwargs.get("weights_path")
    return folder if isinstance(folder, str) and folder else None


def _start_up_load(folder: str | None) -> Load:
    """The load of the folder the server started with, hashed where it is a local folder with weights."""
    return Load(LOADED_AT_START, None if folder is None else hashed_weights(folder), folder)


def _since(scope: Scope) -> int | None:
    """The ``since`` query parameter (default 0), or ``None`` when it is not an int >= 0."""
    values = [v for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1")) if k == "since"]
    text = values[-1] if values else "0"
    return int(text) if text.isascii() and text.isdigit() else None


def _announcement(body: bytes) -> Announcement:
    """The weights an announcement names: ``{"weights_sha256": hex or null, "folder": text}``."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RecordsFormatError(f"the announcement is not JSON: {exc}") from None
    return Announcement.from_json(value)


async def _body(receive: Receive) -> bytes:
    """A request's body, refused past :data:`MAX_ANNOUNCEMENT_BYTES`."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > MAX_ANNOUNCEMENT_BYTES:
            raise RecordsFormatError(f"the announcement exceeds {MAX_ANNOUNCEMENT_BYTES} bytes")
        if not message.get("more_body"):
            return body


async def _replayed(receive: Receive) -> tuple[bytes, Receive]:
    """A request's whole body, and a ``receive`` that hands the app the same messages again."""
    messages: collections.deque[Message] = collections.deque()
    while not messages or (messages[-1]["type"] == "http.request" and messages[-1].get("more_body")):
        messages.append(await receive())
    body = b"".join(message.get("body", b"") for message in messages)

    async def replay() -> Message:
        return messages.popleft() if messages else await receive()

    return body, replay
