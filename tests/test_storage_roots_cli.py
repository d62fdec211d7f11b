"""Storage roots over the real ``rollout-ledger`` CLI (issue 44), on local disk and S3 (moto on loopback).

A mistyped root is refused before anything is written, saying what was probably meant and naming the
supported schemes (exit 2); a missing root is created only by plan, which says so, and never directly under
``/``; an unknown batch id lists the batches the root holds and the closest id; what a batch publishes on
local disk follows the umask (or ``$ROLLOUT_LEDGER_FILE_MODE``), while the server key ``serve`` makes stays
0600. Everything runs without an engine except one shard generated on the fake engine for the dataset.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.cli.main import main
from tasks.errors import EXIT_USAGE
from tasks.storage.file_modes import FILE_MODE_VARIABLE

from .test_cli import one_line_error, plan_args

REPO = Path(__file__).resolve().parents[1]
SUPPORTED = "Supported storage roots: a local path, file:///absolute/path, s3://bucket/prefix, s3a://bucket/prefix"
COMMANDS_ON_A_BATCH = (
    ["status"],
    ["finalize", "--no-audit"],
    ["validate"],
    ["publish", "--reject", "--reason", "typo"],
    ["sweep", "--shard", "0", "--dry-run"],
)

# What fsspec used to read as a path under the current directory, or could not read at all.
TYPOS = {
    "s3:/my-bucket/runs": ["is not a well-formed URL", "did you mean s3://my-bucket/runs?"],
    "s3:my-bucket/runs": ["is not a well-formed URL", "did you mean s3://my-bucket/runs?"],
    "file://tmp/x": ["names the host 'tmp'", "a file URL is file:///absolute/path", "did you mean file:///tmp/x?"],
    "file:/tmp/x": ["a file URL is file:///absolute/path", "did you mean file:///tmp/x?"],
    "htps://my-bucket/runs": ["scheme 'htps' is not supported", "did you mean https://?"],
    "blob://my-bucket/runs": ["scheme 'blob' is not supported", "only to local disk and S3"],
    "s3:///my-bucket/runs": ["names no bucket", "did you mean s3://my-bucket/runs?"],
}


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m tasks.cli`` in its own process, in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "tasks.cli", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("root", list(TYPOS))
def test_a_mistyped_root_is_refused_before_anything_is_written(root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for args in (plan_args(root), ["status", "--root", root, "--batch-id", "b-cli"]):
        line = one_line_error(capsys, main(args), EXIT_USAGE, f"storage root {root!r}", *TYPOS[root], SUPPORTED)
        assert "Nothing was written" in line
    assert tree(tmp_path) == []


def test_the_first_trial_typo_in_its_own_process_exits_2_and_writes_nothing_under_the_current_folder(tmp_path):
    done = cli(*plan_args("s3:/my-bucket/runs"), cwd=tmp_path)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert done.stderr.strip().splitlines() == [
        "rollout-ledger plan: error: storage root 's3:/my-bucket/runs' is not a well-formed URL: did you mean "
        "s3://my-bucket/runs? Nothing was written. Supported storage roots: a local path, file:///absolute/path, "
        "s3://bucket/prefix, s3a://bucket/prefix, memory://name (tests, one process)."
    ]
    assert tree(tmp_path) == []


def test_gs_is_refused_naming_the_schemes_that_work(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    needles = ["scheme 'gs' is not supported", "only to local disk and S3", SUPPORTED]
    if importlib.util.find_spec("gcsfs") is None:
        needles.append("gs:// would also need gcsfs, which is not installed")
    one_line_error(capsys, main(plan_args("gs://my-bucket/runs")), EXIT_USAGE, *needles)
    assert tree(tmp_path) == []


@pytest.fixture
def top_level_folder() -> Iterator[Path]:
    """A folder directly under ``/`` that does not exist (and is removed if a failing run made it)."""
    top = Path(f"/rollout-ledger-test-nonexistent-{uuid.uuid4().hex[:8]}")
    assert not top.exists()
    yield top
    if top.exists():
        shutil.rmtree(top)


def test_nothing_is_created_directly_under_the_file_system_root(top_level_folder, capsys):
    root = str(top_level_folder / "x" / "runs")
    one_line_error(
        capsys,
        main(plan_args(root)),
        EXIT_USAGE,
        f"storage root {root} does not exist and would create {top_level_folder} at the top of the file system",
        f"if you mean it, create it first (mkdir -p {root}) and run again",
        SUPPORTED,
    )
    assert not top_level_folder.exists()
    one_line_error(
        capsys, main(["status", "--root", root, "--batch-id", "b-cli"]), EXIT_USAGE, f"no storage root {root}"
    )
    assert not top_level_folder.exists()


def test_the_store_itself_never_makes_a_folder_directly_under_the_root(top_level_folder):
    from tasks.errors import StorageRootError
    from tasks.storage.objects import ObjectStore

    with pytest.raises(StorageRootError, match="at the top of the file system"):
        ObjectStore(str(top_level_folder / "runs")).write_once("a/b.json", b"{}")
    assert not top_level_folder.exists()


def test_a_missing_root_is_an_error_for_every_command_but_plan_and_nothing_is_created(tmp_path, capsys):
    root = tmp_path / "runz"
    for command in COMMANDS_ON_A_BATCH:
        one_line_error(
            capsys,
            main([command[0], "--root", str(root), "--batch-id", "b-cli", *command[1:]]),
            EXIT_USAGE,
            f"rollout-ledger {command[0]}: error: no storage root {root}: it does not exist, and {command[0]} "
            "created nothing (plan creates a root with its first batch)",
            SUPPORTED,
        )
    assert tree(tmp_path) == []


def test_plan_says_it_creates_a_new_root_once(tmp_path, capsys):
    root = tmp_path / "new" / "runs"
    assert main(plan_args(str(root), "b-one")) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "storage root" in line]
    assert said == [f"rollout-ledger plan: created a new storage root {root} (it did not exist)"]
    assert (root / "batches" / "b-one" / "plan" / "batch.json").is_file()
    assert main(plan_args(str(root), "b-two")) == 0
    assert "storage root" not in capsys.readouterr().err


def test_a_mistyped_batch_id_lists_the_batches_and_the_closest_one(tmp_path, capsys):
    root = tmp_path / "runs"
    assert main(plan_args(str(root), "b-cli")) == 0
    for number in range(10):  # more batches than the message lists
        (root / "batches" / f"b-{number:02d}" / "plan").mkdir(parents=True)
    before = tree(tmp_path)
    capsys.readouterr()
    expected = (
        f"no batch 'b-clj' under {root}; did you mean b-cli? It holds 11 batches: b-00, b-01, b-02, b-03, b-04, "
        "b-05, b-06, b-07 and 3 more"
    )
    for command in COMMANDS_ON_A_BATCH:
        args = [command[0], "--root", str(root), "--batch-id", "b-clj", *command[1:]]
        line = one_line_error(capsys, main(args), EXIT_USAGE, f"rollout-ledger {command[0]}: error: {expected}")
        assert "rollout-ledger plan" not in line
    generated = cli("generate", "--root", str(root), "--batch-id", "b-clj", "--all-shards", cwd=tmp_path)
    assert generated.returncode == EXIT_USAGE and expected in generated.stderr, generated.stderr
    assert "starting the engine" not in generated.stderr
    assert tree(tmp_path) == before


def test_on_s3_a_missing_root_is_named_plan_creates_it_and_a_mistyped_batch_lists_the_batches(s3_bucket, capsys):
    root = f"{s3_bucket}/runs"
    one_line_error(
        capsys,
        main(["status", "--root", root, "--batch-id", "b-cli"]),
        EXIT_USAGE,
        f"no storage root {root}: it does not exist, and status created nothing",
        SUPPORTED,
    )
    missing_bucket = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/runs"
    one_line_error(
        capsys,
        main(plan_args(missing_bucket)),
        EXIT_USAGE,
        "does not exist or these credentials cannot see it",
        "AWS variables read: ",
        "plan does not create buckets",
    )
    assert main(plan_args(root, "b-cli")) == 0
    assert f"rollout-ledger plan: created a new storage root {root} (it did not exist)" in capsys.readouterr().err
    assert main(plan_args(root, "b-other")) == 0
    capsys.readouterr()
    one_line_error(
        capsys,
        main(["status", "--root", root, "--batch-id", "b-clj"]),
        EXIT_USAGE,
        f"rollout-ledger status: error: no batch 'b-clj' under {root}; did you mean b-cli? It holds 2 batches: "
        "b-cli, b-other",
    )


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.mark.parametrize(
    ("mask", "variable", "file_mode", "folder_mode"),
    [(0o022, None, 0o644, 0o755), (0o077, None, 0o600, 0o700), (0o077, "0640", 0o640, 0o750)],
    ids=["umask-022", "umask-077", "ROLLOUT_LEDGER_FILE_MODE-0640"],
)
def test_a_published_dataset_follows_the_umask_or_the_file_mode_variable(
    mask, variable, file_mode, folder_mode, tmp_path, monkeypatch, capsys, tokenizer
):
    from tasks.batch import Batch
    from tasks.generate import generate_shards

    from .generation.fakes import FakeScriptedEngine

    if variable is None:
        monkeypatch.delenv(FILE_MODE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(FILE_MODE_VARIABLE, variable)
    root = tmp_path / "runs"
    with umask(mask):
        assert main(plan_args(str(root), "b-modes")) == 0
        engine = FakeScriptedEngine(tokenizer, reply=lambda request: "5")
        generate_shards(Batch.open(str(root), "b-modes"), [0], engine=engine, run=asyncio.run, progress=False)
        assert main(["finalize", "--root", str(root), "--batch-id", "b-modes", "--no-audit"]) == 0, (
            capsys.readouterr().err
        )
    batch = root / "batches" / "b-modes"
    published = [batch / "dataset" / "_COMMITTED.json", batch / "dataset" / "part-00000.parquet"]
    published += [batch / "dataset" / "README.md", batch / "reports" / "index.html"]
    assert all(path.is_file() for path in published)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}
    wrong = {
        path: oct(mode)
        for path, mode in modes.items()
        if mode != (folder_mode if (tmp_path / path).is_dir() else file_mode)
    }
    assert not wrong, f"expected files {oct(file_mode)} and folders {oct(folder_mode)}: {wrong}"
    assert len(modes) > 30


@pytest.mark.parametrize("value", ["999", "0o1777", "0444", "rw-r--r--", "0x1a4"])
def test_a_malformed_file_mode_variable_is_refused_before_anything_is_written(value, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(FILE_MODE_VARIABLE, value)
    one_line_error(
        capsys,
        main(plan_args(str(tmp_path / "runs"))),
        EXIT_USAGE,
        f"$ROLLOUT_LEDGER_FILE_MODE must be an octal file mode of at most 0777 that lets the owner read and write "
        f"(0600, 0640, 0644, ...), got {value!r}",
    )
    assert tree(tmp_path) == []


def test_the_serve_key_stays_0600_whatever_the_umask_or_file_mode(tmp_path, monkeypatch):
    from tasks.engines.vllm_server.serving.keys import generated_key_path, write_new_key

    monkeypatch.setenv("ROLLOUT_LEDGER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(FILE_MODE_VARIABLE, "0666")
    with umask(0):
        path = generated_key_path(8123)
        write_new_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_a_library_caller_and_airflow_get_the_same_refusals():
    from tasks.batch import Batch
    from tasks.entry_point import classify_error
    from tasks.errors import StorageRootError
    from tasks.orchestration.storage_location import storage_location

    with pytest.raises(StorageRootError, match=r"did you mean s3://my-bucket/runs\?"):
        Batch.open("s3:/my-bucket/runs", "b")
    with pytest.raises(StorageRootError, match=r"names the host 'tmp'.*did you mean file:///tmp/x\?"):
        storage_location("file://tmp/x")
    with pytest.raises(StorageRootError, match=r"did you mean s3://my-bucket/runs\?"):
        storage_location("s3:my-bucket/runs")
    assert storage_location("file://localhost/tmp/x").root_url == "file:///tmp/x"
    assert Batch.open("file://localhost/tmp/x", "b").store.root == "/tmp/x/batches/b"
    try:  # fsspec's own error for a scheme it cannot load, from a library caller that skipped the check
        import fsspec

        fsspec.filesystem("no-such-protocol")
    except ValueError as exc:
        code, line = classify_error(exc, "status", "no-such-protocol://x")
    assert code == EXIT_USAGE and "cannot use storage no-such-protocol://x" in line and SUPPORTED in line
