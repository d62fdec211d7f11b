"""The DAG files as the DAG processor sees them: they import fast and wire the batch (architecture.md §1)."""

from __future__ import annotations

import datetime as dt

import pytest

from tasks.batch_fields import SECTIONS
from tasks.orchestration.form import form_fields

BATCH_GRAPH = {
    "plan": set(),
    "generate": {"plan"},
    "validate_lineage": {"generate"},
    "finalize": {"validate_lineage"},
    "validate_dataset": {"finalize"},
    "review": {"validate_dataset"},
    "publish": {"review"},
    "sweep_orphans": {"plan", "publish"},
}


def test_every_dag_file_imports_without_errors_well_under_a_second(dag_bag):
    assert dag_bag.import_errors == {}
    assert set(dag_bag.dags) == {
        "rollout_batch",
        "rollout_batch_on_servers",
        "rollout_batch__nightly_arithmetic",
        "grpo_dataset_consumer",
        "grpo_train",
        "policy_refit_batch",
    }
    for stats in dag_bag.dagbag_stats:
        assert stats.duration < dt.timedelta(seconds=1), stats


@pytest.mark.parametrize(
    ("dag_id", "generate_on"),
    [("rollout_batch", "gpu"), ("rollout_batch__nightly_arithmetic", "gpu"), ("rollout_batch_on_servers", None)],
)
def test_the_batch_graph_mapping_pool_retries_and_teardown(dag_bag, dag_id, generate_on):
    dag = dag_bag.dags[dag_id]
    assert {t.task_id: set(t.upstream_task_ids) for t in dag.tasks} == BATCH_GRAPH
    assert {"rollout-ledger", "grpo"} <= set(dag.tags)
    generate = dag.get_task("generate")
    assert generate.is_mapped
    if generate_on is None:  # a server engine loads no model: any worker, no gpu slot
        assert (generate.pool, generate.queue) == ("default_pool", "default")
    else:
        assert (generate.pool, generate.queue) == (generate_on, generate_on)
    assert {t.queue for t in dag.tasks if t.task_id != "generate"} == {"default"}
    assert generate.partial_kwargs["map_index_template"] == "{{ shard_label }}"
    assert generate.partial_kwargs["retries"] >= 2 and generate.partial_kwargs["retry_exponential_backoff"]
    assert generate.partial_kwargs["execution_timeout"] >= dt.timedelta(hours=1)
    assert dag.get_task("plan").is_setup and dag.get_task("sweep_orphans").is_teardown
    for task in dag.tasks:
        if not task.is_mapped:
            assert task.execution_timeout is not None and task.retries >= 1, task.task_id
    (asset,) = dag.get_task("publish").outlets
    assert asset.name == "grpo_dataset"
    assert dag.get_task("publish").trigger_rule == "none_failed"  # runs after a skipped review
    review = dag.get_task("review")
    assert type(review).__name__ == "BatchReviewOperator" and review.options == ["Publish", "Reject"]
    assert set(review.params) == {"reason"}  # the decision form's one field; the batch form stays the DAG's


def test_the_trigger_form_has_every_field_typed_titled_described_and_sectioned(dag_bag):
    params = dag_bag.dags["rollout_batch"].params
    assert set(params) == set(form_fields())
    for name in params:
        schema = params.get_param(name).schema
        assert schema["title"] and schema["type"] and schema["section"] in SECTIONS, name
        assert params.get_param(name).description, name
        if "enum" in schema:  # null, where a field may be empty, is the form's empty choice
            assert set(schema["values_display"]) == set(schema["enum"]) - {None}, name
    for name in ("num_tasks", "group_size", "shards", "max_turns", "max_tokens"):
        assert params.get_param(name).schema["minimum"] == 1
    params.validate()  # the defaults are a valid run


def test_a_bad_trigger_value_is_refused_by_the_form(dag_bag):
    from airflow.sdk.exceptions import ParamValidationError

    params = dag_bag.dags["rollout_batch"].params
    for name, value in [
        ("num_tasks", 0),
        ("engine", "megatronn"),
        ("top_p", 0),
        ("max_poisoned_rate", 1.5),
        ("review_timeout_hours", 0),
        ("review_timeout_hours", 721),
        ("require_review", "yes"),
    ]:
        param = params.get_param(name)
        with pytest.raises(ParamValidationError):
            param.resolve(value)


def test_profiles_run_one_at_a_time_on_cron_without_catchup_paused_with_the_profile_defaults(dag_bag):
    dag = dag_bag.dags["rollout_batch__nightly_arithmetic"]
    assert dag.max_active_runs == 1 and dag.catchup is False and dag.is_paused_upon_creation is True
    assert type(dag.timetable).__name__ == "CronTriggerTimetable"
    assert dag.params["environment"] == "arithmetic" and dag.params["num_tasks"] == 16
    assert dag_bag.dags["rollout_batch"].params["environment"] == "guess_number"  # the manual DAG keeps its own


def test_the_example_consumer_is_scheduled_on_the_published_asset(dag_bag):
    dag = dag_bag.dags["grpo_dataset_consumer"]
    assert [asset.name for asset in dag.timetable.asset_condition.objects] == ["grpo_dataset"]


def test_the_servers_dag_form_starts_from_the_servers_connection(dag_bag):
    params = dag_bag.dags["rollout_batch_on_servers"].params
    defaults = (params["engine"], params["engine_conn_id"], params["engine_options"])
    assert defaults == ("vllm_server", "rollout_servers", {})
    assert dag_bag.dags["rollout_batch"].params["engine"] == "vllm"  # the manual DAG keeps its own
