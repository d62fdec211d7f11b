"""The generate stage: run shards' rollouts through one engine, captured (docs/generation.md).

Before any engine starts, everything a user can get wrong is checked (fail fast): the batch
config, the shards and their plans, the environment and its prompt file, and the model the
worker resolves from the plan's portable reference, whose hashes must equal the planned ones.

Each shard not yet committed then runs as a new attempt: it claims the attempt
(``_CLAIM.json``, create-once), adopts every rollout an earlier attempt receipted (a receipt is
final), runs the rest concurrently (at most ``max_in_flight`` at once in the engine's
continuous batch), writes a receipt per rollout and then the shard's commit marker, and sweeps
orphans. The engine starts when the first attempt has a rollout to run: a retry after a crash at
commit time, which adopts every rollout, commits without one. A shard committed meanwhile by
another writer (a zombie and its retry) is not committed twice: the loser returns the winner's
summary.

An interruption (SIGTERM, SIGINT) or the engine dying ends the attempt: receipts of completed
rollouts are flushed (the retry adopts them), rollouts in flight get no receipt (the retry
re-runs them), no marker is written, the engine is shut down, and the caller gets
:class:`~tasks.errors.GenerateInterrupted` or :class:`~tasks.errors.EngineDeadError`. Storage that
stays unavailable through an operation's retries ends the attempt the same way, with
:class:`~tasks.errors.StorageUnavailableError` (the flush of receipts may fail with it too). An
engine of replicas that loses one while another lives goes on: a stepped rollout whose call the
lost replica held starts again on a live one within the attempt (:mod:`tasks.generate.attempt`).

Modules, each importing only those listed before it: ``summary`` (:class:`ShardSummary`),
``checks`` (before the engine), ``shard_engine`` (the engine's life), ``signals`` (stop
signals), ``progress`` (display), ``receipts`` (a rollout's receipt and outcome), ``rollouts``
(the rollouts of one attempt), ``attempt`` (claim, adopt, run, commit), ``stage`` (the entry
points re-exported here), ``console`` (how a run is shown, by the CLI's ``generate`` and the
worker alike), ``worker`` (``python -m tasks.generate.worker``: what an Airflow generate task starts).
"""

from tasks.generate.rollouts import MAX_ERROR_CHARS
from tasks.generate.stage import generate_shard, generate_shards
from tasks.generate.summary import ShardSummary

__all__ = ["MAX_ERROR_CHARS", "ShardSummary", "generate_shard", "generate_shards"]
