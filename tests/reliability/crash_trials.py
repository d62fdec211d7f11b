"""Seeded crash trials: a generate process killed with SIGKILL at a chosen boundary, retried as Airflow would.

A trial's seed picks a crash site (seed modulo the number of sites, so consecutive seeds cover
them all), an environment kind (:data:`ENVIRONMENTS`: guess_number, calculator with its tool
results, an ``agent_command`` agent of three calls, and one of two sub-agents calling at once; every
site meets every kind over 24 seeds) and, from its own
random stream, how many passes through the site come before the kill. The process is armed
through ``ROLLOUT_LEDGER_CRASH_AT`` (:mod:`tasks.crash_points`) and kills itself there with
SIGKILL, once: the retry runs with the same environment and passes.

What every trial must show once the retry has committed the shard and the batch is finalized
(:func:`check_survivors`):

* every planned rollout exactly once in the dataset;
* every object of the crashed attempt the final marker names is byte-identical to what the
  crashed attempt left (adopted rollouts keep their first commit);
* after the sweep, nothing under the shard's staging and ledger folders that no marker names
  (claims aside; a crashed local write's temp file goes once it is older than the sweep's grace);
* every row verifies (both suites pass, reading every named object through its sha256);
* the dataset is token-identical to a clean run of the same plan (:func:`reference_rows`: fp32,
  per-rollout seeds, on the test run's shared engine), sampling logprobs within
  :data:`LOGPROB_TOLERANCE`;
* nothing committed was sampled twice (:func:`check_call_count`): the call records both attempts
  wrote are the clean run's count, plus at most the calls in flight at the kill (``max_in_flight``).
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from tasks import layout
from tasks.batch import Batch
from tasks.config import BatchConfig
from tasks.crash_points import CrashPoint
from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.generate import generate_shards
from tasks.pipeline import finalize_and_publish
from tasks.plan import plan_batch
from tasks.sampling import SamplingSettings
from tasks.storage.claims import is_claim_path
from tasks.storage.dataset_manifest import read_dataset_marker, read_dataset_part
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.marker import ShardMarker, read_marker
from tasks.storage.objects import ObjectStore, is_temp_file, sha256_hex
from tasks.storage.recovery import read_uncommitted_attempt
from tasks.storage.sweep import TEMP_GRACE_SECONDS, sweep_orphans

SHARD = 0
ROOT = Path(__file__).resolve().parents[2]
# The environment kinds the trials rotate through: a config's environment fields for each.
ENVIRONMENTS: dict[str, dict[str, Any]] = {
    "guess_number": {
        "environment": "guess_number",
        "max_turns": 3,
        "sampling": SamplingSettings(temperature=0.8, max_tokens=16),
    },
    "calculator": {"environment": "calculator", "environment_options": {}},
    "agent_command": {
        "environment": "agent_command",
        "environment_options": {
            "command": [sys.executable, str(Path(__file__).with_name("multi_turn_agent.py"))],
            "tasks": str(ROOT / "examples" / "arithmetic_tasks.jsonl"),
            "timeout_s": 120,
        },
    },
    "concurrent_agent": {  # two sub-agents calling at once: resumed whatever order their calls come back in
        "environment": "agent_command",
        "environment_options": {
            "command": [sys.executable, str(Path(__file__).with_name("concurrent_agent.py"))],
            "tasks": str(ROOT / "examples" / "arithmetic_tasks.jsonl"),
            "timeout_s": 180,
        },
        "max_turns": 6,
    },
}
# Dataset columns that depend only on the plan, the model and the sampled tokens: what a clean run reproduces.
TOKEN_COLUMNS = (
    "group_id",
    "input_ids",
    "loss_mask",
    "prompt_len",
    "reward",
    "advantage",
    "sample_mask",
    "mask_reason",
    "truncated",
    "num_turns",
)
# vLLM-CPU samples the same tokens whatever batch a request runs in, but their fp32 logprobs move
# with the batch's arithmetic: up to 1.9e-3 apart between a crashed-and-retried run and a clean one.
LOGPROB_TOLERANCE = 1e-2


# The fewest model calls a kind's trial batch makes on the bundled model (calculator's rollouts mostly answer
# at once): a kill on a later pass would never come.
FEWEST_CALLS = {"guess_number": 22, "calculator": 8, "agent_command": 24, "concurrent_agent": 48}
# Calls one rollout of a kind may have in flight at once (its sub-agents'): what a kill can leave unrecorded.
CALLS_AT_ONCE = {"concurrent_agent": 2}


@dataclass(frozen=True)
class CrashSite:
    """A boundary the recovery rules are about: crash point ``point`` on details matching ``match``.

    ``max_hit`` bounds the pass the kill comes on so that the trials' batches always reach it (they
    make 22 and 32 model calls, one staging segment per call or two, a ledger flush after every
    segment); a kind whose batch makes fewer calls bounds it lower (:data:`FEWEST_CALLS`).
    """

    label: str
    point: str
    match: str
    max_hit: int


CRASH_SITES = (
    CrashSite("between engine outputs (a completion returned, not yet staged)", "engine_output", "*", 20),
    CrashSite("inside a staging segment write", "object_write", "*/staging/*/seg-*.parquet", 10),
    CrashSite("between a segment write and its ledger records", "segment_written", "*", 10),
    CrashSite("inside a ledger file write", "object_write", "*/ledger/*/attempt-*/*.parquet", 4),
    CrashSite("while writing the shard marker", "object_write", "*/ledger/*/_COMMITTED.json", 1),
    CrashSite("while writing the attempt claim", "object_write", "*/_CLAIM.json", 1),
)


@dataclass(frozen=True)
class Trial:
    seed: int
    site: CrashSite
    crash: CrashPoint
    environment: str

    @classmethod
    def of_seed(cls, seed: int, once: Path, kinds: Sequence[str] = tuple(ENVIRONMENTS)) -> Trial:
        """The trial of ``seed``; its environment kind one of ``kinds``."""
        site = CRASH_SITES[seed % len(CRASH_SITES)]
        environment = kinds[(seed + seed // len(CRASH_SITES)) % len(kinds)]
        hit = random.Random(seed).randint(1, min(site.max_hit, FEWEST_CALLS[environment]))
        return cls(seed, site, CrashPoint(site.point, hit=hit, match=site.match, once=str(once)), environment)

    def __str__(self) -> str:
        return f"trial {self.seed} ({self.environment}): SIGKILL {self.site.label}, pass {self.crash.hit}"


def trial_count(variable: str, default: int) -> int:
    """How many trials to run: ``$variable`` (``make crash-trials`` sets the full counts) or ``default``."""
    text = os.environ.get(variable, str(default))
    if not text.isdigit():
        raise ValueError(f"${variable} must be a non-negative integer, got {text!r}")
    return int(text)


def first_attempt_objects(store: ObjectStore) -> dict[str, str]:
    """Path -> sha256 of every complete object of attempt 0 under the shard's staging and ledger folders."""
    return {
        path: sha256_hex(store.read_bytes(path))
        for folder in (layout.staging_shard_dir(SHARD), layout.ledger_shard_dir(SHARD))
        for path in store.list_files(folder)
        if not is_temp_file(path) and path != layout.shard_marker(SHARD) and layout.attempt_of(path) == 0
    }


@dataclass(frozen=True)
class CleanRun:
    """A clean, uninterrupted run of a plan: its dataset's rows by rollout id, and the call records its ledger holds."""

    rows: dict[str, dict[str, Any]]
    calls: int


# Clean runs by plan (the config less its batch id, code version and key file, on which no token depends), once per
# process.
_CLEAN_RUNS: dict[str, CleanRun] = {}


def reference_rows(root: str, config: BatchConfig) -> CleanRun:
    """The dataset of a clean, uninterrupted run of ``config``'s plan on its own engine, and its call count.

    Made under ``root`` the first time a plan is asked for; a trial of the same plan (a CLI trial and a DAG trial
    of one kind) gets the same clean run.
    """
    options = {k: v for k, v in config.engine.options.items() if k != "api_key_file"}  # how the key is passed
    engine = dataclasses.replace(config.engine, options=options)
    plan = dataclasses.replace(config, batch_id="clean", code_version="", engine=engine).to_json()
    if plan not in _CLEAN_RUNS:
        clean = dataclasses.replace(config, batch_id=f"{config.batch_id}-clean")
        batch = Batch.open(root, clean.batch_id)
        plan_batch(batch, clean)
        generate_shards(batch, range(clean.shards), progress=False)
        finalize_batch(batch, FinalizeOptions(audit=False))
        calls = sum(len(LedgerReader(batch.store, shard).calls) for shard in range(clean.shards))
        _CLEAN_RUNS[plan] = CleanRun(dataset_rows(batch.store, staged=True), calls)
    return _CLEAN_RUNS[plan]


def killed_attempt_calls(store: ObjectStore) -> int:
    """The call records the killed attempt 0 left, as recovery reads them (count them before the retry: its sweep
    removes the files of calls nothing replayed); 0 when it died before its claim existed."""
    if not any(is_claim_path(path, SHARD) for path in store.list_files(layout.ledger_shard_dir(SHARD))):
        return 0
    left = read_uncommitted_attempt(store, SHARD, 0)
    return sum(len(b.manifest) for b in left.rollouts) + sum(len(calls) for calls in left.unreceipted.values())


def dataset_rows(store: ObjectStore, *, staged: bool = False) -> dict[str, dict[str, Any]]:
    """The published (or, with ``staged``, the staged) dataset's token columns, by rollout id; ids must be unique."""
    from tasks.storage.dataset_manifest import read_staged_marker

    marker = read_staged_marker(store) if staged else read_dataset_marker(store)
    assert marker is not None, f"{store.url}: no {'staged' if staged else 'published'} dataset"
    table = pa.concat_tables(read_dataset_part(store, part) for part in marker.parts)
    rows = table.select(["rollout_id", "logprobs", *TOKEN_COLUMNS]).to_pylist()
    ids = [row.pop("rollout_id") for row in rows]
    assert len(ids) == len(set(ids)), f"rollouts more than once in the dataset: {sorted(ids)}"
    return dict(zip(ids, rows, strict=True))


def finish_batch(root: str, batch_id: str) -> None:
    """What the DAG runs after generate: both suites (reading every named object by sha256), finalize, publish."""
    finalize_and_publish(Batch.open(root, batch_id), FinalizeOptions(audit=False))


def check_survivors(
    batch: Batch, first_attempt: dict[str, str], clean: CleanRun, killed_calls: int, *, calls_at_once: int = 1
) -> None:
    """The trial's invariants (module docstring) on a batch whose shard is committed and dataset published;
    ``calls_at_once``: how many calls one rollout may have in flight (:data:`CALLS_AT_ONCE`)."""
    store = batch.store
    reference = clean.rows
    planned = {p.rollout_id for shard in range(batch.config.shards) for p in batch.shard_plan(shard)}
    rows = dataset_rows(store)
    assert set(rows) == planned, f"dataset rollouts differ from the plan: {sorted(set(rows) ^ planned)}"

    marker = read_marker(store, SHARD)
    assert marker is not None
    if marker.attempt == 0:  # killed before its claim existed: the retry took attempt 0 over an empty folder
        assert not first_attempt, f"the retry committed attempt 0 over the crashed attempt's objects: {first_attempt}"
    adopted = {f.path: f.sha256 for f in marker.files if layout.attempt_of(f.path) == 0 and marker.attempt > 0}
    changed = [path for path, sha in adopted.items() if first_attempt.get(path) != sha]
    assert not changed, f"adopted objects differ from what the crashed attempt wrote: {changed}"

    sweep_orphans(store, SHARD)
    _age_temp_files(store)
    sweep_orphans(store, SHARD)
    named = {f.path for f in marker.files} | {marker.path}
    left = [
        path
        for folder in (layout.staging_shard_dir(SHARD), layout.ledger_shard_dir(SHARD))
        for path in store.list_files(folder)
        if path not in named and not is_claim_path(path, SHARD)
    ]
    assert not left, f"objects no marker names survived the sweep: {left}"

    print(f"{store.url}: committed attempt {marker.attempt}, {marker.counts.adopted_rollouts} rollouts adopted")
    differing = {r: sorted(c for c in TOKEN_COLUMNS if rows[r][c] != reference[r][c]) for r in planned}
    differing = {r: columns for r, columns in differing.items() if columns}
    assert not differing, f"rollouts not token-identical to the clean run (rollout: columns): {differing}"
    drift = max(
        (abs(a - b) for r in planned for a, b in zip(rows[r]["logprobs"], reference[r]["logprobs"], strict=True)),
        default=0.0,
    )
    assert drift <= LOGPROB_TOLERANCE, f"sampling logprobs differ from the clean run's by up to {drift}"
    in_flight = batch.config.max_in_flight * calls_at_once
    check_call_count(store, killed_calls if marker.attempt > 0 else 0, marker, clean.calls, in_flight)


def check_call_count(store: ObjectStore, crashed: int, marker: ShardMarker, clean: int, in_flight: int) -> None:
    """Nothing committed was sampled again: the crashed attempt's call records and the retry's together are the
    clean run's, plus at most the calls that were in flight at the kill."""
    retried = sum(f.rows for f in marker.files if f.kind == "calls" and layout.attempt_of(f.path) == marker.attempt)
    print(f"{store.url}: {crashed} call records before the kill, {retried} after; the clean run holds {clean}")
    assert clean <= crashed + retried <= clean + in_flight, (
        f"the crashed attempt recorded {crashed} calls and the retry {retried}: the clean run records {clean} "
        f"(at most {in_flight} more may have been in flight at the kill)"
    )


def _age_temp_files(store: ObjectStore) -> None:
    """Date a crashed local write's temp files back past the sweep's grace, as time would."""
    if not store.is_local:
        return
    old = time.time() - TEMP_GRACE_SECONDS - 60
    for folder in (layout.staging_shard_dir(SHARD), layout.ledger_shard_dir(SHARD)):
        for path in store.list_files(folder):
            if is_temp_file(path):
                os.utime(store.full_path(path), (old, old))
