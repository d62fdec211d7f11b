"""Write ``old_formats/``: records as the code of an older commit wrote them, for the compatibility tests.

Each file is produced by running a snippet against the ``tasks`` package of the commit named
beside it (``git archive``), so its bytes are that code's own serialization, not a hand-written
imitation. A name ending in ``/`` is a folder: its snippet writes files under ``target`` instead.
Run from the repository root (a git checkout with that history)::

    python tests/compat/make_old_formats.py

Files that already exist are left alone unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

HERE = Path(__file__).parent / "old_formats"

_CONFIG_V1 = """
from tasks.config import BatchConfig, ModelSpec
config = BatchConfig(batch_id="old-b1", environment="arithmetic", num_tasks=2, group_size=2, shards=2,
                     model=ModelSpec(path="/models/smollm2"), code_version="87c43b5")
"""
_CONFIG_V2 = """
from tasks.config import BatchConfig, ModelSpec
config = BatchConfig(batch_id="old-b1", environment="arithmetic", num_tasks=2, group_size=2, shards=2,
                     model=ModelSpec(reference="bundled:smollm2-135m-instruct"), code_version="old")
"""
_SHA = '"0123456789abcdef" * 4'
# A dataset of two parts (3 + 1 rows), its metrics and its card, as each era's file type names them.
_DATASET_FILES_V1 = f"""
from tasks.finalize.publish import DatasetFile
parts = (DatasetFile(path="dataset/part-00000.parquet", size=100, sha256={_SHA}, rows=3),
         DatasetFile(path="dataset/part-00001.parquet", size=60, sha256={_SHA}, rows=1))
metrics = DatasetFile(path="dataset/metrics.json", size=10, sha256={_SHA})
card = DatasetFile(path="dataset/README.md", size=20, sha256={_SHA})
"""
_DATASET_FILES_V3 = f"""
from tasks.storage.marker import MarkedFile
parts = (MarkedFile(path="dataset/part-00000.parquet", kind="part", size=100, sha256={_SHA}, rows=3),
         MarkedFile(path="dataset/part-00001.parquet", kind="part", size=60, sha256={_SHA}, rows=1))
metrics = MarkedFile(path="dataset/metrics.json", kind="metrics", size=10, sha256={_SHA}, rows=0)
card = MarkedFile(path="dataset/README.md", kind="card", size=20, sha256={_SHA}, rows=0)
"""
_DATASET_COUNTS = """
import json
from tasks.finalize.publish import DatasetMarker
counts = dict(batch_id="old-b1", schema_version=1, rows=4, trainable_rows=3, groups=2,
              config=json.loads(config.to_json()), committed_at=1764600000.0)
"""
_VALIDATION = """
validation = {suite: {"status": "warned" if suite == "lineage" else "passed",
                      "report": f"reports/{suite}/run-000/index.html",
                      "warned": ["all_shards_committed"] if suite == "lineage" else [],
                      "gx_version": "1.24.1", "validated_at": 1764600100.0}
              for suite in ("lineage", "dataset")}
"""
_REVIEW = """
from tasks.review import new_decision
review = new_decision("old-b1", "publish", "partial on purpose", decided_by="alice", via="cli", now=1764600200.0)
"""
# A whole published dataset of schema version 1 (its part, metrics, card, both manifests), as finalize
# and publish wrote it: one group of two rollouts, a trainable row whose calls were admitted at
# weight versions 0, 1 and 1, and a masked row without tokens (the second rollout's receipt missing).
_DATASET_ROWS_V1 = """
import dataclasses, json
from pathlib import Path
import numpy as np
from tasks import ids, layout
from tasks.finalize.assemble import AssembledRows, GroupStats
from tasks.finalize.card import render_card
from tasks.finalize.dataset_writer import stage_dataset
from tasks.records.dataset_row import CallSpan, DatasetRow, WeightSpan
from tasks.storage.marker import MarkedFile
from tasks.storage.objects import ObjectStore
config = BatchConfig(batch_id="old-b1", environment="arithmetic", num_tasks=1, group_size=2, shards=1,
                     model=ModelSpec(reference="bundled:smollm2-135m-instruct"), code_version="old")
trained = ids.rollout_id(0, 0)
calls, versions = ((5, 3), (2, 4), (1, 2)), (0, 1, 1)
spans, weights, mask, start = [], [], [], 0
for ordinal, ((carry, gen), version) in enumerate(zip(calls, versions)):
    call = ids.call_id(trained, 0, ordinal)
    spans.append(CallSpan(call_id=call, carry_len=carry, gen_len=gen))
    weights.append(WeightSpan(call_id=call, start=start, end=start + carry + gen, weight_version=version))
    mask += [0] * carry + [1] * gen
    start += carry + gen
mask = np.array(mask, np.uint8)
common = dict(batch_id="old-b1", group_id=ids.group_id(0), group_size=2, advantage=0.0)
rows = [
    DatasetRow(**common, rollout_id=trained, input_ids=np.arange(100, 100 + mask.size, dtype=np.int32),
               loss_mask=mask, logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32), prompt_len=5,
               reward=1.0, sample_mask=1, mask_reason=None, weight_version_min=0, weight_version_max=1,
               weight_version_spans=tuple(weights), call_spans=tuple(spans), truncated=False, num_turns=3,
               terminal_selection="declared"),
    DatasetRow(**common, rollout_id=ids.rollout_id(0, 1), input_ids=[], loss_mask=[], logprobs=[], prompt_len=0,
               reward=None, sample_mask=0, mask_reason="missing_receipt", weight_version_min=None,
               weight_version_max=None, weight_version_spans=(), call_spans=(), truncated=False, num_turns=0,
               terminal_selection=None),
]
stats = GroupStats(group_id=ids.group_id(0), planned=2, valid=1, missing=1, rows=2, advantage_outcome="single_valid",
                   weight_version=0, invalid_reasons=(("missing_receipt", 1),))
assembled = AssembledRows(table=DatasetRow.to_table(rows), groups=(stats,), receipts=1, epoch_span_count=0,
                          terminal_selections=(("declared", 1),))
store = ObjectStore(target)
staged = stage_dataset(store, [assembled], config=config, now=1764600000.0).marker
outcomes = {suite: {"status": "passed", "warned": [], "report": f"reports/{suite}/run-000/index.html",
                    "gx_version": "1.24.1", "validated_at": 1764600100.0} for suite in ("lineage", "dataset")}
metrics = json.loads(store.read_bytes(layout.DATASET_METRICS))
card = render_card(batch_id="old-b1", config=staged.config, metrics=metrics,
                   parts=[dataclasses.asdict(p) for p in staged.parts], validation=outcomes, review=None)
card_file = MarkedFile.of(store.write_once(layout.DATASET_CARD, card.encode()), kind="card", rows=0)
committed = dataclasses.replace(staged, card=card_file, validation=outcomes)
store.write_once(layout.DATASET_MARKER, committed.to_json().encode())
out = ""
"""

# The same dataset as schema version 2 wrote it (before the rows said how they were sampled), from a batch
# sampled with top-p 0.9 / top-k 50: its manifest's config says so, its rows hold no sampling and no kept sets.
# Version 0's weights are named by a sha256, version 1's declared (null).
_DATASET_ROWS_V2 = (
    _DATASET_ROWS_V1.replace(
        "from tasks.records.dataset_row import CallSpan, DatasetRow, WeightSpan",
        "from tasks.records.dataset_row import CallSpan, DatasetRow, VersionWeights, WeightSpan\n"
        "from tasks.sampling import SamplingSettings",
    )
    .replace(
        'code_version="old")\ntrained',
        'code_version="old",\n'
        "                     sampling=SamplingSettings(temperature=0.9, top_p=0.9, top_k=50))\ntrained",
    )
    .replace(
        "weight_version_spans=tuple(weights), call_spans",
        "weight_version_spans=tuple(weights), weights_by_version=(VersionWeights(0, 'ab' * 32), "
        "VersionWeights(1, None)), call_spans",
    )
    .replace("weight_version_spans=(), call_spans", "weight_version_spans=(), weights_by_version=(), call_spans")
)

# A batch of one shard committed by version-1 markers' code after a killed attempt: attempt 0 receipted
# r000000-00 (2 calls) and left r000000-01's 2 calls in the same calls file; attempt 1 adopted the first,
# and the second replayed its first call and diverged from its second (a live call instead), so the marker
# names 5 call records (counts.calls) of which the rollouts use 4.
_LEDGER_V1_RESUMED = """
import shutil, tempfile
import numpy as np
from tasks.batch import Batch
from tasks.config import BatchConfig, ModelSpec
from tasks.ids import call_id
from tasks.plan import plan_batch
from tasks.records.ledger import CallRecord, Receipt, StagedDelta
from tasks.storage.ledger_writer import LedgerWriter
from tasks.storage.recovery import carried_files, recover_earlier_attempts
from tasks.storage.staging import StagingWriter
config = BatchConfig(batch_id="old-b1", environment="arithmetic", num_tasks=1, group_size=2, shards=1,
                     model=ModelSpec(reference="fake-model"), code_version="old")
root = tempfile.mkdtemp()
batch = Batch.open(root, "old-b1")
plan_batch(batch, config)
store = batch.store
adopted, resumed = "r000000-00", "r000000-01"
tokens = {}  # call id -> the call's prompt and sampled ids

def delta(rollout, attempt, ordinal, parent=None):
    prefix = np.zeros(0, np.int64) if parent is None else tokens[parent.call_id]
    prompt = np.concatenate([prefix, [100 + ordinal, 101]]).astype(np.int64)
    made = StagedDelta.build(batch_id="old-b1", rollout_id=rollout, call_id=call_id(rollout, attempt, ordinal),
                             parent_call_id=None if parent is None else parent.call_id,
                             parent_chain_hash=None if parent is None else parent.chain_hash,
                             prefix_token_ids=prefix, prompt_token_ids=prompt, generated_token_ids=[200 + ordinal, 2],
                             generated_logprobs=[-0.5, -0.25], weight_version=0, finish_reason="stop",
                             temperature=1.0, top_p=1.0, top_k=-1)
    tokens[made.call_id] = np.concatenate([prompt, [200 + ordinal, 2]]).astype(np.int64)
    return made

def receipt(rollout, attempt, terminal, replayed=()):
    return Receipt(rollout_id=rollout, group_id="g000000", attempt=attempt, reward=1.0, reward_info="{}",
                   terminal_call_id=terminal, terminal_selection="declared", terminal_attribution_reason=None,
                   status="ok", failure_reason=None, num_calls=2, replayed_calls=tuple(replayed))

def stage(writer, attempt, deltas):  # one segment, then a call record per delta
    with StagingWriter(store, shard=0, attempt=attempt, max_delay_ms=10_000) as staging:
        futures = [staging.submit(d) for d in deltas]
        for made, future in zip(deltas, futures):
            where = future.result(timeout=60)
            writer.add_call(CallRecord.for_staged(made, staging_segment=where.segment, staging_row=where.row,
                                                  admitted_at=1764600000.0))
    return staging.segments

a0 = delta(adopted, 0, 0); a1 = delta(adopted, 0, 1, a0); b0 = delta(resumed, 0, 0); b1 = delta(resumed, 0, 1, b0)
first = LedgerWriter(store, batch_id="old-b1", shard=0, attempt=0)
stage(first, 0, [a0, a1, b0, b1])
first.add_receipt(receipt(adopted, 0, a1.call_id))
first.flush()  # then the attempt was killed: no marker
recovery = recover_earlier_attempts(store, 0, attempt=1)
second = LedgerWriter(store, batch_id="old-b1", shard=0, attempt=1, adopted=recovery)
live = delta(resumed, 1, 1, b0)  # replayed b0, diverged from b1
segments = stage(second, 1, [live])
second.add_receipt(receipt(resumed, 1, live.call_id, replayed=[b0.call_id]))
replayed = [c for c in recovery.unreceipted[resumed] if c.record.call_id == b0.call_id]
marker = second.commit(staging_segments=segments, carried=carried_files(store, 0, replayed))
assert (marker.marker_version, marker.counts.calls, len(marker.files_of("calls"))) == (1, 5, 2)
shutil.copytree(f"{root}/batches/old-b1", target)
shutil.rmtree(root)
out = ""
"""

# file name -> (commit whose code writes it, snippet that leaves the bytes in `out`)
FORMATS: dict[str, tuple[str, str]] = {
    "batch-config-v1.json": ("87c43b5", _CONFIG_V1 + "out = config.to_json()"),
    "batch-config-v2-first.json": ("c8f4a6f", _CONFIG_V2 + "out = config.to_json()"),
    "shard-marker-v1.json": (
        "82b2a78",
        f"""
from tasks.storage import layout
from tasks.storage.marker import MarkedFile, ShardCounts, ShardMarker
files = (MarkedFile(path=layout.staging_segment(0, 0, 0), kind="staging", size=9, sha256={_SHA}, rows=4),
         MarkedFile(path=layout.ledger_file(0, 0, "calls", 0), kind="calls", size=9, sha256={_SHA}, rows=4),
         MarkedFile(path=layout.ledger_file(0, 0, "receipts", 0), kind="receipts", size=9, sha256={_SHA}, rows=2))
counts = ShardCounts(rollouts=2, ok=2, poisoned=0, failed=0, calls=4, failures=0, staged_rows=4, adopted_rollouts=0)
out = ShardMarker(batch_id="old-b1", shard=0, attempt=0, files=files, counts=counts,
                  committed_at=1764600000.0).to_json()
""",
    ),
    "attempt-claim-first.json": (
        "c8f4a6f",
        """
from tasks.storage.claims import AttemptClaim
out = AttemptClaim(batch_id="old-b1", shard=0, attempt=0, host="worker-1", pid=4242, started_at=1764600000.0,
                   try_number=1, code_version="old").to_json()
""",
    ),
    "suite-summary-first.json": (
        "50469dc",
        """
from tasks.config import ValidationSpec
from tasks.validate.summary import ExpectationOutcome, SuiteSummary, SummaryCounts
warned = ExpectationOutcome(name="all_shards_committed", expectation="expect_column_values_to_be_in_set",
                            severity="warn", success=False, observed=0.5, threshold=None, unexpected_count=1,
                            examples=("1",), error=None)
out = SuiteSummary(suite="lineage", batch_id="old-b1", status="warned", success=True, expectations=(warned,),
                   counts=SummaryCounts(expectations=1, failed=0, warned=1, rows=2), thresholds=ValidationSpec(),
                   gx_version="1.24.1", report="reports/lineage/run-000/index.html", created_at=1764600100.0,
                   run="run-000", run_key="ab" * 32, inputs={"ledger/shard-00000/_COMMITTED.json": "cd" * 32}).to_json()
""",
    ),
    "review-v1.json": ("331a738", _REVIEW + "out = review.to_json()"),
    "dataset-v1-committed.json": (
        "d4ad1bf",
        _CONFIG_V1
        + _DATASET_FILES_V1
        + _DATASET_COUNTS
        + "out = DatasetMarker(parts=parts, metrics=metrics, card=card, **counts).to_json()",
    ),
    "dataset-v2-committed.json": (
        "79128e6",
        _CONFIG_V2
        + _DATASET_FILES_V1
        + _DATASET_COUNTS
        + "out = DatasetMarker(parts=parts, metrics=metrics, card=card, missing_shards=(1,), partial=True,"
        " **counts).to_json()",
    ),
    "dataset-v3-committed-unvalidated.json": (
        "71b6fc4",
        _CONFIG_V2
        + _DATASET_FILES_V3
        + _DATASET_COUNTS
        + "out = DatasetMarker(parts=parts, metrics=metrics, card=card, missing_shards=(1,), partial=True,"
        " **counts).to_json()",
    ),
    "dataset-v3-staged.json": (
        "19793a7",
        _CONFIG_V2
        + _DATASET_FILES_V3
        + _DATASET_COUNTS
        + "out = DatasetMarker(parts=parts, metrics=metrics, card=card, missing_shards=(1,), partial=True,"
        " **counts).to_json()",
    ),
    "dataset-v3-committed.json": (
        "19793a7",
        _CONFIG_V2
        + _DATASET_FILES_V3
        + _DATASET_COUNTS
        + _VALIDATION
        + "out = DatasetMarker(parts=parts, metrics=metrics, card=card, missing_shards=(1,), partial=True,"
        " validation=validation, **counts).to_json()",
    ),
    "dataset-v4-committed-review-v1.json": (
        "52eeab8",
        _CONFIG_V2
        + _DATASET_FILES_V3
        + _DATASET_COUNTS
        + _VALIDATION
        + _REVIEW
        + "out = DatasetMarker(parts=parts, metrics=metrics, card=card, missing_shards=(1,), partial=True,"
        " validation=validation, review=review, **counts).to_json()",
    ),
    "ledger-schemas-v2.txt": (
        "82b2a78",
        """
from tasks.capture.records import CallRecord, FailureRow, Receipt, StagedDelta
out = "".join(f"{c.__name__}\\n{c.arrow_schema().to_string(show_schema_metadata=True)}\\n"
              for c in (StagedDelta, CallRecord, FailureRow, Receipt))
""",
    ),
    "dataset-row-schema-v1.txt": (
        "d4ad1bf",
        """
from tasks.finalize.dataset import DatasetRow
out = DatasetRow.arrow_schema().to_string(show_schema_metadata=True) + "\\n"
""",
    ),
    "dataset-rows-v1/": ("39f6146", _CONFIG_V2 + _DATASET_ROWS_V1),
    "ledger-receipts-v2/": (
        "d229728",
        """
import pathlib
from tasks.records.ledger import Receipt
from tasks.storage.ledger_files import encode_ledger_file
receipt = Receipt(rollout_id="r000000-00", group_id="g000000", attempt=0, reward=1.0, reward_info="{}",
                  terminal_call_id="r000000-00.a00.c000", terminal_selection="declared",
                  terminal_attribution_reason="selected", status="ok", failure_reason=None, num_calls=1)
folder = pathlib.Path(target)
folder.mkdir(parents=True, exist_ok=True)
(folder / "receipts-000000.parquet").write_bytes(encode_ledger_file(Receipt, [receipt]))
out = ""
""",
    ),
    "ledger-v1-resumed/": ("da2b6c5", _LEDGER_V1_RESUMED),
    "dataset-rows-v2/": ("52b04d1", _CONFIG_V2 + _DATASET_ROWS_V2),
    "dataset-row-schema-v2.txt": (
        "3e4c138",
        """
from tasks.records.dataset_row import DatasetRow
out = DatasetRow.arrow_schema().to_string(show_schema_metadata=True) + "\\n"
""",
    ),
    "dataset-row-schema-v3.txt": (
        "ee9f94e",
        """
from tasks.records.dataset_row import DatasetRow
out = DatasetRow.arrow_schema().to_string(show_schema_metadata=True) + "\\n"
""",
    ),
}


def write(name: str, commit: str, snippet: str, *, checkout: Path) -> None:
    """Run ``snippet`` on ``commit``'s ``tasks`` package and store what it leaves in ``out`` as ``name``
    (a folder ``name`` ending in ``/``: what it writes under ``target``)."""
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(
            ["git", "-C", str(checkout), "archive", commit, "tasks"], check=True, capture_output=True
        ).stdout
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        path = HERE / name
        target = f"target = {str(path)!r}\n" if name.endswith("/") else ""
        program = target + snippet + "\nimport sys\nsys.stdout.write(out)\n"
        result = subprocess.run(
            [sys.executable, "-c", program],
            check=True,
            capture_output=True,
            cwd=tree,
            env={**os.environ, "PYTHONPATH": tree},
        )
    if not name.endswith("/"):
        path.write_bytes(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rewrite files that exist")
    args = parser.parse_args()
    HERE.mkdir(exist_ok=True)
    checkout = Path(__file__).resolve().parents[2]
    for name, (commit, snippet) in FORMATS.items():
        if args.force or not (HERE / name).exists():
            write(name, commit, snippet, checkout=checkout)
            print(f"{name}: written by {commit}")


if __name__ == "__main__":
    main()
