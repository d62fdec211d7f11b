"""Refits of a real ``rollout-ledger serve`` and the weights each weight version is named with, end to end.

The test run's server on the in-process engine's worker (the lighter one; its other tests compare
the server with that engine), and three folders: the bundled model, ``other`` (its copy with
``model.norm.weight`` scaled by 1.01: other weights) and ``broken`` (its copy with the safetensors
file cut in half: a load that fails). The weights change here: the module's versions start at
:data:`BASE_VERSION`, and at the end the server loads the bundled model's weights again and names
them weight version 0, as every other test of the server plans.

* A shard during which ``rollout-ledger refit`` loads ``other``: the rows name both versions, and
  the published card names the planned sha256 for the first and ``other``'s for the second.
* A shard during which a refit to ``broken`` fails: refit exits 1 naming the replica, "paused" and
  the way out; no call is answered while it is paused; a refit to ``other`` recovers and the shard
  completes with every row named by the weights that sampled it.
* Weights loaded through vLLM's own routes (nobody announced them) are declared, not verified.
* A batch planned at a refit version verifies against that version's weights, not the planned
  model's; planning the bundled model there is refused.
* The server hashes what it loaded: a forged announcement (the bundled model's sha256 for ``other``)
  and a folder rewritten between the refit's hash and the load are recorded declared, both hashes
  kept, and a plan does not verify them.

``REFIT_FAULT_RUNS`` (default 1) repeats the two shard scenarios (the fault table's runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load_file, save_file

from tasks.batch import Batch
from tasks.engines import create_engine
from tasks.engines.background import BackgroundLoop
from tasks.engines.base import GenerationRequest, GenerationResult
from tasks.engines.vllm_server import refit as refit_module
from tasks.engines.vllm_server.refit import RefitFailedError, refit_urls
from tasks.engines.weight_records import (
    ANNOUNCE_PATH,
    FAILED_LOAD,
    LOADED_BY_REFIT,
    RECORDS_PATH,
    UNANNOUNCED_LOAD,
    Announcement,
    Load,
    WeightRecords,
)
from tasks.errors import ModelMismatchError
from tasks.finalize.card import render_card
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.finalize.weights import NOT_HASHED
from tasks.generate import generate_shard
from tasks.models.provenance import WEIGHTS_DECLARED, WEIGHTS_VERIFIED, hashed_weights, read_weights_extras
from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference
from tasks.pipeline import finalize_and_publish
from tasks.plan import plan_from_values
from tasks.sampling import SamplingSettings
from tests.generation.fakes import DelegatingEngine

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("vllm_engine")]
RUNS = int(os.environ.get("REFIT_FAULT_RUNS", "1"))
REFIT_AT_CALL = 4  # the shard's n-th call runs the refit(s) while the others are in flight
PAUSED_SECONDS = 4.0  # how long the shard is watched while a failed refit leaves the server paused (a call: ~1 s)
# The module's refits count on from here: the versions the other tests of the shared server name (0 to 3) keep
# their weights' records (a version's weights stay verified only while every load it saw hashes the same).
BASE_VERSION = 100


@dataclass(frozen=True)
class RefitServer:
    url: str
    key_file: str
    bundled: Path
    other: Path
    broken: Path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {Path(self.key_file).read_text().strip()}"}

    def version(self) -> int:
        answer = httpx.get(f"{self.url}/weight_info", headers=self.headers()).raise_for_status().json()
        return 0 if answer["weight_version"] == "default" else int(answer["weight_version"])

    def records(self) -> WeightRecords:
        answer = httpx.get(f"{self.url}{RECORDS_PATH}", headers=self.headers(), timeout=120)
        return WeightRecords.from_json(answer.raise_for_status().json())

    def refit(self, folder: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.refit_argv(folder), capture_output=True, text=True, timeout=600, check=False)

    def refit_argv(self, folder: Path) -> list[str]:
        command = [sys.executable, "-m", "tasks.cli", "refit", "--urls", self.url, "--folder", str(folder)]
        return [*command, "--api-key-file", self.key_file]


@pytest.fixture(scope="module")
def server(vllm_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefitServer]:
    home = tmp_path_factory.mktemp("refit-folders")
    bundled = resolve_model_reference(BUNDLED_REFERENCE)
    other, broken = home / "other", home / "broken"
    for copy in (other, broken):
        shutil.copytree(bundled, copy)
    tensors = load_file(str(bundled / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * np.float32(1.01)
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    cut = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(cut[: len(cut) // 2])
    server = RefitServer(vllm_server.url, vllm_server.key_file, bundled, other, broken)
    vllm_server.name_weight_version(BASE_VERSION)
    try:
        yield server
    finally:
        restored = server.refit(bundled)  # a paused server too: a refit that loads resumes it
        assert restored.returncode == 0, restored.stderr
        vllm_server.name_weight_version(0)
        records = server.records()
        assert not records.paused and records.sha256_of(0) == hashed_weights(bundled), records


def _options(server: RefitServer, **more: object) -> dict[str, object]:
    return {"urls": [server.url], "api_key_file": server.key_file} | more


def _plan(server: RefitServer, root: str, batch_id: str, *, model: Path | None = None, **more: object) -> Batch:
    batch = Batch.open(root, batch_id)
    values = {
        "environment": "guess_number",
        "environment_options": {"lo": 1, "hi": 8},
        "num_tasks": 3,
        "group_size": 2,
        "shards": 1,
        "max_turns": 4,
        "max_in_flight": 6,
        "temperature": 0.0,
        "max_tokens": 16,
        "engine": "vllm_server",
        "engine_options": _options(server),
        "weight_version": server.version(),
    } | more
    if model is not None:
        values["model"] = str(model)
    plan_from_values(batch, values)
    return Batch.open(root, batch_id)


class RefitsMidShard(DelegatingEngine):
    """The server's engine; the ``at_call``-th call first runs ``refits`` (the others stay in flight). Records
    when each answer arrived."""

    def __init__(self, inner, at_call: int, refits: Callable[[RefitsMidShard], Awaitable[None]]) -> None:
        super().__init__(inner)
        self.at_call, self.refits, self.calls, self.answered = at_call, refits, 0, []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.calls += 1
        if self.calls == self.at_call:
            await self.refits(self)
        result = await self.inner.generate(request)
        self.answered.append(time.monotonic())
        return result


async def _cli_refit(server: RefitServer, folder: Path) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *server.refit_argv(folder), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    return process.returncode or 0, out.decode(), err.decode()


def _shard_with_refits(server: RefitServer, batch: Batch, refits) -> RefitsMidShard:
    loop = BackgroundLoop("refit-test-loop")
    try:
        inner = loop.run(
            create_engine(
                "vllm_server",
                model_path=resolve_model_reference(BUNDLED_REFERENCE),
                options=_options(server),
                weight_version=batch.config.weight_version,
            ),
            timeout=300,
        )
        engine = RefitsMidShard(inner, REFIT_AT_CALL, refits)
        try:
            generate_shard(batch, 0, engine=engine, run=loop.run, progress=False)
        finally:
            loop.run(inner.close(), timeout=60)
    finally:
        loop.close()
    return engine


def _fault_figures(root: str, batch_id: str, truth: dict[int, str]) -> dict[str, int]:
    """From the staged dataset: rows lost (planned rollouts without a trainable row), rows labelled wrongly (a
    version of their tokens named with a sha256 other than that of the weights that sampled them) and rows
    declared (a version of their tokens named as not verified)."""
    store = Batch.open(root, batch_id).store
    metrics = json.loads(Path(store.full_path("dataset/metrics.json")).read_text())
    named = {int(v): entry["weights_sha256"] for v, entry in metrics["weights_by_version"].items()}
    parts = sorted(Path(store.full_path("dataset")).glob("part-*.parquet"))
    rows = [row for part in parts for row in pq.read_table(part).to_pylist()]
    versions = [[span["weight_version"] for span in row["weight_version_spans"]] for row in rows]
    return {
        "planned": metrics["planned_rollouts"],
        "rows": len(rows),
        "lost": metrics["planned_rollouts"] - metrics["trainable_rows"],
        "labelled_wrongly": sum(any(named[v] not in (None, truth[v]) for v in row) for row in versions),
        "declared": sum(any(named[v] is None for v in row) for row in versions),
        "versions": sorted({v for row in versions for v in row}),
    }


@pytest.mark.parametrize("run", range(RUNS))
def test_a_refit_to_other_weights_mid_shard_names_each_versions_weights_in_the_rows_and_the_card(
    server: RefitServer, tmp_path: Path, run: int
) -> None:
    assert server.refit(server.bundled).returncode == 0  # start from the bundled weights, hashed by a refit
    root = str(tmp_path / "runs")
    batch = _plan(server, root, f"b-refit-{run}")
    first = batch.config.weight_version
    refits: list[tuple[int, str, str]] = []

    async def to_other(engine: RefitsMidShard) -> None:
        refits.append(await _cli_refit(server, server.other))

    _shard_with_refits(server, batch, to_other)
    (code, out, err) = refits[0]
    other_sha = hashed_weights(server.other)
    assert code == 0 and f"at weight version {first + 1}: weights sha256 {other_sha} (hashed here)" in out, err
    assert f"\n  {server.url}: verified: the server hashed the folder it loaded to the sha256 hashed here" in out

    published = finalize_and_publish(Batch.open(root, batch.batch_id), FinalizeOptions(audit=False))
    card = Path(Batch.open(root, batch.batch_id).store.full_path("dataset/README.md")).read_text()
    planned_sha = batch.config.model.weights_sha256
    assert published.published is not None and other_sha != planned_sha
    assert f"| {first} | verified | `{planned_sha}` (the planned model's) |" in card
    assert f"| {first + 1} | verified | `{other_sha}` |" in card
    assert "Weights: verified for every weight version." in card
    figures = _fault_figures(root, batch.batch_id, {first: planned_sha, first + 1: other_sha})
    print(f"refit to other weights, run {run}: {figures}")
    assert figures["versions"] == [first, first + 1], figures  # the refit came mid-shard
    assert figures["lost"] == figures["labelled_wrongly"] == figures["declared"] == 0, figures


@pytest.mark.parametrize("run", range(RUNS))
def test_a_failed_refit_mid_shard_leaves_the_server_paused_until_a_good_refit_and_no_row_is_lost(
    server: RefitServer, tmp_path: Path, run: int
) -> None:
    assert server.refit(server.bundled).returncode == 0
    root = str(tmp_path / "runs")
    batch = _plan(server, root, f"b-failed-refit-{run}")
    first, other_sha = batch.config.weight_version, hashed_weights(server.other)
    key = Path(server.key_file).read_text().strip()
    seen: dict[str, object] = {}

    async def broken_then_other(engine: RefitsMidShard) -> None:
        with pytest.raises(RefitFailedError) as failed:
            await refit_urls([server.url], str(server.broken), None, api_key=key, key_source="the test's key")
        seen["failed"] = str(failed.value)
        answered = len(engine.answered)
        seen["records_while_paused"] = await asyncio.to_thread(server.records)
        probe = asyncio.ensure_future(engine.inner.generate(_request(engine.inner.tokenizer, "probe")))
        await asyncio.sleep(PAUSED_SECONDS)
        seen["probe_answered_while_paused"] = probe.done()
        seen["shard_answers_while_paused"] = len(engine.answered) - answered
        seen["recovered"] = await refit_urls([server.url], str(server.other), None, api_key=key, key_source="key")
        seen["probe"] = await probe

    _shard_with_refits(server, batch, broken_then_other)
    assert server.url in seen["failed"] and "failed at reload_weights" in seen["failed"]
    assert "the replica is paused: it serves no request until a refit succeeds" in seen["failed"]
    paused = seen["records_while_paused"]
    assert paused.paused and paused.serving.loaded_by == FAILED_LOAD and paused.serving_version == first
    assert not seen["probe_answered_while_paused"] and seen["shard_answers_while_paused"] == 0
    assert seen["recovered"].version == first + 1
    assert {span.version for span in seen["probe"].weight_spans} == {first + 1}
    assert read_weights_extras(seen["probe"].extras) == {first + 1: other_sha}
    assert all(load.loaded_by != FAILED_LOAD for loads in server.records().versions.values() for load in loads)

    finalize_batch(Batch.open(root, batch.batch_id), FinalizeOptions(audit=False))
    figures = _fault_figures(root, batch.batch_id, {first: batch.config.model.weights_sha256, first + 1: other_sha})
    print(f"failed refit, then a good one, run {run}: {figures}")
    assert figures["versions"] == [first, first + 1], figures
    assert figures["lost"] == figures["labelled_wrongly"] == figures["declared"] == 0, figures


def test_refit_to_a_folder_that_does_not_load_exits_1_naming_the_paused_replica_and_refit_again_recovers(
    server: RefitServer,
) -> None:
    failed = server.refit(server.broken)
    assert failed.returncode == 1 and failed.stdout == "", failed.stderr
    assert failed.stderr.startswith(f"rollout-ledger refit: failed: refit of {server.url} to {server.broken}")
    assert "failed at reload_weights" in failed.stderr
    assert "the replica is paused: it serves no request until a refit succeeds" in failed.stderr
    assert "run rollout-ledger refit again with a folder that loads" in failed.stderr
    assert "or restart the server" in failed.stderr
    records = server.records()
    assert records.paused and records.serving.loaded_by == FAILED_LOAD
    recovered = server.refit(server.bundled)
    assert recovered.returncode == 0, recovered.stderr
    records = server.records()
    assert not records.paused and records.sha256_of(records.serving_version) == hashed_weights(server.bundled)


def _request(tokenizer, request_id: str) -> GenerationRequest:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], tokenize=False, add_generation_prompt=True
    )
    prompt = tuple(tokenizer.encode(text, add_special_tokens=False))
    return GenerationRequest(request_id, prompt, SamplingSettings(temperature=0.0, max_tokens=4), seed=1)


def test_weights_loaded_through_vllms_own_routes_are_declared_not_verified(server: RefitServer, tmp_path) -> None:
    """A trainer's own load, announced to nobody: plan and generate accept it only by name, and call it declared."""
    version = server.version() + 1
    for path, body in (
        ("/pause", None),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(server.other)}}),
        ("/update_weight_version", {"new_version": str(version)}),
        ("/resume", None),
    ):
        httpx.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=600).raise_for_status()
    assert server.records().versions[version][0].loaded_by == UNANNOUNCED_LOAD
    root = str(tmp_path / "runs")
    with pytest.raises(ModelMismatchError, match="whose weights are not verified"):
        _plan(server, root, "b-unannounced")
    served_model = str(server.bundled)  # the server's model name: its start-up folder
    batch = _plan(server, root, "b-declared", num_tasks=1, engine_options=_options(server, served_model=served_model))
    assert batch.config.model.weights == WEIGHTS_DECLARED
    generate_shard(batch, 0, progress=False)
    staged = finalize_batch(Batch.open(root, batch.batch_id), FinalizeOptions(audit=False))
    metrics = json.loads(Path(batch.store.full_path("dataset/metrics.json")).read_text())
    ((named_version, judged),) = metrics["weights_by_version"].items()
    assert named_version == str(version) and judged.pop("calls") > 0
    assert judged == {"weights": WEIGHTS_DECLARED, "weights_sha256": None, "why": NOT_HASHED}
    card = render_card(
        batch_id=batch.batch_id,
        config=staged.marker.config,
        metrics=metrics,
        parts=[],
        validation={},
        review=None,
    )
    assert f"Weights: {WEIGHTS_DECLARED} for weight version(s) {version}." in card
    assert f"| {version} | {WEIGHTS_DECLARED} | – | {NOT_HASHED} |" in card


def test_a_batch_planned_at_a_refit_version_verifies_against_that_versions_weights(server: RefitServer, tmp_path):
    refit = server.refit(server.other)
    assert refit.returncode == 0, refit.stderr
    version, other_sha = server.version(), hashed_weights(server.other)
    root = str(tmp_path / "runs")
    with pytest.raises(ModelMismatchError, match="not the planned model's weights"):
        _plan(server, root, "b-bundled-on-other")  # the issue: this used to be planned as verified
    batch = _plan(server, root, "b-other", model=server.other)
    assert batch.config.model.weights == WEIGHTS_VERIFIED and batch.config.model.weights_sha256 == other_sha

    async def one_call():
        engine = await create_engine(
            "vllm_server", model_path=server.other, options=_options(server), weight_version=version
        )
        try:
            return engine.weights, await engine.generate(_request(engine.tokenizer, "r0"))
        finally:
            await engine.close()

    weights, result = asyncio.run(one_call())
    assert weights == WEIGHTS_VERIFIED and read_weights_extras(result.extras) == {version: other_sha}


def _load_announced(server: RefitServer, announced: Announcement, folder: Path) -> int:
    """What a refit sends, with ``announced`` in place of the folder's own hash: ``folder`` at the next version."""
    version = server.version() + 1
    for path, body in (
        ("/pause", None),
        (ANNOUNCE_PATH, announced.to_json()),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}),
        ("/update_weight_version", {"new_version": str(version)}),
        ("/resume", None),
    ):
        httpx.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=600).raise_for_status()
    return version


def test_a_forged_refit_hash_is_recorded_declared_with_both_hashes_and_a_plan_does_not_verify_it(
    server: RefitServer, tmp_path: Path
) -> None:
    """The key holder announces the planned model's sha256 and loads other weights: the server's own hash of the
    folder it loaded disagrees, so the version is declared, and planning the bundled model on it is refused (only
    the served_model option would accept it, as declared)."""
    forged = Announcement(hashed_weights(server.bundled), str(server.other))
    version = _load_announced(server, forged, server.other)
    records, loaded = server.records(), Load(LOADED_BY_REFIT, hashed_weights(server.other), str(server.other), forged)
    assert records.versions[version] == (loaded,) and records.sha256_of(version) is None
    root = str(tmp_path / "runs")
    both = f"sha256 {loaded.weights_sha256[:12]}… (announced: {server.other}, sha256 {forged.weights_sha256[:12]}…)"
    with pytest.raises(ModelMismatchError, match=rf"whose weights are not verified \(refit of .*{re.escape(both)}"):
        _plan(server, root, "b-forged")


def test_a_folder_rewritten_between_the_refits_hash_and_the_load_is_recorded_declared(
    server: RefitServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """refit hashes ``moving`` (other's weights); before the load its weights file is swapped for the bundled
    model's: the server loads and hashes the bundled weights, and says so."""
    moving = tmp_path / "moving"
    moving.mkdir()
    for file in server.other.iterdir():
        (moving / file.name).symlink_to(file)

    def hash_then_rewrite(folder: str) -> str | None:
        sha = hashed_weights(folder)
        (moving / "model.safetensors").unlink()
        (moving / "model.safetensors").symlink_to(server.bundled / "model.safetensors")
        return sha

    monkeypatch.setattr(refit_module, "hashed_weights", hash_then_rewrite)
    key = Path(server.key_file).read_text().strip()
    refit = asyncio.run(refit_urls([server.url], str(moving), None, api_key=key, key_source="the test's key"))
    other_sha, bundled_sha = hashed_weights(server.other), hashed_weights(server.bundled)
    assert refit.announced == Announcement(other_sha, str(moving))
    assert refit.recorded == {server.url: Load(LOADED_BY_REFIT, bundled_sha, str(moving), refit.announced)}
    (verdict,) = refit.verdicts()
    assert f"declared, not verified: the server hashed the folder it loaded to sha256 {bundled_sha}" in verdict
    assert server.records().sha256_of(refit.version) is None
