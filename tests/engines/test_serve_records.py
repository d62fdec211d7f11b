"""The weight records of ``rollout-ledger serve`` (:class:`ServeRecords`, inside the key guard) over a fake vLLM.

The fake answers the RL routes as vLLM does (a status per route, a weight version the "engine"
reports), so each test drives the sequence a refit, a failed refit, a forged or stale announcement,
a trainer's own load or a version rename sends, and reads what the records say of each version
(the server hashes the folders it loads: real folders under the test's temporary directory). The
real server is in ``test_vllm_server_refit.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tasks.engines.vllm_server.serving import records as serve_records
from tasks.engines.vllm_server.serving.auth import RequireKey
from tasks.engines.vllm_server.serving.keys import KEY_ENV
from tasks.engines.vllm_server.serving.records import RPC_PATH
from tasks.engines.weight_records import (
    ANNOUNCE_PATH,
    FAILED_LOAD,
    LOADED_AT_START,
    LOADED_BY_REFIT,
    RECORDS_PATH,
    UNANNOUNCED_LOAD,
    Announcement,
    Load,
    WeightRecords,
)
from tasks.models.provenance import hashed_weights
from tests.engines.fake_asgi import request_body

KEY = "records-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OTHER_SHA = "ab" * 32  # the sha256 of no folder here: a forged announcement


class FakeEngine:
    """vLLM's engine client as the records read it: the weight version it reports."""

    def __init__(self) -> None:
        self.version = "default"

    async def get_weight_version(self) -> str:
        return self.version


class FakeVllm:
    """vLLM's app: answers every route 200 (``fail`` names routes that answer 500); ``/update_weight_version``
    sets the engine's version from its body."""

    def __init__(self, folder: Path) -> None:
        self.engine = FakeEngine()
        self.state = SimpleNamespace(args=SimpleNamespace(model=str(folder)), engine_client=self.engine)
        self.fail: set[str] = set()
        self.answered: list[str] = []  # the paths it answered, in order

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return
        body = await request_body(receive)
        if scope["path"] == "/update_weight_version":
            self.engine.version = json.loads(body)["new_version"]
        status = 500 if scope["path"] in self.fail else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        self.answered.append(scope["path"])


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights of the start-up folder")
    return model


@pytest.fixture
def step(tmp_path: Path) -> Path:
    """A refit's folder: other weights than the start-up folder's."""
    model = tmp_path / "step"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights of a training step")
    return model


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, folder: Path):
    """(the fake vLLM app, a running loop's client of the guarded app after its lifespan started)."""
    monkeypatch.setenv(KEY_ENV, KEY)
    vllm = FakeVllm(folder)
    guard = RequireKey(vllm)
    return vllm, guard


async def _started(guard: RequireKey, vllm: FakeVllm) -> httpx.AsyncClient:
    async def receive():
        return {"type": "lifespan.startup"}

    async def send(message):
        return None

    await guard({"type": "lifespan", "app": vllm}, receive, send)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://server", headers=AUTH)


async def _records(client: httpx.AsyncClient, **params) -> WeightRecords:
    answer = await client.get(RECORDS_PATH, params=params)
    answer.raise_for_status()
    return WeightRecords.from_json(answer.json())


def _reload(folder: Path | str) -> dict[str, object]:
    """vLLM's reload of ``folder`` through ``/collective_rpc``, as rollout-ledger refit sends it."""
    return {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}


async def _refit(client: httpx.AsyncClient, version: int, folder: Path, sha: str | None = None) -> None:
    """The calls of rollout-ledger refit, in its order (each must pass: the fake answers 200); ``sha``: the sha256
    it announces (default: the folder's)."""
    announced = hashed_weights(folder) if sha is None else sha
    for path, body in (
        ("/pause", None),
        (ANNOUNCE_PATH, {"weights_sha256": announced, "folder": str(folder)}),
        (RPC_PATH, _reload(folder)),
        ("/update_weight_version", {"new_version": str(version)}),
        ("/reset_prefix_cache", None),
        ("/resume", None),
    ):
        (await client.post(path, json=body)).raise_for_status()


def test_the_start_up_folder_is_hashed_and_is_version_0s_one_load(server, folder) -> None:
    vllm, guard = server

    async def run() -> WeightRecords:
        async with await _started(guard, vllm) as client:
            return await _records(client)

    records = asyncio.run(run())
    start_up = Load(LOADED_AT_START, hashed_weights(folder), str(folder))
    assert records.versions == {0: (start_up,)} and records.serving == start_up and not records.paused
    assert records.sha256_of(0) == hashed_weights(folder) and records.sha256_of(1) is None


def test_a_refit_names_its_version_with_the_weights_the_server_hashed_and_leaves_earlier_versions_alone(
    server, folder, step
) -> None:
    vllm, guard = server

    async def run() -> tuple[WeightRecords, WeightRecords]:
        async with await _started(guard, vllm) as client:
            await _refit(client, 1, step)
            return await _records(client), await _records(client, since=1)

    records, since_1 = asyncio.run(run())
    sha = hashed_weights(step)
    assert records.sha256_of(0) == hashed_weights(folder)
    assert records.versions[1] == (Load(LOADED_BY_REFIT, sha, str(step), Announcement(sha, str(step))),)
    assert records.sha256_of(1) == sha and records.serving_version == 1
    assert set(since_1.versions) == {1}


def test_a_forged_announcement_is_recorded_declared_with_both_hashes(server, step) -> None:
    """The key holder announces a sha256 that is not the folder's: the server's own hash of the folder disagrees."""
    vllm, guard = server

    async def run() -> WeightRecords:
        async with await _started(guard, vllm) as client:
            await _refit(client, 1, step, sha=OTHER_SHA)
            return await _records(client)

    records = asyncio.run(run())
    forged = Load(LOADED_BY_REFIT, hashed_weights(step), str(step), Announcement(OTHER_SHA, str(step)))
    assert records.versions[1] == (forged,) and records.serving == forged
    assert forged.verified_sha256 is None and records.sha256_of(1) is None


def test_a_folder_rewritten_between_the_refits_hash_and_the_load_is_declared(server, step) -> None:
    vllm, guard = server
    hashed_before = hashed_weights(step)

    async def run() -> WeightRecords:
        async with await _started(guard, vllm) as client:
            await client.post("/pause")
            await client.post(ANNOUNCE_PATH, json={"weights_sha256": hashed_before, "folder": str(step)})
            (step / "model.safetensors").write_bytes(b"weights written after the refit hashed the folder")
            await client.post(RPC_PATH, json=_reload(step))
            await client.post("/update_weight_version", json={"new_version": "1"})
            await client.post("/resume")
            return await _records(client)

    records = asyncio.run(run())
    ((load,),) = [records.versions[1]]
    assert load.announced == Announcement(hashed_before, str(step))
    assert load.weights_sha256 == hashed_weights(step) != hashed_before and records.sha256_of(1) is None


@pytest.mark.parametrize(
    ("what", "request_"),
    [
        ("another folder than the announced one", ("POST", RPC_PATH, "start-up folder")),
        ("reload_weights naming no folder", ("POST", RPC_PATH, {"method": "reload_weights"})),
        ("another worker method", ("POST", RPC_PATH, {"method": "load_model"})),
        (
            "weights from elsewhere",
            ("POST", RPC_PATH, {"method": "reload_weights", "kwargs": {"weights_path": "x", "weights_iterator": "y"}}),
        ),
        ("a weight transfer", ("POST", "/update_weights", {"update_info": {}})),
    ],
)
def test_an_announced_load_of_another_folder_or_of_none_the_server_can_name_is_declared(
    server, folder, what, request_
) -> None:
    """The announcement names the start-up folder's sha256 under another name: even equal hashes do not verify a
    load of another folder, and a load that names no folder gives the server nothing to hash."""
    vllm, guard = server
    method, path, body = request_
    body = _reload(folder) if body == "start-up folder" else body
    announced = Announcement(hashed_weights(folder), "/models/announced")

    async def run() -> WeightRecords:
        async with await _started(guard, vllm) as client:
            await client.post("/pause")
            await client.post(ANNOUNCE_PATH, json=announced.to_json())
            await client.request(method, path, json=body)
            return await _records(client)

    serving = asyncio.run(run()).serving
    named = str(folder) if body == _reload(folder) else None
    assert serving == Load(LOADED_BY_REFIT, named and hashed_weights(folder), named, announced), what
    assert serving.verified_sha256 is None, what


def test_a_failed_load_leaves_failed_weights_in_place_and_never_verifies_a_version_served_on_them(server, folder):
    vllm, guard = server
    vllm.fail = {"/collective_rpc"}

    async def run() -> tuple[WeightRecords, WeightRecords]:
        async with await _started(guard, vllm) as client:
            await client.post("/pause")
            await client.post(ANNOUNCE_PATH, json={"weights_sha256": OTHER_SHA, "folder": "/models/broken"})
            assert (await client.post("/collective_rpc", json={})).status_code == 500
            failed = await _records(client)
            await client.post("/resume")  # someone resumes the paused server by hand
            return failed, await _records(client)

    failed, resumed = asyncio.run(run())
    assert failed.paused and failed.serving == Load(FAILED_LOAD, folder="/models/broken")
    assert failed.sha256_of(0) == hashed_weights(folder)  # paused: nothing was sampled on the failed load
    assert resumed.versions[0][-1].loaded_by == FAILED_LOAD and resumed.sha256_of(0) is None


def test_weights_loaded_through_vllms_own_routes_are_never_verified(server, folder) -> None:
    """A trainer's own load while generation runs: its version had several weights, none hashed by anyone."""
    vllm, guard = server

    async def run() -> WeightRecords:
        async with await _started(guard, vllm) as client:
            await client.post("/update_weights", json={"update_info": {}})
            await client.post("/update_weight_version", json={"new_version": "2"})
            return await _records(client)

    records = asyncio.run(run())
    assert [load.loaded_by for load in records.versions[0]] == [LOADED_AT_START, UNANNOUNCED_LOAD]
    assert records.versions[2] == (Load(UNANNOUNCED_LOAD),)
    assert records.sha256_of(0) is None and records.sha256_of(2) is None


def test_an_announcement_names_only_the_next_load_and_a_rename_keeps_the_weights(server, step) -> None:
    vllm, guard = server

    async def run() -> WeightRecords:
        async with await _started(guard, vllm) as client:
            await _refit(client, 1, step)
            await client.post("/update_weight_version", json={"new_version": "3"})  # a new name, the same weights
            await client.post("/pause")
            await client.post(RPC_PATH, json=_reload(step))  # not announced
            await client.post("/update_weight_version", json={"new_version": "4"})
            await client.post("/resume")
            return await _records(client)

    records = asyncio.run(run())
    sha = hashed_weights(step)
    assert records.sha256_of(1) == sha and records.sha256_of(3) == sha
    assert records.versions[4] == (Load(UNANNOUNCED_LOAD, folder=str(step)),) and records.sha256_of(4) is None


@pytest.mark.parametrize(
    ("method", "path"),
    [
        *(
            ("POST", path)
            for path in (
                "/collective_rpc",
                "/start_weight_update",
                "/start_draft_weight_update",
                "/update_weights",
                "/finish_weight_update",
                "/weight_checker",
                "/sleep",
                "/wake_up",
                "/v1/load_lora_adapter",
                "/v1/unload_lora_adapter",
                "/adapters",
            )
        ),
        ("DELETE", "/adapters/an-adapter"),
    ],
)
def test_every_route_of_vllm_that_changes_the_weights_is_a_load(server, folder, method, path) -> None:
    """vLLM 0.32's routes that change the weights in place (RL weight transfers, a draft model's, reload and
    reset, sleep, LoRA adapters through vLLM's and SageMaker's routes): while generation runs, one makes its
    version's weights declared."""
    vllm, guard = server

    async def run() -> WeightRecords:
        async with await _started(guard, vllm) as client:
            assert (await client.request(method, path, json={})).status_code == 200
            return await _records(client)

    records = asyncio.run(run())
    assert [load.loaded_by for load in records.versions[0]] == [LOADED_AT_START, UNANNOUNCED_LOAD]
    assert records.sha256_of(0) is None and vllm.answered == [path]


def test_a_loads_answer_reaches_the_client_only_once_the_server_recorded_the_load(
    server, step, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM has answered the load; the server still hashes the folder: the client hears nothing until the record
    (verified) is made, and a records read meanwhile sees the load declared."""
    vllm, guard = server
    hashing, release = threading.Event(), threading.Event()

    def slow_hash(path: str | Path) -> str | None:
        if Path(path) == step:
            hashing.set()
            release.wait(30)
        return hashed_weights(path)

    monkeypatch.setattr(serve_records, "hashed_weights", slow_hash)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> tuple[list[str], list[dict], Load, WeightRecords]:
        async with await _started(guard, vllm) as client:
            await client.post("/pause")
            await client.post(ANNOUNCE_PATH, json={"weights_sha256": hashed_weights(step), "folder": str(step)})
            load = asyncio.ensure_future(guard(_scope("POST", RPC_PATH), _receiving(_reload(step)), send))
            assert await asyncio.to_thread(hashing.wait, 30)
            answered, held, during = list(vllm.answered), list(sent), (await _records(client)).serving
            release.set()
            await load
            return answered, held, during, await _records(client)

    answered, held, during, after = asyncio.run(run())
    assert answered[-1] == RPC_PATH and held == []
    assert during.loaded_by == LOADED_BY_REFIT and during.verified_sha256 is None
    assert [message["type"] for message in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200 and after.serving.verified_sha256 == hashed_weights(step)


def _scope(method: str, path: str) -> dict:
    """The ASGI scope of a keyed request (for a test that watches the messages an answer sends)."""
    headers = [(b"authorization", AUTH["Authorization"].encode()), (b"content-type", b"application/json")]
    return {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": headers}


def _receiving(body: object):
    async def receive() -> dict:
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    return receive


def test_the_records_need_the_key_and_refuse_a_malformed_announcement(server) -> None:
    vllm, guard = server

    async def run() -> list[int]:
        async with await _started(guard, vllm) as client:
            bare = httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://server")
            async with bare:
                statuses = [(await bare.get(RECORDS_PATH)).status_code]
                statuses.append(
                    (await bare.post(ANNOUNCE_PATH, json={"weights_sha256": None, "folder": "/x"})).status_code
                )
            statuses.append(
                (await client.post(ANNOUNCE_PATH, json={"weights_sha256": "ABC", "folder": "/x"})).status_code
            )
            statuses.append((await client.post(ANNOUNCE_PATH, content=b"not json")).status_code)
            statuses.append((await client.get(RECORDS_PATH, params={"since": "-1"})).status_code)
            statuses.append((await client.delete(RECORDS_PATH)).status_code)
            return statuses

    assert asyncio.run(run()) == [401, 401, 400, 400, 400, 405]


def test_the_same_weights_loaded_again_keep_their_version_verified(server, folder) -> None:
    """A refit to the start-up folder, then its version named back to 0 (as a shared test server gets it back)."""
    vllm, guard = server

    async def run() -> WeightRecords:
        async with await _started(guard, vllm) as client:
            await _refit(client, 1, folder)
            await client.post("/update_weight_version", json={"new_version": "0"})
            return await _records(client)

    records = asyncio.run(run())
    assert [load.loaded_by for load in records.versions[0]] == [LOADED_AT_START, LOADED_BY_REFIT]
    assert records.sha256_of(0) == records.sha256_of(1) == hashed_weights(folder)
