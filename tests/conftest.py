"""Shared fixtures: object stores on local disk, fsspec memory, and a real S3 API (moto).

The S3 fixture starts moto's ThreadedMotoServer on loopback once per test run, the way
s3fs's own test suite does, and talks to it through s3fs: no client is patched.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tasks.generate.progress import HEARTBEAT_VARIABLE
from tasks.storage.objects import ObjectStore
from tests.serving import name_weight_version, serve_process

STORE_KINDS = ("local", "memory", "s3")
IN_CI = os.environ.get("CI", "").lower() == "true"
# Generate's progress line every second (10 s in use): tests that stop a generate process midway wait for one, and
# every process a test starts inherits it.
os.environ.setdefault(HEARTBEAT_VARIABLE, "1")


def pytest_configure(config: pytest.Config) -> None:
    """On a pytest-xdist worker: this process, and everything it starts, runs on its own share of the CPUs.

    A vLLM-CPU engine binds its OpenMP threads to every CPU its process may use; two workers'
    engines bound to the same cores spin against each other (the run took longer than on one
    worker). With one share per worker (worker k of n takes every n-th CPU from the k-th), each
    engine binds to its worker's CPUs only. More workers than CPUs: no pinning.
    """
    worker = getattr(config, "workerinput", None)
    if worker is None or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    count, index = int(worker["workercount"]), int(worker["workerid"].removeprefix("gw"))
    if 1 < count <= len(cpus):
        os.sched_setaffinity(0, cpus[index::count])


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With pytest-xdist (``make test`` runs ``-n auto --dist loadgroup``): the tests of one real vLLM share a worker.

    A session fixture starts once per worker, so every test of the in-process engine runs on one
    worker (the ``vllm_engine`` group) and every other test of the test run's vLLM server on one
    worker (``vllm_server``). A test of both (the server's exactness against the in-process engine)
    is in the first, so its worker starts the server too: the server's tests in a module that also
    tests the in-process engine run there as well, which evens out the two groups (the second is
    the longer one). A module marked with a group of its own choosing keeps it. The other tests go wherever
    a worker is free.
    """
    engine_modules = {item.module for item in items if "vllm_engine" in getattr(item, "fixturenames", ())}
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:  # a module that chose its worker
            continue
        names = getattr(item, "fixturenames", ())
        group = next((name for name in ("vllm_engine", "vllm_server") if name in names), None)
        if group == "vllm_server" and item.module in engine_modules:
            group = "vllm_engine"
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker with ``--dist loadgroup``: stop at once if xdist did not tag the groups (then every
    worker would start its own vLLM engine and server)."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    grouped = [item for item in session.items if item.get_closest_marker("xdist_group") is not None]
    if grouped and not any("@" in item.nodeid for item in grouped):
        raise pytest.UsageError(
            "pytest-xdist did not apply the xdist_group marks (pytest and pytest-xdist disagree on node ids): "
            "install the pytest the test extra pins"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI a skipped test is a failure, except GPU tests: real components must be there."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and item.get_closest_marker("gpu") is None and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (CI=true), which only GPU tests may do: {report.longrepr}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a moto S3 server on loopback, with the AWS environment pointed at it."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {
        k: os.environ.get(k)
        for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    yield endpoint
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket on the moto server; returns its s3:// URL."""
    import s3fs

    name = f"test-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    fs.mkdir(name)
    return f"s3://{name}"


def make_store(kind: str, tmp_path, request) -> ObjectStore:
    if kind == "local":
        return ObjectStore(str(tmp_path / "root"))
    if kind == "memory":
        return ObjectStore(f"memory://rl-test-{uuid.uuid4().hex[:12]}")
    if kind == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        return ObjectStore(f"{bucket}/root", skip_instance_cache=True)
    raise ValueError(kind)


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer and chat template, from the bundled GGUF.

    The user cache's conversion, as every command uses it: converted once per machine (the
    conversion itself is tested in ``tests/models/test_bundled.py``), never from the Hub.
    """
    from tasks.models import bundled

    return bundled.load_bundled_tokenizer()


@pytest.fixture(scope="session")
def smollm2_tokenizer(tokenizer):
    """Alias of :func:`tokenizer` for the capture tests, which name the model they splice for."""
    return tokenizer


@pytest.fixture(params=STORE_KINDS)
def store(request, tmp_path) -> ObjectStore:
    """An empty store on each backend in turn: local disk, memory://, and S3 (moto)."""
    return make_store(request.param, tmp_path, request)


@pytest.fixture(scope="session")
def vllm_engine():
    """ONE real vLLM engine on the bundled model for the whole test run, driven by a BackgroundLoop.

    Yields ``(engine, loop)``: call the engine through ``loop.run(engine.generate(...))``.
    Starting it takes ~30 s on CPU (plus ~20 s once to convert the bundled model into the
    user cache). At the end of the session it is closed, and closing must leave no engine
    process behind (asserted here, so a leak fails the run).
    """
    from tasks.engines import create_engine
    from tasks.engines.background import BackgroundLoop
    from tasks.engines.vllm.engine import engine_processes
    from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference

    loop = BackgroundLoop("vllm-engine-test-loop")
    model = resolve_model_reference(BUNDLED_REFERENCE)
    before = {process.pid for process in engine_processes()}  # e.g. the vllm_server fixture's
    engine = loop.run(create_engine("vllm", model_path=model, options={"max_model_len": 2048}), timeout=600)
    started = [process for process in engine_processes() if process.pid not in before]
    try:
        yield engine, loop
    finally:
        loop.run(engine.close(), timeout=120)
        loop.close()
    assert started, "the engine started no VLLM:: process, so close() was not checked"
    leftover = [p.pid for p in started if p.is_running() and p.status() != "zombie"]
    assert not leftover, f"engine processes still running after close(): {leftover}"


@dataclass(frozen=True)
class RunningServer:
    """The test run's vLLM server: its URL, the key file ``serve`` made, its log and ``ROLLOUT_LEDGER_HOME``."""

    url: str
    key_file: str
    log: str  # the server's own log (vLLM's output)
    home: Path  # serve's cache (its key file and log) and serve.stderr, serve's own output

    @property
    def key(self) -> str:
        return Path(self.key_file).read_text().strip()

    def engine_options(self, **more: Any) -> dict[str, Any]:
        """``engine.options`` of a batch on this server (engine ``vllm_server``)."""
        return {"urls": [self.url], "api_key_file": self.key_file} | more

    def engine_fields(self) -> dict[str, Any]:
        """The batch fields (run conf, plan values) of a batch on this server."""
        return {"engine": "vllm_server", "engine_options": self.engine_options()}

    @contextlib.contextmanager
    def at_weight_version(self, version: int) -> Iterator[None]:
        """The server names its (unchanged) weights ``version`` inside the block, ``0`` after it: the server is
        shared, and the other tests plan at version 0."""
        self.name_weight_version(version)
        try:
            yield
        finally:
            self.name_weight_version(0)

    def name_weight_version(self, version: int) -> None:
        """What a refit's last step does: the server names its weights ``version``."""
        name_weight_version(self.url, self.key, version)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """ONE ``rollout-ledger serve`` of the bundled model on loopback for the whole test run, started as users start it.

    No ``--api-key-file`` and no ``--log``: ``serve`` makes the API key itself and keeps it and the
    log in its cache, here a temporary ``ROLLOUT_LEDGER_HOME`` (its model from the user cache, as
    every command converts it). Ready when the command prints the server's URL. At the end it gets
    SIGTERM, as a process manager would stop it: it must exit 0 and leave none of the processes it
    started (asserted here, so a leak fails the run).
    """
    import sys

    from tasks.models.reference import BUNDLED_REFERENCE, resolve_model_reference

    folder = resolve_model_reference(BUNDLED_REFERENCE)  # in the user's cache: the server's home has no model
    home = tmp_path_factory.mktemp("vllm-server")
    port = _free_port()
    argv = [sys.executable, "-m", "tasks.cli", "serve", "--port", str(port), "--model", str(folder)]
    argv += ["--engine-option", "max_model_len=2048"]
    env = dict(os.environ, ROLLOUT_LEDGER_HOME=str(home))
    with serve_process(argv, home, env) as url:
        assert url == f"http://127.0.0.1:{port}"
        key_file, log = home / "serve" / f"port-{port}.key", home / "logs" / "serve" / f"port-{port}.log"
        yield RunningServer(url, str(key_file), str(log), home)
