"""The dataset's way to publication: ``finalize`` (build, validate, publish), ``validate`` and ``publish``.

A suite that fails the batch makes ``validate`` exit 1; ``publish`` records a person's decision
(once, in ``reports/review.json``) before it publishes.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from tasks.batch_fields import ADVANTAGES, ON_INVALID
from tasks.cli.context import lineage_sink, open_batch, say, say_lineage
from tasks.cli.flags import AddCommand, key_json_pairs, root_and_batch, threshold_flag
from tasks.errors import EXIT_FAILED, EXIT_OK, ReviewInputError
from tasks.records.suite_summary import SUITES


def add_finalize(add: AddCommand) -> None:
    parser = add(
        "finalize", "validate the ledger, build the GRPO dataset, validate it, and publish it if both suites pass"
    )
    root_and_batch(parser)
    parser.add_argument("--on-invalid", choices=ON_INVALID, default=None, help="override the batch config's")
    parser.add_argument("--advantage", choices=ADVANTAGES, default=None, help="override the batch config's")
    parser.add_argument(
        "--allow-partial", action="store_true", help="finalize only the committed shards (recorded as partial)"
    )
    audit = parser.add_mutually_exclusive_group()
    audit.add_argument(
        "--audit",
        dest="audit",
        action="store_true",
        default=None,
        help="recompute a sample of logprobs with the HF model (default: on for the bundled model)",
    )
    audit.add_argument("--no-audit", dest="audit", action="store_false", help="skip the logprob audit")
    parser.add_argument(
        "--no-publish", action="store_true", help="stop after the build: lineage suite and staged dataset only"
    )
    threshold_flag(parser)
    parser.set_defaults(run=run_finalize)


def add_validate(add: AddCommand) -> None:
    parser = add("validate", "run the validation suites; write their reports and the overview page")
    root_and_batch(parser)
    parser.add_argument("--suite", choices=(*SUITES, "all"), default="all", help="which suite")
    threshold_flag(parser)
    parser.set_defaults(run=run_validate)


def add_publish(add: AddCommand) -> None:
    parser = add(
        "publish",
        "commit the staged dataset (dataset/_COMMITTED.json) if neither suite failed; a batch a suite warned about "
        "needs a review decision first (--approve or --reject, recorded once in reports/review.json)",
    )
    root_and_batch(parser)
    decision = parser.add_mutually_exclusive_group()
    decision.add_argument("--approve", action="store_true", help="record an approval, then publish")
    decision.add_argument("--reject", action="store_true", help="record a rejection: the batch is never published")
    parser.add_argument("--reason", default=None, help="why you approve or reject (required with either)")
    parser.add_argument(
        "--by", default=None, help="who decides, recorded with the decision (default: the user running the command)"
    )
    parser.set_defaults(run=run_publish)


def run_finalize(args: argparse.Namespace) -> int:
    from tasks import layout
    from tasks.finalize.stage import FinalizeOptions
    from tasks.pipeline import finalize_and_publish, thresholds_with
    from tasks.training_signal import TrainingSignal

    options = FinalizeOptions(
        on_invalid=args.on_invalid, advantage=args.advantage, allow_partial=args.allow_partial, audit=args.audit
    )
    batch, lineage = open_batch(args), lineage_sink()
    thresholds = thresholds_with(batch, key_json_pairs(args.threshold, "--threshold"))
    try:
        result = finalize_and_publish(
            batch, options, thresholds=thresholds, publish=not args.no_publish, lineage=lineage
        )
    finally:
        say_lineage(lineage)
    marker = result.staged.marker
    metrics = batch.dataset_metrics(marker)
    say(f"dataset {result.staged.url}/dataset: {marker.rows} rows, {marker.trainable_rows} trainable")
    if marker.partial:
        say(f"  PARTIAL: shards {list(marker.missing_shards)} were not committed and are missing from it")
    for line in TrainingSignal.of_dataset_metrics(metrics).describe():
        say(f"  {line}")
    for suite, outcome in result.suites.items():
        say(f"{suite} suite: {outcome.status} (report: {outcome.report_url})")
    say(f"overview: {batch.url_of(layout.REPORTS_INDEX)}")
    if result.published is not None:
        say(f"published: {batch.url_of(layout.DATASET_MARKER)}")
    print(
        json.dumps(
            {
                "batch_id": marker.batch_id,
                "dataset": f"{result.staged.url}/dataset",
                "already_finalized": not result.staged.created,
                "published": result.published is not None,
                "suites": {suite: outcome.status for suite, outcome in result.suites.items()},
                "rows": marker.rows,
                "trainable_rows": marker.trainable_rows,
                "groups": marker.groups,
                "partial": marker.partial,
                "missing_shards": list(marker.missing_shards),
                "parts": [p.path for p in marker.parts],
            },
            indent=2,
        )
    )
    return EXIT_OK


def run_validate(args: argparse.Namespace) -> int:
    from tasks.pipeline import describe_failure, thresholds_with, validate_suite

    batch, lineage = open_batch(args), lineage_sink()
    thresholds = thresholds_with(batch, key_json_pairs(args.threshold, "--threshold"))
    suites = SUITES if args.suite == "all" else (args.suite,)
    outcomes = {}
    for suite in suites:
        outcomes[suite] = outcome = validate_suite(suite, batch, thresholds=thresholds, lineage=lineage)
        say(f"{suite} suite: {outcome.status} (report: {outcome.report_url})")
        if outcome.status == "failed":
            say(f"  {describe_failure(suite, outcome)}")
    say_lineage(lineage)
    print(json.dumps({suite: outcome.status for suite, outcome in outcomes.items()}, indent=2))
    return EXIT_FAILED if any(o.status == "failed" for o in outcomes.values()) else EXIT_OK


def run_publish(args: argparse.Namespace) -> int:
    import getpass

    from tasks.lineage.datasets import publish_lineage, review_lineage
    from tasks.pipeline import decide_and_report, publish_and_report
    from tasks.records.review import PUBLISH, REJECT, new_decision

    batch, lineage = open_batch(args), lineage_sink()
    choice = PUBLISH if args.approve else REJECT if args.reject else None
    if choice is None and (args.reason is not None or args.by is not None):
        raise ReviewInputError("--reason and --by go with --approve or --reject")
    review = None
    if choice is not None:
        wanted = new_decision(args.batch_id, choice, args.reason, decided_by=args.by or getpass.getuser(), via="cli")
        with lineage.task("review", batch) as run:
            review = decide_and_report(batch, wanted)
            run.report(lambda: review_lineage(batch))
        say(f"review: {review.describe()}" + ("" if review == wanted else " (decided before: that decision stands)"))
        if not review.approved:
            say_lineage(lineage)
            print(json.dumps({"batch_id": args.batch_id, "published": False, "review": asdict(review)}))
            return EXIT_OK
    with lineage.task("publish", batch) as run:
        published = publish_and_report(batch)
        run.report(lambda: publish_lineage(batch))
    say_lineage(lineage)
    verb = "published" if published.created else "already published"
    say(f"{verb}: {published.url}/dataset ({published.marker.rows} rows)")
    review = published.marker.review
    print(
        json.dumps(
            {
                "batch_id": args.batch_id,
                "dataset": f"{published.url}/dataset",
                "created": published.created,
                "published": True,
                "review": None if review is None else asdict(review),
            }
        )
    )
    return EXIT_OK
