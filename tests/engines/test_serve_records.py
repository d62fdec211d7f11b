"""The weight records of ``rollout-ledger serve`` (:class:`ServeRecords`, inside the key guard) over a fake vLLM.

The fake answers the RL routes as vLLM does (a status per route, a weight version the "engine"
reports), so each test drives the sequence a refit, a failed refit, a trainer's own load or a
version rename sends, and reads what the records say of each version. The real server is in
``test_vllm_server_refit.py``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tasks.engines.vllm_server.serving.auth import RequireKey
from tasks.engines.vllm_server.serving.keys import KEY_ENV
from tasks.engines.weight_records import (
    ANNOUNCE_PATH,
    FAILED_LOAD,
    LOADED_AT_START,
    LOADED_BY_REFIT,
    RECORDS_PATH,
    UNANNOUNCED_LOAD,
    Load,
    WeightRecords,
)
from tasks.models.provenance import hashed_weights
from tests.engines.fake_asgi import request_body

KEY = "records-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OTHER_SHA = "ab" * 32


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

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return
        body = await request_body(receive)
        if scope["path"] == "/update_weight_version":
            self.engine.version = json.loads(body)["new_version"]
        status = 500 if scope["path"] in self.fail else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights of the start-up folder")
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


async def _refit(client: httpx.AsyncClient, version: int, sha: str | None, folder: str = "/models/step") -> None:
    """The calls of rollout-ledger refit, in its order (each must pass: the fake answers 200)."""
    for path, body in (
        ("/pause", None),
        (ANNOUNCE_PATH, {"weights_sha256": sha, "folder": folder}),
        ("/collective_rpc", {"method": "reload_weights"}),
        ("/update_weight_version", {"new_version": str(version)}),
        ("/reset_prefix_cache", None),
        ("/resume", None),
    ):
        await client.post(path, json=body)


def test_the_start_up_folder_is_hashed_and_is_version_0s_one_load(server, folder) -> None:
    vllm, guard = server

    async def run() -> WeightRecords:
        async with await _started(guard, vllm) as client:
            return await _records(client)

    records = asyncio.run(run())
    start_up = Load(LOADED_AT_START, hashed_weights(folder), str(folder))
    assert records.versions == {0: (start_up,)} and records.serving == start_up and not records.paused
    assert records.sha256_of(0) == hashed_weights(folder) and records.sha256_of(1) is None


def test_a_refit_names_its_version_with_the_announced_weights_and_leaves_earlier_versions_alone(server, folder):
    vllm, guard = server

    async def run() -> tuple[WeightRecords, WeightRecords]:
        async with await _started(guard, vllm) as client:
            await _refit(client, 1, OTHER_SHA)
            return await _records(client), await _records(client, since=1)

    records, since_1 = asyncio.run(run())
    assert records.sha256_of(0) == hashed_weights(folder)
    assert records.versions[1] == (Load(LOADED_BY_REFIT, OTHER_SHA, "/models/step"),)
    assert records.sha256_of(1) == OTHER_SHA and records.serving_version == 1
    assert set(since_1.versions) == {1}


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
            await client.post("/update_weights", json={})
            await client.post("/update_weight_version", json={"new_version": "2"})
            return await _records(client)

    records = asyncio.run(run())
    assert [load.loaded_by for load in records.versions[0]] == [LOADED_AT_START, UNANNOUNCED_LOAD]
    assert records.versions[2] == (Load(UNANNOUNCED_LOAD),)
    assert records.sha256_of(0) is None and records.sha256_of(2) is None


def test_an_announcement_names_only_the_next_load_and_a_rename_keeps_the_weights(server, folder) -> None:
    vllm, guard = server

    async def run() -> WeightRecords:
        async with await _started(guard, vllm) as client:
            await _refit(client, 1, OTHER_SHA)
            await client.post("/update_weight_version", json={"new_version": "3"})  # a new name, the same weights
            await client.post("/pause")
            await client.post("/collective_rpc", json={})  # not announced
            await client.post("/update_weight_version", json={"new_version": "4"})
            await client.post("/resume")
            return await _records(client)

    records = asyncio.run(run())
    assert records.sha256_of(1) == OTHER_SHA and records.sha256_of(3) == OTHER_SHA
    assert records.versions[4] == (Load(UNANNOUNCED_LOAD),) and records.sha256_of(4) is None


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
            await _refit(client, 1, hashed_weights(folder), str(folder))
            await client.post("/update_weight_version", json={"new_version": "0"})
            return await _records(client)

    records = asyncio.run(run())
    assert [load.loaded_by for load in records.versions[0]] == [LOADED_AT_START, LOADED_BY_REFIT]
    assert records.sha256_of(0) == records.sha256_of(1) == hashed_weights(folder)
