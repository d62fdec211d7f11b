"""The ``rollout_batch`` DAG, built here so that DAG files only call :func:`rollout_batch_dag` or :func:`profile_dag`.

Airflow re-parses DAG files continuously, so this module and everything it imports at module
level stay light: Airflow's SDK, :mod:`tasks.orchestration.steps` (whose stage imports happen
inside each step), the form and the review operator. No numpy, pyarrow, GX, torch or vLLM is
imported while a DAG is built; ``tests/orchestration/test_dag_parse.py`` checks it in a fresh
interpreter. Every task body is one call of a step.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from airflow.sdk import DAG, Asset, CronTriggerTimetable, Param, TriggerRule, dag, get_current_context, task

from tasks.engines.registry import loads_model
from tasks.orchestration import steps
from tasks.orchestration.batch_xcom import BATCH_XCOM_KEY, PLAN_TASK_ID
from tasks.orchestration.engine_servers import SERVER_ENGINE, SERVERS_CONN_ID
from tasks.orchestration.form import form_fields
from tasks.orchestration.local_airflow import GPU_POOL
from tasks.orchestration.profiles import Profile
from tasks.orchestration.review_operator import BatchReviewOperator

BATCH_DAG_BODY = """
Trigger it with the form (every field has a description); each run is one batch whose id derives
from the run. `plan` writes the batch config; `generate` runs once per shard (a retry is a new
attempt that adopts what the last one completed), on the `gpu` pool and queue when the DAG's
default engine loads the model in the task, on the default ones for `vllm_server`; the lineage suite checks
the ledger; `finalize` builds the dataset; the dataset suite checks it; `review` waits for a
person's decision (Publish or Reject, with a reason) when a suite warned or the run requires
review, and is skipped otherwise; `publish` commits it and emits the `grpo_dataset` asset event.
A failing suite, a rejection or an unanswered review fails the run, and its log says why.
`sweep_orphans` cleans up as a teardown, whatever happened.
Engines: `vllm` starts vLLM inside each generate task; `vllm_server` calls running vLLM servers,
named by an Airflow connection of type `rollout_servers` (`engine_conn_id`: host, port, extra `urls`,
password = API key; an `http` connection is read the same way) or by the engine options `urls` and
`api_key_file`; start one with `rollout-ledger serve`. One server serves every shard of every run
(docs/servers.md). `megatron` runs megatron-core inside each generate task on a GPU worker
(docs/megatron.md).
Reports: `reports/index.html` under the batch's URL, which the plan task logs.
"""
BATCH_DAG_DOC = (
    "\n### rollout_batch: one batch of multi-turn rollouts, from plan to a published GRPO dataset\n" + BATCH_DAG_BODY
)
SERVERS_DAG_ID = "rollout_batch_on_servers"
SERVERS_DAG_DOC = (
    f"\n### {SERVERS_DAG_ID}: `rollout_batch` on running vLLM servers\n\n"
    f"The form starts from engine `vllm_server` and the Airflow connection `{SERVERS_CONN_ID}`"
    " (type `rollout_servers`: host, port, more replicas, password = API key; docs/servers.md), so"
    " `generate` loads no model: it runs in the default pool and queue, on any worker, and never waits"
    " for a `gpu` slot.\n" + BATCH_DAG_BODY
)
GRPO_DATASET = Asset(steps.GRPO_DATASET_ASSET)
DEFAULT_ARGS = {
    "owner": "rollout-ledger",
    "retries": 1,
    "retry_delay": dt.timedelta(seconds=30),
    "execution_timeout": dt.timedelta(hours=1),
}
GPU_QUEUE = "gpu"
MANUAL_MAX_ACTIVE_RUNS = 16  # scheduled profiles run one at a time
START_DATE = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def rollout_batch_dag(
    dag_id: str = "rollout_batch",
    *,
    schedule: Any = None,
    defaults: Mapping[str, Any] | None = None,
    description: str = "Multi-turn rollouts -> token-exact GRPO dataset, validated and published",
    doc_md: str = BATCH_DAG_DOC,
    display_name: str | None = None,
    tags: tuple[str, ...] = (),
    paused: bool = False,
) -> DAG:
    """The batch DAG: the trigger form (``defaults`` override field defaults) and the task graph."""
    params = {
        name: Param((defaults or {}).get(name, spec["default"]), **{k: v for k, v in spec.items() if k != "default"})
        for name, spec in form_fields().items()
    }
    placement = generate_placement(params["engine"].value)

    @dag(
        dag_id=dag_id,
        dag_display_name=display_name or dag_id,
        description=description,
        doc_md=doc_md,
        schedule=schedule,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1 if schedule is not None else MANUAL_MAX_ACTIVE_RUNS,
        params=params,
        default_args=DEFAULT_ARGS,
        tags=["rollout-ledger", "grpo", *tags],
        is_paused_upon_creation=paused,
        auto_register=False,  # each DAG file registers what it builds, by assigning it to a global
    )
    def rollout_batch() -> None:
        @task(task_id=PLAN_TASK_ID, multiple_outputs=False)
        def plan(params: dict | None = None, dag_run: Any = None, ti: Any = None) -> list[int]:
            shards = steps.plan(params, dag_run)
            ti.xcom_push(key=BATCH_XCOM_KEY, value=steps.batch_record(params, dag_run))
            return shards

        @task(
            **placement,
            retries=3,
            retry_delay=dt.timedelta(seconds=30),
            retry_exponential_backoff=2.0,
            max_retry_delay=dt.timedelta(minutes=10),
            execution_timeout=dt.timedelta(hours=6),
            map_index_template="{{ shard_label }}",
            multiple_outputs=False,
        )
        def generate(shard: int, params: dict | None = None, dag_run: Any = None, ti: Any = None) -> dict:
            get_current_context()["shard_label"] = f"shard {shard}"  # type: ignore[typeddict-unknown-key]
            return steps.generate(params, dag_run, shard, try_number=ti.try_number)

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

        # NONE_FAILED: publish runs after a skipped review too
        @task(outlets=[GRPO_DATASET], trigger_rule=TriggerRule.NONE_FAILED, multiple_outputs=False)
        def publish(params: dict | None = None, dag_run: Any = None, outlet_events: Any = None) -> dict:
            event = steps.publish(params, dag_run)
            outlet_events[GRPO_DATASET].extra = event
            return event

        @task(multiple_outputs=False)
        def sweep_orphans(params: dict | None = None, dag_run: Any = None) -> dict:
            return steps.sweep(params, dag_run)

        planned = plan()
        generated = generate.expand(shard=planned)
        published = generated >> validate_lineage() >> finalize() >> validate_dataset() >> review >> publish()
        published >> sweep_orphans().as_teardown(setups=planned)

    return rollout_batch()


def generate_placement(engine: str) -> dict[str, str]:
    """Where generate runs for a DAG whose default engine is ``engine``: the ``gpu`` pool and queue when the
    engine loads the model in the task (Celery: only workers started with ``-q gpu`` take it; other executors
    ignore queues), else the default pool and queue (a server engine needs no accelerator)."""
    return {"pool": GPU_POOL, "queue": GPU_QUEUE} if loads_model(engine) else {}


def servers_dag() -> DAG:
    """``rollout_batch`` whose form starts from the servers of the connection :data:`SERVERS_CONN_ID`.

    A task's pool is fixed when its DAG is built, so a batch whose generate needs no GPU has a DAG of
    its own: switching ``rollout_batch``'s form to ``vllm_server`` would still queue generate for a
    ``gpu`` slot.
    """
    return rollout_batch_dag(
        SERVERS_DAG_ID,
        defaults={"engine": SERVER_ENGINE, "engine_options": {}, "engine_conn_id": SERVERS_CONN_ID},
        description="Multi-turn rollouts on running vLLM servers -> token-exact GRPO dataset (generate needs no GPU)",
        doc_md=SERVERS_DAG_DOC,
        display_name="rollout batch on vLLM servers",
        tags=("servers",),
    )


def profile_dag(profile: Profile, *, profiles_file: str) -> DAG:
    """The scheduled batch DAG of one profile, with its own display name and a doc naming its schedule and defaults."""
    values = "\n".join(f"| `{name}` | `{value!r}` |" for name, value in sorted(profile.params.items()))
    doc = (
        f"\n### {profile.dag_id}: periodic batch, profile `{profile.name}`\n\n"
        f"{profile.description or 'A scheduled rollout_batch.'}\n\n"
        f"Runs on `{profile.cron}` ({profile.timezone}), one run at a time, missed intervals not caught up; "
        f"defined in `{profiles_file}`. Each run is a `rollout_batch` run (plan, generate, the suites, review, "
        "publish) whose form starts from "
        + (f"these values:\n\n| field | value |\n|---|---|\n{values}\n" if values else "the form's defaults.\n")
    )
    return rollout_batch_dag(
        profile.dag_id,
        schedule=CronTriggerTimetable(profile.cron, timezone=profile.timezone),
        defaults=profile.params,
        description=profile.description or f"periodic rollout batch, profile {profile.name}",
        doc_md=doc,
        display_name=f"rollout batch: {profile.name} ({profile.cron})",
        tags=("profile",),
        paused=profile.paused,
    )
