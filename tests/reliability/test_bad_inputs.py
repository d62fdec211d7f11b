"""The bad-input corpus (docs/reliability.md): every bad input gets a clear error naming what is wrong,
or a named failure row / receipt, and nothing already committed is lost.

Generation runs on the FAKE scripted engine (:mod:`tests.generation.fakes`, real tokenizer, real
Parquet on local disk); the misbehaving environments are fakes too (:mod:`.bad_environments`).

Already covered elsewhere, not repeated here:

* ids: ``tests/test_ids.py`` (``../etc``, ``a/b``, ``.hidden``, ``é``, 129 characters, ``a\\nb`` ...);
* configs: ``tests/test_config.py`` (each invalid field named; stored configs checked as strictly),
  ``tests/orchestration/test_form.py::test_a_bad_value_is_named``,
  ``tests/orchestration/test_profiles.py::test_a_bad_field_is_named_with_its_profile``;
* context length: ``tests/generation/test_generate_with_fake_engine.py::test_context_length_is_a_named_failure``
  (a conversation that outgrows the engine); here: a prompt over the limit on its first call;
* markers and tampered committed bytes: ``tests/storage/test_marker.py``,
  ``tests/finalize/test_tamper.py`` (real engine, disk rot and resealed corruption, each reason),
  ``tests/finalize/test_publish.py::test_tampered_part_fails_its_checksum``,
  ``tests/validate/test_dataset_suite.py`` (a part the manifest does not name, a foreign schema).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks import ids
from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.errors import ConfigError, StorageIntegrityError
from tasks.finalize.stage import finalize_batch
from tasks.generate import MAX_ERROR_CHARS, generate_shard
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tasks.storage.dataset_manifest import read_dataset_part, read_staged_marker
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.marker import read_marker
from tasks.storage.sweep import sweep_orphans
from tests.local_batch import LocalBatch, copy_batch

from .bad_environments import BAD_INITIAL, BAD_REPLY
from .conftest import reliability_config

BAD_ENVIRONMENT = "tests.reliability.bad_environments:MalformedOutputEnvironment"


def run_bad_environment(root: Path, tokenizer, case: str, *, max_model_len: int = 512):
    """Plan and generate one shard of the misbehaving environment; return its ledger reader and summary."""
    from tests.generation.fakes import FakeScriptedEngine

    config = reliability_config(
        environment=BAD_ENVIRONMENT, environment_options={"case": case}, num_tasks=2, shards=1, max_turns=3
    )
    plan_batch(Batch.open(str(root), config.batch_id), config)
    engine = FakeScriptedEngine(tokenizer, reply=lambda request: "5", max_model_len=max_model_len)
    summary = generate_shard(Batch.open(str(root), config.batch_id), 0, engine=engine, run=asyncio.run, progress=False)
    store = Batch.open(str(root), config.batch_id).store
    assert read_marker(store, 0) is not None  # the shard commits: a bad rollout never fails the shard
    return LedgerReader(store, 0), summary


# --- malformed environment outputs -------------------------------------------------------------

ENVIRONMENT_ERRORS = {
    "int_content": "message 0 (user) has no str content",
    "none_content": "message 0 (user) has no str content",
    "parts_content": "message 0 (user) has no str content",
    "no_role": "message 0 must be a dict with a role in",
    "unknown_role": "message 0 must be a dict with a role in",
    "not_a_dict": "message 0 must be a dict with a role in",
    "huge_bad_role": "characters)",
    "reply_int_content": "turn 1: message 2 (user) has no str content",
    "tool_calls_not_a_list": "message 2 (assistant) tool_calls must be a list",
    "tool_call_without_function": "tool_calls[0] must have a function with a non-empty str name",
    "tool_call_name_not_str": "tool_calls[0] must have a function with a non-empty str name",
    "tool_call_id_not_str": "message 2 (tool) tool_call_id must be a str",
    "unknown_message_key": "message 2 (user) has unknown key(s) ['metadata']",
}
CONTEXT_FAILURES = {"huge_message": "a00.c000", "huge_reply": "a00.c001"}
assert set(ENVIRONMENT_ERRORS) | set(CONTEXT_FAILURES) == set(BAD_INITIAL) | set(BAD_REPLY)


@pytest.mark.parametrize(("case", "named"), sorted(ENVIRONMENT_ERRORS.items()))
def test_malformed_environment_output_fails_its_rollout_with_a_bounded_named_error(
    tmp_path, tokenizer, caplog, case, named
):
    ledger, summary = run_bad_environment(tmp_path, tokenizer, case)
    assert summary.failed == summary.rollouts == 4
    for bundle in ledger.rollouts():
        receipt = bundle.receipt
        assert (receipt.status, receipt.failure_reason) == ("failed", "environment_error")
        error = json.loads(receipt.reward_info)["error"]
        assert receipt.rollout_id in error and named in error
        assert len(error) <= MAX_ERROR_CHARS + 40  # a huge environment output never lands whole in a receipt
    assert all(len(r.getMessage()) < MAX_ERROR_CHARS + 200 for r in caplog.records)


@pytest.mark.parametrize(("case", "call"), sorted(CONTEXT_FAILURES.items()))
def test_a_prompt_over_the_context_length_is_a_named_failure_row_and_never_reaches_the_engine(
    tmp_path, tokenizer, case, call
):
    ledger, summary = run_bad_environment(tmp_path, tokenizer, case, max_model_len=512)
    assert summary.poisoned == summary.rollouts
    for bundle in ledger.rollouts():
        assert bundle.receipt.failure_reason == "context_length"
        (failure,) = bundle.failures
        assert failure.reason == "context_length" and failure.call_id.endswith(call)
        assert "the engine accepts 512 in all" in failure.detail and len(failure.detail) <= 2000


def test_max_tokens_is_clipped_to_the_context_left(tmp_path, tokenizer):
    """A prompt that fits leaves the engine only the rest of its context, never more."""
    from tests.generation.fakes import FakeScriptedEngine

    config = reliability_config(num_tasks=1, shards=1, max_turns=1, sampling=SamplingSettings(max_tokens=4096))
    plan_batch(Batch.open(str(tmp_path), config.batch_id), config)
    engine = FakeScriptedEngine(tokenizer, max_model_len=300)
    generate_shard(Batch.open(str(tmp_path), config.batch_id), 0, engine=engine, run=asyncio.run, progress=False)
    assert engine.requests
    for request in engine.requests:
        assert request.max_tokens == 300 - len(request.prompt_token_ids)


# --- invalid ids --------------------------------------------------------------------------------

BAD_IDS = ["../x", "..", "a/../../etc", "/abs", "x\\..\\y", "ünïcode", "ﬁle", "٣", "a\u200bb", "", " ", "x" * 129]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_an_invalid_batch_id_is_refused_by_name_before_any_storage_path_is_built(tmp_path, bad):
    with pytest.raises(ConfigError, match="batch_id"):
        reliability_config(batch_id=bad)
    with pytest.raises((TypeError, ValueError), match="batch_id"):
        Batch.open(str(tmp_path), bad)
    with pytest.raises(ValueError, match="rollout_id"):
        ids.staging_key(bad, "r000000-00.a00.c000")
    assert list(tmp_path.iterdir()) == []


# --- configs with wrong types -------------------------------------------------------------------

WRONG_TYPES = [
    ({"environment_options": "lo=1"}, "environment_options must be a JSON object"),
    ({"environment_options": [1, 2]}, "environment_options must be a JSON object"),
    ({"num_tasks": "4"}, "num_tasks must be an int"),
    ({"num_tasks": 4.0}, "num_tasks must be an int"),
    ({"seed": None}, "seed must be an int"),
    ({"sampling": {"temperature": "hot"}}, "sampling: temperature must be a finite number"),
    ({"sampling": {"top_p": "1"}}, "sampling: top_p must be a finite number"),
    ({"sampling": {"top_k": True}}, "sampling: top_k must be -1 (off) or a positive int"),
    ({"staging": {"max_rows": "512"}}, "staging.max_rows must be an int >= 1"),
    ({"staging": {"max_bytes": 0}}, "staging.max_bytes must be an int >= 1"),
    ({"staging": {"max_delay_ms": "fast"}}, "staging.max_delay_ms must be a finite number"),
    ({"staging": {"max_delay_ms": -1}}, "staging.max_delay_ms must be >= 0"),
    ({"validation": {"max_poisoned_rate": "0.1"}}, "validation.max_poisoned_rate must be a finite number"),
    ({"engine": {"options": "max_model_len=1"}}, "engine.options must be a JSON object"),
    ({"model": ["fake-model"]}, "batch config.model must be a JSON object"),
    ({"code_version": 3}, "code_version must be a str"),
    ({"on_invalid": ["mask"]}, "on_invalid must be one of"),
]


@pytest.mark.parametrize(("patch", "named"), WRONG_TYPES)
def test_a_stored_config_with_a_wrong_type_is_refused_naming_the_field(patch, named):
    raw = json.loads(reliability_config().to_json()) | patch
    with pytest.raises(ConfigError) as error:
        BatchConfig.from_dict(raw)
    assert named in str(error.value)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"environment_options": "lo=1"}, "environment_options must be a JSON object"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"top_k": True}, "top_k must be an int >= -1, got True"),
        ({"max_tokens": "32"}, "max_tokens must be an int"),
        ({"seed": 1.5}, "seed must be an int"),
    ],
)
def test_the_airflow_form_names_a_wrong_type(values, named):
    from tasks.config import config_from_values
    from tasks.orchestration.form import form_defaults

    provenance = {"weights_sha256": "a" * 64, "tokenizer_sha256": "b" * 64, "chat_template_sha256": "c" * 64}
    with pytest.raises(ConfigError) as error:
        config_from_values({**form_defaults(), **values}, batch_id="b1", model=provenance)
    assert named in str(error.value)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ("{environment_options: lo}", "params.environment_options"),
        ("{temperature: hot}", "params.temperature"),
        ("{num_tasks: '4'}", "params.num_tasks"),
    ],
)
def test_a_profile_with_a_wrong_type_is_named(tmp_path, params, named):
    from tasks.errors import ProfileError
    from tasks.orchestration.profiles import load_profiles

    path = tmp_path / "profiles.yaml"
    path.write_text(f'profiles:\n  p:\n    schedule: "0 3 * * *"\n    params: {params}\n')
    with pytest.raises(ProfileError) as error:
        load_profiles(path)
    assert named in str(error.value)


# --- corrupted or foreign Parquet in a committed batch ------------------------------------------


def dataset_rows(batch: LocalBatch) -> dict[str, dict]:
    marker = read_staged_marker(batch.store)
    table = pa.concat_tables(read_dataset_part(batch.store, part) for part in marker.parts)
    return {row["rollout_id"]: row for row in table.to_pylist()}


@pytest.fixture(scope="module")
def clean_rows(committed_batch, tmp_path_factory) -> dict[str, dict]:
    batch = copy_batch(committed_batch, tmp_path_factory.mktemp("clean"))
    finalize_batch(batch.handle)
    return dataset_rows(batch)


def shard_rollouts(batch: LocalBatch, shard: int) -> set[str]:
    return {r.rollout_id for r in LedgerReader(batch.store, shard).receipts}


def foreign_table() -> pa.Table:
    return pa.table({"rollout_id": ["r000000-00"], "reward": [1e9], "note": ["not ours"]})


def plant_foreign_files(batch: LocalBatch) -> list[str]:
    """Parquet files no marker names, dropped next to committed ones; returns their batch-relative paths."""
    receipts = next(f.path for f in read_marker(batch.store, 0).files if f.kind == "receipts")
    forged = pq.read_table(batch.dir / receipts)
    forged = forged.set_column(
        forged.schema.get_field_index("reward"), "reward", pa.array([1e9] * forged.num_rows, pa.float64())
    )
    planted = {
        "ledger/shard-00000/attempt-00/receipts-000099.parquet": forged,  # a valid, forged receipts file
        "staging/shard-00000/attempt-00/seg-999999.parquet": foreign_table(),  # a foreign schema
        "ledger/shard-00001/attempt-07/calls-000000.parquet": b"PAR1 garbage PAR1",  # not Parquet at all
        "ledger/shard-00001/notes.parquet": (batch.dir / receipts).read_bytes()[:500],  # a truncated copy
    }
    for path, content in planted.items():
        target = batch.dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, pa.Table):
            pq.write_table(content, target)
        else:
            target.write_bytes(content)
    return sorted(planted)


def test_foreign_parquet_in_committed_shards_is_ignored_and_swept_by_name(committed_batch, clean_rows, tmp_path):
    batch = copy_batch(committed_batch, tmp_path)
    planted = plant_foreign_files(batch)
    staged = finalize_batch(batch.handle)
    assert dataset_rows(batch) == clean_rows  # nothing planted was read, nothing committed was lost
    assert staged.marker.rows == len(clean_rows) == batch.config.num_rollouts
    deleted = [path for shard in (0, 1) for path in sweep_orphans(batch.store, shard).deleted]
    assert sorted(deleted) == planted


def test_validation_and_publish_ignore_foreign_parquet_in_the_batch_and_the_dataset(
    committed_batch, clean_rows, tmp_path
):
    from tasks.pipeline import finalize_and_publish
    from tasks.storage.dataset_manifest import read_dataset_marker

    batch = copy_batch(committed_batch, tmp_path)
    plant_foreign_files(batch)
    finalize_batch(batch.handle)
    pq.write_table(foreign_table(), batch.dir / "dataset" / "part-099999.parquet")
    (batch.dir / "dataset" / "part-000000.parquet.tmp").write_bytes(b"junk")
    result = finalize_and_publish(batch.handle)
    assert {suite: outcome.status for suite, outcome in result.suites.items()} == {
        "lineage": "passed",
        "dataset": "passed",
    }
    published = read_dataset_marker(batch.store)
    assert all("099999" not in part.path for part in published.parts)
    assert dataset_rows(batch) == clean_rows


@pytest.mark.parametrize("kind", ["receipts", "calls", "staging"])
@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign_parquet"])
def test_a_damaged_named_file_rejects_only_its_shard_with_a_reason_and_keeps_the_other(
    committed_batch, clean_rows, tmp_path, caplog, kind, damage
):
    batch = copy_batch(committed_batch, tmp_path)
    path = next(f.path for f in read_marker(batch.store, 0).files if f.kind == kind)
    target = batch.dir / path
    if damage == "garbage":
        target.write_bytes(b"\0" * target.stat().st_size)
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    else:
        pq.write_table(foreign_table(), target)
    finalize_batch(batch.handle)
    rows = dataset_rows(batch)
    assert set(rows) == set(clean_rows)  # every planned rollout keeps its row
    for rollout_id in shard_rollouts(committed_batch, 0):
        assert rows[rollout_id]["sample_mask"] == 0 and rows[rollout_id]["mask_reason"]
    for rollout_id in shard_rollouts(committed_batch, 1):
        assert rows[rollout_id] == clean_rows[rollout_id]
    if kind != "staging":  # a ledger file: the whole shard's ledger is refused, the log names the file
        assert any(path in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    "content", [b"PAR1\0\0PAR1", b"", b'{"version": 1}', json.dumps({"files": "../../etc/passwd"}).encode()]
)
def test_a_damaged_shard_marker_is_refused_by_name(committed_batch, tmp_path, content):
    batch = copy_batch(committed_batch, tmp_path)
    (batch.dir / "ledger/shard-00000/_COMMITTED.json").write_bytes(content)
    with pytest.raises(StorageIntegrityError, match=r"ledger/shard-00000/_COMMITTED\.json"):
        finalize_batch(batch.handle)
    assert read_marker(batch.store, 1) is not None  # the other shard's commit is untouched
