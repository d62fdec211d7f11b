"""Create-once objects on local disk, memory:// and S3 (docs/architecture.md §2)."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from tasks.errors import ObjectConflictError, StorageUnavailableError
from tasks.storage.objects import ObjectStore, sha256_hex
from tests.reliability.faulty_fs import FaultInjector, FaultRule, faulty_options, faulty_url

from ._writer_process import WriterProcess

MIB = 2**20


def test_write_once_creates_then_ignores_identical_rewrite(store: ObjectStore) -> None:
    first = store.write_once("a/b.bin", b"payload")
    assert (first.created, first.size, first.sha256) == (True, 7, sha256_hex(b"payload"))
    again = store.write_once("a/b.bin", b"payload")
    assert (again.created, again.sha256) == (False, first.sha256)
    assert store.read_bytes("a/b.bin") == b"payload"


def test_differing_rewrite_conflicts_and_keeps_the_first_content(store: ObjectStore) -> None:
    store.write_once("a/b.bin", b"first")
    with pytest.raises(ObjectConflictError, match="already exists with different content") as raised:
        store.write_once("a/b.bin", b"second")
    assert isinstance(raised.value, FileExistsError)
    assert store.read_bytes("a/b.bin") == b"first"
    assert store.list_files("a") == ["a/b.bin"]


@pytest.mark.parametrize("bad", ["", "/abs/x", "a/../b", "..", "a//b", "./a", "a/.", 7])
def test_paths_outside_the_root_are_refused(store: ObjectStore, bad: Any) -> None:
    with pytest.raises(ValueError, match="object path"):
        store.write_once(bad, b"x")
    assert store.list_files() == []


@pytest.fixture
def s3_store(s3_bucket: str) -> ObjectStore:
    """A store on moto S3 with 5 MiB parts, so an 11 MiB object is a three-part upload."""
    return ObjectStore(f"{s3_bucket}/root", block_size=5 * MIB, skip_instance_cache=True, fixed_upload_size=True)


def _etag(store: ObjectStore, relative: str) -> str:
    return store.fs.info(store.full_path(relative))["ETag"].strip('"')


def test_s3_single_part_put_is_create_once(s3_store: ObjectStore) -> None:
    assert s3_store.write_once("small.bin", b"a" * 1024).created
    assert "-" not in _etag(s3_store, "small.bin")
    with pytest.raises(ObjectConflictError):
        s3_store.write_once("small.bin", b"b" * 1024)
    assert s3_store.read_bytes("small.bin") == b"a" * 1024


def test_s3_multipart_upload_is_create_once(s3_store: ObjectStore) -> None:
    first, second = os.urandom(11 * MIB), os.urandom(11 * MIB)
    assert s3_store.write_once("big.bin", first).created
    assert _etag(s3_store, "big.bin").endswith("-3")
    with pytest.raises(ObjectConflictError):
        s3_store.write_once("big.bin", second)
    assert not s3_store.write_once("big.bin", first).created
    assert sha256_hex(s3_store.read_bytes("big.bin")) == sha256_hex(first)


@pytest.fixture
def atomic_moto_conditional_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make moto evaluate ``If-None-Match: *`` atomically, as S3 does.

    moto checks the precondition and then stores the object in two steps without a lock; two
    writers that both pass the check both "win" (observed for CompleteMultipartUpload, whose
    window spans concatenating the parts). S3 itself evaluates conditional writes atomically,
    so the race below serializes moto's two conditional write handlers: it tests our client
    path against the service's guarantee, not the emulator's gap.
    """
    from moto.s3.responses import S3Response

    lock = threading.RLock()
    for name in ("put_object", "_key_response_post"):
        original = getattr(S3Response, name)

        def serialized(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with lock:
                return _original(self, *args, **kwargs)

        monkeypatch.setattr(S3Response, name, serialized)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "size", "rounds"),
    [("local", 2 * MIB, 8), ("s3", 2 * MIB, 6), ("s3", 11 * MIB, 3)],
    ids=["local", "s3-single-part", "s3-multipart"],
)
def test_two_writer_processes_racing_on_one_name_leave_one_whole_payload(
    kind: str, size: int, rounds: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "local":
        store, block_size = ObjectStore(str(tmp_path / "root")), []
    else:
        request.getfixturevalue("atomic_moto_conditional_writes")
        store = ObjectStore(f"{request.getfixturevalue('s3_bucket')}/root", skip_instance_cache=True)
        block_size = [str(5 * MIB)]
    overlapped = 0
    with contextlib.ExitStack() as stack:
        writers = [
            stack.enter_context(WriterProcess("race", store.url, "race", f"writer-{i}", str(size), *block_size))
            for i in range(2)
        ]
        assert [w.next() for w in writers] == [{"ready": True}] * 2
        for round_no in range(rounds):
            for writer in writers:
                writer.send(f"go {round_no}")
            results = [w.next() for w in writers]
            assert sorted(r["outcome"] for r in results) == ["conflict", "created"]
            winner = next(r for r in results if r["outcome"] == "created")
            assert sha256_hex(store.read_bytes(f"race/obj-{round_no}")) == winner["sha256"]
            if store.is_s3:  # the 11 MiB payload really went up as a three-part upload
                assert _etag(store, f"race/obj-{round_no}").endswith("-3") == (size > 5 * MIB)
            first, second = sorted(results, key=lambda r: r["start"])
            overlapped += second["start"] < first["end"]
        for writer in writers:
            writer.stop()
    assert store.list_files("race") == sorted(f"race/obj-{i}" for i in range(rounds))
    assert overlapped >= 1, "the two writers never overlapped; the race proved nothing"


def test_s3_conditional_conflict_409_is_retried_then_resolved_by_content(monkeypatch):
    """Real S3 may answer a racing conditional write with 409; the write is retried, not failed."""
    store = ObjectStore("memory://rl-409-retry", rollout_ledger_retry={"initial_wait_s": 0.001})
    calls = []
    original = ObjectStore._write_exclusive

    def flaky(self, path, data):
        calls.append(path)
        if len(calls) == 1:  # what s3fs raises for the 409: an error code it does not map, as EIO
            raise OSError(errno.EIO, "An error occurred (ConditionalRequestConflict) when calling PutObject")
        return original(self, path, data)

    monkeypatch.setattr(ObjectStore, "_write_exclusive", flaky)
    assert store.write_once("a/obj", b"payload").created
    assert len(calls) == 2
    assert store.read_bytes("a/obj") == b"payload"


def _behind_faults(kind: str, rule: FaultRule, tmp_path: Path, request: pytest.FixtureRequest) -> ObjectStore:
    """A store on local disk or moto S3 (5 MiB parts) behind the FAULT INJECTOR, which fails writes as ``rule`` says."""
    injector = FaultInjector([rule], seed=0)
    if kind == "local":
        url, target = str(tmp_path / "root"), {}
    else:
        url, target = f"{request.getfixturevalue('s3_bucket')}/root", {"s3": {"skip_instance_cache": True}}
    options = faulty_options(injector, retry={"attempts": 3, "initial_wait_s": 0.0001}, **target)
    return ObjectStore(faulty_url(url), block_size=5 * MIB, **options)


def _healthy(store: ObjectStore) -> ObjectStore:
    return ObjectStore(store.url.removeprefix("faulty::"), skip_instance_cache=True)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_write_cut_off_partway_leaves_no_object_and_no_upload(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cut = FaultRule(rate=1.0, operations=frozenset({"write"}), kinds=("partial_write",))
    store = _behind_faults(kind, cut, tmp_path, request)
    payload = os.urandom(11 * MIB)  # on S3, the half that gets through is a whole uploaded part
    with pytest.raises(StorageUnavailableError, match="ConnectionResetError"):
        store.write_once("a/big.bin", payload)
    healthy = _healthy(store)
    assert healthy.list_files() == [], "no object, no temp file"
    if kind == "s3":
        bucket = healthy.root.split("/", 1)[0]
        assert not healthy.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads"), "the upload was aborted"
    assert healthy.write_once("a/big.bin", payload).created


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_write_whose_answer_was_lost_rewrites_as_a_no_op(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    lost = FaultRule(rate=1.0, operations=frozenset({"write"}), kinds=("lost_response",), match="*/a/obj")
    store = _behind_faults(kind, lost, tmp_path, request)
    written = store.write_once("a/obj", b"payload")
    assert (written.created, written.sha256) == (False, sha256_hex(b"payload")), "the retry found its own object"
    with pytest.raises(ObjectConflictError):
        store.write_once("a/obj", b"other")
    assert _healthy(store).read_bytes("a/obj") == b"payload"
    assert _healthy(store).list_files() == ["a/obj"]


def test_s3_objects_another_writer_creates_are_seen_at_once_whatever_this_store_listed(s3_bucket: str) -> None:
    """A finalize task must see the marker a generate process committed after it last listed the folder."""
    reader = ObjectStore(f"{s3_bucket}/root")
    writer = ObjectStore(f"{s3_bucket}/root", skip_instance_cache=True)  # another process's filesystem
    reader.write_once("ledger/shard-0/calls.parquet", b"calls")
    assert reader.list_files("ledger") == ["ledger/shard-0/calls.parquet"]
    assert not reader.exists("ledger/shard-0/_COMMITTED.json")
    writer.write_once("ledger/shard-0/_COMMITTED.json", b"{}")
    assert reader.exists("ledger/shard-0/_COMMITTED.json")
    assert reader.read_bytes("ledger/shard-0/_COMMITTED.json") == b"{}"
