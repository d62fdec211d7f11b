"""The training loop's DAGs, built here so that their DAG files only call :func:`policy_refit_batch_dag` and
:func:`grpo_train_dag` (docs/loop.md).

``policy_refit_batch`` is scheduled on ``policy_checkpoint``: it verifies the announced checkpoint,
points the engine at it (a ``vllm_server`` refit verified by the servers' own hash; the
in-process engine loads the folder itself) and runs ``rollout_batch``'s task graph at its weight
version, whose ``publish`` updates ``grpo_dataset``. ``grpo_train`` is scheduled on
``grpo_dataset``: it takes one training step on the published dataset(s) and announces the new
checkpoint, until the deployment's ``max_steps``. Every task body is one call of
:mod:`tasks.orchestration.loop` or :mod:`tasks.orchestration.steps`; nothing heavy is imported
while a DAG is built (``tests/orchestration/test_dag_parse.py``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from airflow.sdk import DAG, Param, TriggerRule, dag, task

from tasks.orchestration import loop, steps
from tasks.orchestration.assets import GRPO_DATASET, POLICY_CHECKPOINT
from tasks.orchestration.batch_xcom import BATCH_XCOM_KEY, PLAN_TASK_ID
from tasks.orchestration.engine_servers import SERVER_ENGINE, SERVERS_CONN_ID
from tasks.orchestration.form import form_fields
from tasks.orchestration.review_operator import BatchReviewOperator
from tasks.orchestration.rollout_dag import DEFAULT_ARGS, START_DATE, generate_placement

REFIT_DAG_ID = "policy_refit_batch"
TRAIN_DAG_ID = "grpo_train"
SERVER_DEFAULTS = {"engine": SERVER_ENGINE, "engine_options": {}, "engine_conn_id": SERVERS_CONN_ID}
REFIT_DAG_DOC = f"""
### {REFIT_DAG_ID}: refit to an announced checkpoint, then one rollout batch at its weight version

Runs on each `policy_checkpoint` event (from `grpo_train`, or posted by an external trainer through
`POST /api/v2/assets/events`; docs/loop.md). `verify_checkpoint` refuses an event whose folder is not
below the deployment's checkpoints root (`{loop.CHECKPOINTS_ROOT_VARIABLE}`) and hashes the folder's
weights against its `checkpoint.json` and the event; `refit` loads it into the servers of the run's
`rollout_servers` connection at the checkpoint's weight version and requires each server's own hash
of what it loaded to be the checkpoint's (engine `vllm` has nothing to refit: the batch's model is the
folder, hashed by each generate worker as it loads it). Then `rollout_batch`'s tasks: `plan` (the model
is the checkpoint folder), `generate`, the suites, `finalize`, `review`, `publish` (asset
`grpo_dataset`, which drives `grpo_train`). The batch's fields are this DAG's defaults; the event
chooses only the checkpoint, and only below the root.
"""
TRAIN_DAG_DOC = f"""
### {TRAIN_DAG_ID}: one training step per published dataset, announcing the next policy checkpoint

Runs on each `grpo_dataset` event. `train` checks the event's batch against the trigger policy's
storage, then takes one reference GRPO step (`tasks/trainer/step.py`) from the latest checkpoint under
the deployment's checkpoints root (`{loop.CHECKPOINTS_ROOT_VARIABLE}`): it refuses datasets the
checkpoint did not sample, checks the step-0 ratio, and writes the next checkpoint exactly once.
`announce_checkpoint` emits it as a `policy_checkpoint` event (weight version, sha256, step, folder,
parent), which drives `{REFIT_DAG_ID}`. The loop stops at the deployment's `max_steps`
(`{loop.MAX_STEPS_VARIABLE}`, default {loop.DEFAULT_MAX_STEPS}): the checkpoint of that step is written
and not announced, and a dataset that arrives later is not trained; `announce_checkpoint` is skipped
and its log says why. No run conf sets any of it.
"""


def policy_refit_batch_dag(
    dag_id: str = REFIT_DAG_ID, *, defaults: Mapping[str, Any] = SERVER_DEFAULTS, doc_md: str = REFIT_DAG_DOC
) -> DAG:
    """The DAG scheduled on ``policy_checkpoint``: verify, refit, then ``rollout_batch``'s tasks at the checkpoint.

    The batch fields are ``defaults`` and the deployment's ``ROLLOUT_LEDGER_LOOP_BATCH``, checked by the trigger
    policy here, when the file is parsed.
    """
    defaults = loop.loop_batch_defaults(defaults)
    params = {
        name: Param(defaults.get(name, spec["default"]), **{k: v for k, v in spec.items() if k != "default"})
        for name, spec in form_fields().items()
    }

    @dag(
        dag_id=dag_id,
        description="policy_checkpoint -> verified refit -> rollout batch at its weight version -> grpo_dataset",
        doc_md=doc_md,
        schedule=[POLICY_CHECKPOINT],
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        params=params,
        default_args=DEFAULT_ARGS,
        tags=["rollout-ledger", "grpo", "loop"],
        auto_register=False,
    )
    def policy_refit_batch() -> None:
        @task(multiple_outputs=False)
        def verify_checkpoint(triggering_asset_events: Any = None) -> dict:
            return loop.verify_checkpoint(triggering_asset_events)

        @task(multiple_outputs=False)
        def refit(checkpoint: dict, params: dict | None = None) -> dict:
            return loop.refit(params, checkpoint)

        @task(task_id=PLAN_TASK_ID, multiple_outputs=False)
        def plan(checkpoint: dict, params: dict | None = None, dag_run: Any = None, ti: Any = None) -> list[int]:
            shards = loop.plan(params, dag_run, checkpoint)
            ti.xcom_push(key=BATCH_XCOM_KEY, value=steps.batch_record(params, dag_run))
            return shards

        @task(
            **generate_placement(params["engine"].value),
            retries=3,
            retry_delay=dt.timedelta(seconds=30),
            retry_exponential_backoff=2.0,
            execution_timeout=dt.timedelta(hours=6),
            multiple_outputs=False,
        )
        def generate(
            shard: int, checkpoint: dict, params: dict | None = None, dag_run: Any = None, ti: Any = None
        ) -> dict:
            return loop.generate(params, dag_run, shard, try_number=ti.try_number, checkpoint=checkpoint)

        @task(multiple_outputs=False)
        def validate_lineage(params: dict | None = None, dag_run: Any = None) -> dict:
            return steps.validate("lineage", params, dag_run)

        @task(execution_timeout=dt.timedelta(hours=2), multiple_outputs=False)
        def finalize(params: dict | None = None, dag_run: Any = None) -> dict:
            return steps.finalize(params, dag_run)

        @task(multiple_outputs=False)
        def validate_dataset(params: dict | None = None, dag_run: Any = None) -> dict:
            return steps.validate("dataset", params, dag_run)

        review = BatchReviewOperator(task_id="review", execution_timeout=dt.timedelta(minutes=10))

        @task(outlets=[GRPO_DATASET], trigger_rule=TriggerRule.NONE_FAILED, multiple_outputs=False)
        def publish(
            checkpoint: dict, params: dict | None = None, dag_run: Any = None, outlet_events: Any = None
        ) -> dict:
            event = {**steps.publish(params, dag_run), "policy_checkpoint": checkpoint}
            outlet_events[GRPO_DATASET].extra = event
            return event

        @task(multiple_outputs=False)
        def sweep_orphans(params: dict | None = None, dag_run: Any = None) -> dict:
            return steps.sweep(params, dag_run)

        checkpoint = verify_checkpoint()
        refitted = refit(checkpoint)
        planned = plan(checkpoint)
        refitted >> planned
        generated = generate.partial(checkpoint=checkpoint).expand(shard=planned)
        published = generated >> validate_lineage() >> finalize() >> validate_dataset() >> review >> publish(checkpoint)
        published >> sweep_orphans().as_teardown(setups=planned)

    return policy_refit_batch()


def grpo_train_dag(dag_id: str = TRAIN_DAG_ID, *, doc_md: str = TRAIN_DAG_DOC) -> DAG:
    """The DAG scheduled on ``grpo_dataset``: one training step, then the next ``policy_checkpoint`` event."""

    @dag(
        dag_id=dag_id,
        description="grpo_dataset -> one GRPO training step -> policy_checkpoint (until max_steps)",
        doc_md=doc_md,
        schedule=[GRPO_DATASET],
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,  # steps run one after another: each starts from the latest checkpoint
        default_args=DEFAULT_ARGS,
        tags=["rollout-ledger", "grpo", "loop"],
        auto_register=False,
    )
    def grpo_train() -> None:
        @task(execution_timeout=dt.timedelta(hours=2), multiple_outputs=False)
        def train(triggering_asset_events: Any = None) -> dict:
            return loop.train(triggering_asset_events)

        @task(outlets=[POLICY_CHECKPOINT], multiple_outputs=False)
        def announce_checkpoint(trained: dict, outlet_events: Any = None) -> dict:
            extra = loop.announce(trained)  # skips the task (no event) once max_steps is reached
            outlet_events[POLICY_CHECKPOINT].extra = extra
            return extra

        announce_checkpoint(train())

    return grpo_train()
