"""The bodies of the ``rollout_batch`` DAG's tasks: each calls one stage function with the run's storage.

Every step takes the run's params (the batch form, :mod:`tasks.orchestration.form`) and the DAG
run (anything with ``dag_id`` and ``run_id``), and returns a small dict of URIs and counts for
XCom. The batch id is a pure function of the two (:func:`run_batch_id`), so every task of a run,
on every try, on any worker, names the same batch without asking another task; plan returns the
shard numbers that generate maps over. The ``review`` task's operator
(:mod:`tasks.orchestration.review_operator`) calls :func:`review_request` and :func:`decide`.
Storage credentials are resolved from the params in each step and never returned. Errors a retry
cannot fix (bad params, a batch planned differently, a model whose hashes differ, a failing
validation suite, a refused publish, a rejection) raise ``AirflowFailException``, so Airflow fails
the task at once with the reason in its log instead of retrying it; anything else propagates and
the task's retries apply.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, Protocol
from urllib.parse import urlparse

from tasks.batch_fields import BatchFields
from tasks.ids import MAX_ID_LENGTH
from tasks.orchestration.lineage_report import report_lineage
from tasks.orchestration.storage_location import StorageLocation, check_storage_url, storage_location

if TYPE_CHECKING:
    from tasks.batch import Batch
    from tasks.orchestration.engine_servers import ServerConnection
    from tasks.orchestration.review_form import ReviewRequest
    from tasks.records.review import ReviewDecision

log = logging.getLogger("rollout_ledger.airflow")
GRPO_DATASET_ASSET = "grpo_dataset"  # the asset publish updates; its events' extra is publish's return value
_NOT_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


class DagRunRef(Protocol):
    """What a step needs of the DAG run (Airflow's ``DagRun`` has both)."""

    dag_id: str
    run_id: str


def batch_id_for_run(dag_id: str, run_id: str) -> str:
    """A valid batch id naming the DAG run: the same on every try of every task of that run.

    ``rollout_batch`` + ``manual__2026-12-01T10:00:00+00:00`` -> ``rollout_batch.manual__2026-12-01T10-00-00-00-00``;
    an id longer than the limit keeps its head and a digest of the whole.
    """
    import hashlib

    text = _NOT_ID_CHARS.sub("-", f"{dag_id}.{run_id}").strip("-.") or "run"
    if len(text) > MAX_ID_LENGTH:
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        text = f"{text[: MAX_ID_LENGTH - 13]}-{digest}"
    return text


def run_batch_id(params: Mapping[str, Any], run: DagRunRef) -> str:
    """The run's batch: the form's ``batch_id`` when set, else :func:`batch_id_for_run`."""
    return params.get("batch_id") or batch_id_for_run(run.dag_id, run.run_id)


def location(params: Mapping[str, Any]) -> StorageLocation:
    """The run's storage (credentials from its connection), once the trigger policy allows it."""
    from tasks.trigger_policy import load_trigger_policy

    with _permanent("storage", None):
        load_trigger_policy().check_storage(params["storage_url"], params.get("storage_conn_id"))
    with _permanent("storage", params.get("storage_url")):
        return storage_location(params["storage_url"], params.get("storage_conn_id"))


def run_batch(params: Mapping[str, Any], run: DagRunRef) -> Batch:
    """The run's batch on the run's storage."""
    from tasks.batch import Batch

    where = location(params)
    return Batch.open(where.root_url, run_batch_id(params, run), where.storage_options)


def batch_record(params: Mapping[str, Any], run: DagRunRef) -> dict[str, Any]:
    """Where the run's batch lives (no credentials): what plan records for the report viewer."""
    check_storage_url(params["storage_url"])
    return {
        "batch_id": run_batch_id(params, run),
        "storage_url": params["storage_url"],
        "storage_conn_id": params.get("storage_conn_id"),
    }


def engine_servers(params: Mapping[str, Any]) -> ServerConnection | None:
    """The servers the run's ``engine_conn_id`` names, with their key (None without one)."""
    from tasks.orchestration.engine_servers import server_connection

    if not params.get("engine_conn_id"):
        return None
    with _permanent("engine servers", None):
        return server_connection(params["engine_conn_id"])


def plan(params: Mapping[str, Any], run: DagRunRef) -> list[int]:
    """Plan the batch the params describe and return its shard numbers (the same config again is a no-op)."""
    from tasks.env_vars import scoped_environ
    from tasks.environments.registry import Runnables
    from tasks.lineage.datasets import plan_lineage
    from tasks.plan import plan_from_values
    from tasks.trigger_policy import load_trigger_policy

    values = {name: params[name] for name in BatchFields.model_fields if name in params}
    with _permanent("plan", None):  # before anything is read, sent or written
        load_trigger_policy().check_values(values)
    batch = run_batch(params, run)
    servers = engine_servers(params)
    with _permanent("plan", batch.root_url):
        if servers is not None:
            values = servers.batch_values(values)
        with scoped_environ(**(servers.environment() if servers else {})):  # plan asks the servers what they serve
            summary = plan_from_values(batch, values, source="batch form", runnables=Runnables.triggered())
    report_lineage(lambda: plan_lineage(batch))
    log.info(
        "%s batch %s: %d rollouts in %d shards at %s",
        "planned" if summary.created else "already planned (same config)",
        summary.batch_id,
        summary.rollouts,
        len(summary.shards),
        summary.batch_url,
    )
    return list(summary.shards)


def generate(params: Mapping[str, Any], run: DagRunRef, shard: int, *, try_number: int) -> dict[str, Any]:
    """Generate one shard in a child process (a retry is a new attempt that adopts the last one's receipts)."""
    from tasks.lineage.datasets import generate_lineage
    from tasks.orchestration.generate_process import GenerateCommand, GenerateProcessError, run_generate
    from tasks.trigger_policy import load_trigger_policy

    servers = engine_servers(params)
    command = GenerateCommand(
        location(params),
        run_batch_id(params, run),
        shard,
        try_number=try_number,
        secrets=servers.environment() if servers else {},
        servers=servers.pool.urls if servers else (),
        models=load_trigger_policy().models,
    )
    try:
        summary = run_generate(command, log=log.info)
    except GenerateProcessError as exc:
        if exc.permanent:
            _fail(str(exc), exc)
        raise
    report_lineage(lambda: generate_lineage(run_batch(params, run), shard))
    return {
        k: summary[k] for k in ("shard", "attempt", "ok", "poisoned", "failed", "adopted", "calls", "generated_tokens")
    }


def validate(suite: str, params: Mapping[str, Any], run: DagRunRef) -> dict[str, Any]:
    """Run one suite; a suite that fails the batch fails the task with the failing expectations and the report."""
    from tasks.lineage.datasets import suite_lineage
    from tasks.pipeline import describe_failure, run_suite

    batch = run_batch(params, run)
    with _permanent(f"validate {suite}", batch.root_url):
        outcome = run_suite(suite, batch)
    report_lineage(lambda: suite_lineage(batch, outcome.summary))  # a failed suite's run carries its assertions
    if outcome.status == "failed":
        _fail(describe_failure(suite, outcome))
    log.info("%s suite: %s; report: %s", suite, outcome.status, outcome.report_url)
    return {"suite": suite, "status": outcome.status, "report": outcome.report_url}


def finalize(params: Mapping[str, Any], run: DagRunRef) -> dict[str, Any]:
    """Build the staged dataset (verify, linearize, advantages, audit); a no-op once it exists."""
    from tasks.finalize.stage import finalize_batch
    from tasks.lineage.datasets import finalize_lineage

    batch = run_batch(params, run)
    with _permanent("finalize", batch.root_url):
        staged = finalize_batch(batch)
    report_lineage(lambda: finalize_lineage(batch))
    marker = staged.marker
    log.info(
        "staged %d rows (%d trainable) in %d parts at %s/dataset",
        marker.rows,
        marker.trainable_rows,
        len(marker.parts),
        staged.url,
    )
    return {"dataset": f"{staged.url}/dataset", "rows": marker.rows, "trainable_rows": marker.trainable_rows}


def review_request(params: Mapping[str, Any], run: DagRunRef) -> ReviewRequest:
    """Whether the run's batch needs a person's decision, one already made, and the form to ask with."""
    from airflow.configuration import conf

    from tasks.orchestration.report_viewer import run_report_path
    from tasks.orchestration.review_form import build_review_request

    batch = run_batch(params, run)
    base_path = urlparse(conf.get("api", "base_url", fallback=None) or "").path
    with _permanent("review", batch.root_url):
        return build_review_request(
            batch,
            require_review=bool(params.get("require_review")),
            report_url=run_report_path(run.dag_id, run.run_id, base_path=base_path),
            timeout_hours=params["review_timeout_hours"],
        )


def response_decision(params: Mapping[str, Any], run: DagRunRef, event: Mapping[str, Any]) -> ReviewDecision:
    """The decision a person submitted in the review form (or its REST API); a bad one fails the task, naming why."""
    from tasks.records.review import OPTIONS, REASON_FIELD, new_decision

    chosen = list(event.get("chosen_options") or [])
    user = event.get("responded_by_user") or {}
    with _permanent("review", None):
        return new_decision(
            run_batch_id(params, run),
            OPTIONS.get(chosen[0], repr(chosen[0])) if len(chosen) == 1 else repr(chosen),
            (event.get("params_input") or {}).get(REASON_FIELD),
            decided_by=user.get("name") or user.get("id") or "",
            via="airflow",
            now=event["responded_at"].timestamp(),
        )


def review_timed_out(params: Mapping[str, Any], run: DagRunRef) -> dict[str, Any]:
    """Nobody answered within ``review_timeout_hours``: recorded as a rejection (``review_timeout``); fails the task."""
    from tasks.records.review import timeout_decision

    log.error("nobody answered the review within %s hour(s): it counts as a rejection", params["review_timeout_hours"])
    return decide(params, run, timeout_decision(run_batch_id(params, run)))


def decide(params: Mapping[str, Any], run: DagRunRef, decision: ReviewDecision) -> dict[str, Any]:
    """Record ``decision`` (as ``rollout-ledger publish --approve/--reject`` does) and follow the batch's decision."""
    from tasks.pipeline import decide_and_report

    batch = run_batch(params, run)
    with _permanent("review", batch.root_url):
        recorded = decide_and_report(batch, decision)
    if recorded != decision:
        log.info("the batch was decided before this answer; following that decision")
    return follow_decision(params, run, recorded)


def follow_decision(params: Mapping[str, Any], run: DagRunRef, decision: ReviewDecision) -> dict[str, Any]:
    """Report the review's lineage; the task's result for an approval (a rejection fails the task: no publish)."""
    from tasks.layout import REVIEW_RECORD
    from tasks.lineage.datasets import review_lineage

    report_lineage(lambda: review_lineage(run_batch(params, run)))

    if not decision.approved:
        _fail(
            f"batch {decision.batch_id} was rejected: {decision.describe()}; it is never published "
            f"(decision recorded in {REVIEW_RECORD})"
        )
    log.info("batch %s approved: %s", decision.batch_id, decision.describe())
    return {
        "batch_id": decision.batch_id,
        "choice": decision.choice,
        "decided_by": decision.decided_by,
        "decided_at": decision.decided_at,
        "via": decision.via,
    }


def publish(params: Mapping[str, Any], run: DagRunRef) -> dict[str, Any]:
    """Commit the dataset validation and any review let through; return the Asset event's extra (URI, counts, ...)."""
    from tasks.lineage.datasets import publish_lineage
    from tasks.pipeline import publish_and_report

    batch = run_batch(params, run)
    with _permanent("publish", batch.root_url):
        published = publish_and_report(batch, require_review=bool(params.get("require_review")))
    report_lineage(lambda: publish_lineage(batch))
    marker = published.marker
    log.info("published %s/dataset (%d rows)", published.url, marker.rows)
    return {
        "dataset": f"{published.url}/dataset",
        "batch_id": marker.batch_id,
        "rows": marker.rows,
        "trainable_rows": marker.trainable_rows,
        "groups": marker.groups,
        "partial": marker.partial,
        "weight_version": marker.config["weight_version"],
        "storage_conn_id": params.get("storage_conn_id"),
    }


def published_dataset(event: Mapping[str, Any]) -> dict[str, Any]:
    """What a ``grpo_dataset`` event announces, checked against the committed manifest it names.

    Raises when the dataset is not published (no ``_COMMITTED.json``) or its batch id differs.
    """
    from tasks.storage.dataset_manifest import read_dataset_marker
    from tasks.storage.objects import ObjectStore

    where = storage_location(event["dataset"], event.get("storage_conn_id"))
    store = ObjectStore(where.root_url.removesuffix("/dataset"), **where.storage_options)
    marker = read_dataset_marker(store)
    if marker is None or marker.batch_id != event["batch_id"]:
        raise ValueError(f"{event['dataset']}: no published dataset of batch {event['batch_id']} (no _COMMITTED.json)")
    log.info(
        "batch %s: %d rows (%d trainable) at weight version %s, validated: %s",
        marker.batch_id,
        marker.rows,
        marker.trainable_rows,
        marker.config["weight_version"],
        ", ".join(f"{suite} {outcome.get('status')}" for suite, outcome in (marker.validation or {}).items()),
    )
    return {"dataset": event["dataset"], "batch_id": marker.batch_id, "parts": [p.path for p in marker.parts]}


def sweep(params: Mapping[str, Any], run: DagRunRef) -> dict[str, Any]:
    """Delete the orphans of every committed shard (a shard without a marker is left for its retry)."""
    from tasks.lineage.datasets import sweep_lineage
    from tasks.storage.sweep import sweep_orphans

    batch = run_batch(params, run)
    swept, uncommitted = 0, []
    for shard in range(batch.config.shards):
        if batch.shard_marker(shard) is None:
            uncommitted.append(shard)
            continue
        swept += len(sweep_orphans(batch.store, shard).deleted)
    report_lineage(lambda: sweep_lineage(batch))
    log.info("deleted %d orphan object(s); uncommitted shards left alone: %s", swept, uncommitted or "none")
    return {"deleted": swept, "uncommitted_shards": uncommitted}


@contextmanager
def _permanent(stage: str, root: str | None) -> Iterator[None]:
    """Turn an error a retry cannot fix (input, a conflict with storage, a refused publish: :mod:`tasks.errors`)
    into a failure without retry.

    Errors reaching storage are left to the retries: on a worker they are often transient.
    """
    from tasks.entry_point import classify_error
    from tasks.errors import LedgerError

    try:
        yield
    except LedgerError as exc:
        if exc.retryable:
            raise
        _fail(classify_error(exc, stage, root)[1], exc)


def _fail(message: str, cause: BaseException | None = None) -> NoReturn:
    """Log ``message`` as the task's error line, then fail the task without retries."""
    from airflow.sdk.exceptions import AirflowFailException

    log.error(message)
    raise AirflowFailException(message) from cause
