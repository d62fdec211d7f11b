"""The ``rollout-ledger`` command: one sub-command per stage. Scripts depend on it; keep it stable.

Exit codes: 0 done; 1 failed (a validation suite failed the batch, publish was refused, the engine
died, an unexpected error); 2 a
usage or input error (bad flags, config, environment, model, unreadable storage, a review decision
without a reason: fix the command); 3 a conflict with what storage already holds (a batch planned
differently, a model whose hashes differ from the plan, data that fails an integrity check, a
decision on a batch already decided otherwise); 128+N stopped by signal N (completed
work is kept; run the command again). stdout carries the result, stderr the progress and errors.
S3 settings come from the standard AWS environment variables (``AWS_ENDPOINT_URL``, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.batch import Batch
from tasks.batch_fields import (
    ADVANTAGES,
    ON_INVALID,
    OPTIONS_OF,
    BatchFields,
    check_values,
    config_paths,
    field_default,
    plan_flag,
)
from tasks.environments.registry import Runnables
from tasks.errors import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    ConfigError,
    ConflictError,
    EngineDeadError,
    GenerateInterrupted,
    RefusedError,
    ReviewInputError,
    StorageUnavailableError,
    UsageError,
    exit_code,
)
from tasks.records.suite_summary import SUITES
from tasks.storage.options import aws_variables_read, is_s3_url, storage_options_from_env

if TYPE_CHECKING:
    from tasks.lineage.emit import LineageSink

QUIET_LIBRARIES = ("great_expectations", "httpx")
log = logging.getLogger("rollout_ledger")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 on usage errors already; keep the message short
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _shard_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shard is a number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a shard is a number >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rollout-ledger",
        description="Token-exact rollout capture and GRPO dataset finalization.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging; show the engine's own log lines")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)

    plan = command("plan", "expand a batch into rollouts and shards; write plan/batch.json")
    _root_and_batch(plan)
    _batch_field_flags(plan)

    generate = command("generate", "run shards' rollouts on one engine and commit each shard")
    _root_and_batch(generate)
    which = generate.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--shard", type=_shard_number, action="append", help="shard to generate; repeat to run several on one engine"
    )
    which.add_argument("--all-shards", action="store_true", help="every shard of the batch, on one engine")
    generate.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    generate.add_argument(
        "--try-number", type=int, default=None, help="the orchestrator's try number, recorded in the attempt claim"
    )
    generate.add_argument("--model", default=None, help="refused: the model is fixed at plan time (see plan --model)")
    generate.add_argument(
        "--declared-only",
        action="store_true",
        help="run only a built-in game or an entry of the environment registry (what a triggered batch's "
        "workers run: docs/security.md)",
    )

    finalize = command(
        "finalize", "validate the ledger, build the GRPO dataset, validate it, and publish it if both suites pass"
    )
    _root_and_batch(finalize)
    finalize.add_argument("--on-invalid", choices=ON_INVALID, default=None, help="override the batch config's")
    finalize.add_argument("--advantage", choices=ADVANTAGES, default=None, help="override the batch config's")
    finalize.add_argument(
        "--allow-partial", action="store_true", help="finalize only the committed shards (recorded as partial)"
    )
    audit = finalize.add_mutually_exclusive_group()
    audit.add_argument(
        "--audit",
        dest="audit",
        action="store_true",
        default=None,
        help="recompute a sample of logprobs with the HF model (default: on for the bundled model)",
    )
    audit.add_argument("--no-audit", dest="audit", action="store_false", help="skip the logprob audit")
    finalize.add_argument(
        "--no-publish", action="store_true", help="stop after the build: lineage suite and staged dataset only"
    )
    _threshold_flag(finalize)

    validate = command("validate", "run the validation suites; write their reports and the overview page")
    _root_and_batch(validate)
    validate.add_argument("--suite", choices=(*SUITES, "all"), default="all", help="which suite")
    _threshold_flag(validate)

    publish = command(
        "publish",
        "commit the staged dataset (dataset/_COMMITTED.json) if neither suite failed; a batch a suite warned about "
        "needs a review decision first (--approve or --reject, recorded once in reports/review.json)",
    )
    _root_and_batch(publish)
    decision = publish.add_mutually_exclusive_group()
    decision.add_argument("--approve", action="store_true", help="record an approval, then publish")
    decision.add_argument("--reject", action="store_true", help="record a rejection: the batch is never published")
    publish.add_argument("--reason", default=None, help="why you approve or reject (required with either)")
    publish.add_argument(
        "--by", default=None, help="who decides, recorded with the decision (default: the user running the command)"
    )

    status = command("status", "what a batch holds: plan, shards and attempts, counts, dataset, reports")
    _root_and_batch(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of text")

    sweep = command("sweep", "delete objects of a committed shard that its marker does not name")
    _root_and_batch(sweep)
    sweep.add_argument("--shard", type=_shard_number, required=True, help="the committed shard to sweep")
    sweep.add_argument("--dry-run", action="store_true", help="list the orphans, delete nothing")

    serve = command(
        "serve",
        "start a vLLM server (engine vllm_server's counterpart) for a model; print its URL; stop it with "
        "Ctrl-C or SIGTERM",
    )
    serve.add_argument("--model", default=field_default("model"), help="model reference or local folder to serve")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (one that is not loopback needs --api-key-file)"
    )
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--api-key-file",
        default=None,
        help="file holding the API key every route but /health requires (default: a new key in "
        "<cache>/serve/port-<port>.key, mode 0600; loopback only)",
    )
    serve.add_argument(
        "--engine-option",
        action="append",
        metavar="KEY=JSON",
        help=f"a vllm engine option, repeatable; none given: {json.dumps(field_default('engine_options'))}",
    )
    serve.add_argument("--log", default=None, help="the server's log file (default: in the user cache)")

    refit = command("refit", "load a model folder into running vLLM servers as a new weight version")
    refit.add_argument("--urls", nargs="+", required=True, help="base URLs of the servers (replicas of one model)")
    refit.add_argument("--folder", required=True, help="the model folder, as the servers' machine sees it")
    refit.add_argument("--version", type=int, default=None, help="the new weight version (default: current + 1)")
    refit.add_argument("--api-key-file", default=None, help="file holding the servers' API key")

    demo = command("demo", "plan, generate and finalize a small batch on the embedded defaults")
    demo.add_argument("--root", default=".demo/runs", help="storage root URL")
    demo.add_argument("--batch-id", default=None, help="batch id (default: demo-<timestamp>)")
    return parser


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each valued flag's default, except where there is none to show (switches, required flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default is None or action.default == [] or action.required:
            return action.help
        return super()._get_help_string(action)


def _batch_field_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every batch field that reaches the config, typed, bounded and described as declared.

    An options field (``--env-option``, ``--engine-option``) takes ``KEY=JSON`` pairs; given none,
    the environment's (engine's) declared default options apply to the default environment (engine)
    only. The values are checked against the declaration when the batch is planned.
    """
    choice_of = {options: choice for choice, options in OPTIONS_OF.items()}
    for name in config_paths():
        info = BatchFields.model_fields[name]
        flag = plan_flag(name)
        kwargs: dict[str, Any] = {"dest": name, "help": info.description}
        if name in choice_of:
            choice = choice_of[name]
            default = json.dumps(field_default(name), sort_keys=True)
            kwargs |= {
                "action": "append",
                "metavar": "KEY=JSON",
                "help": f"{info.description}; one KEY=JSON pair (JSON, else a string), repeatable; "
                f"none given: {default} for {choice} {field_default(choice)}, none for another",
            }
        else:
            kind = _flag_type(info.annotation)
            kwargs |= {"choices": kind} if isinstance(kind, tuple) else {"type": kind}
            kwargs |= {"required": True} if flag.required else {"default": field_default(name)}
        parser.add_argument(flag.name, **kwargs)


def _flag_type(annotation: Any) -> type | tuple[str, ...]:
    """What argparse converts a flag's text to: ``int``, ``float``, ``str``, or the choices of a ``Literal``."""
    import typing

    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return kinds[0] if kinds[0] in (int, float) else str


def _plan_values(args: argparse.Namespace) -> dict[str, Any]:
    """The batch fields the plan flags give (options as JSON objects); fields not given take their defaults."""
    values = {}
    for name in config_paths():
        value = getattr(args, name)
        if name in OPTIONS_OF.values():
            value = None if value is None else _options(value, plan_flag(name).name or name)
        if value is not None:
            values[name] = value
    return values


def _threshold_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a validation threshold of the batch config, e.g. max_poisoned_rate=0.3; repeatable",
    )


def _root_and_batch(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", required=True, help="storage root URL: a local path, s3://bucket/prefix, ...")
    parser.add_argument("--batch-id", required=True, help="the batch's id: [A-Za-z0-9][A-Za-z0-9._-]*, <= 128 chars")


def _options(pairs: Sequence[str], flag: str) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} takes KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _batch(args: argparse.Namespace) -> Batch:
    """The batch the command names, on storage configured from the environment (AWS variables for S3)."""
    return Batch.open(args.root, args.batch_id, storage_options_from_env(args.root, os.environ))


def _lineage() -> LineageSink:
    """Where this command's task runs report their lineage (nothing unless OpenLineage is configured)."""
    from tasks.lineage.emit import sink_from_environment

    return sink_from_environment()


def _say_lineage(sink: LineageSink) -> None:
    said = sink.describe()
    if said is not None:
        _say(said)


def _plan(args: argparse.Namespace) -> int:
    from tasks.lineage.datasets import plan_lineage
    from tasks.plan import plan_from_values

    values = {"batch_id": args.batch_id, **_plan_values(args)}
    check_values(values, source="plan flags")  # a bad flag is named before storage is touched
    batch, lineage = _batch(args), _lineage()
    with lineage.task("plan", batch) as run:
        summary = plan_from_values(batch, values, source="plan flags")
        run.report(lambda: plan_lineage(batch))
    _say_lineage(lineage)
    verb = "planned" if summary.created else "already planned (same config)"
    planned = summary.config
    print(
        f"{verb} batch {summary.batch_id}: {summary.rollouts} rollouts in {len(summary.shards)} shards at "
        f"{summary.batch_url}\n"
        f"  environment  {planned.environment} {json.dumps(planned.environment_options, sort_keys=True)}\n"
        f"  model        {planned.model.reference}\n"
        f"    weights    sha256 {planned.model.weights_sha256}\n"
        f"    tokenizer  sha256 {planned.model.tokenizer_sha256}\n"
        f"    template   sha256 {planned.model.chat_template_sha256 or '(none)'}\n"
        f"  engine       {planned.engine.name} {json.dumps(planned.engine.options, sort_keys=True)}, "
        f"weight version {planned.weight_version}"
    )
    return EXIT_OK


def _generate(args: argparse.Namespace) -> int:
    from tasks.generate import generate_shards
    from tasks.lineage.datasets import TaskLineage, generate_lineage

    if args.model is not None:
        raise ConfigError(
            "generate takes no --model: the model is fixed at plan time (plan/batch.json records it and its hashes); "
            "plan a new batch id with --model to use another one"
        )
    batch = _batch(args)
    shards = list(range(batch.config.shards)) if args.all_shards else args.shard
    lineage = _lineage()
    with lineage.task("generate", batch) as run:
        summaries = generate_shards(
            batch,
            shards,
            progress=False if args.no_progress else None,
            try_number=args.try_number,
            on_engine_start=_engine_notice(args),
            runnables=Runnables.triggered() if args.declared_only else Runnables.operator(),
        )
        run.report(lambda: TaskLineage.merged(generate_lineage(batch, shard) for shard in shards))
    for summary in summaries:
        signal = summary.signal
        _say(
            f"shard {summary.shard}: "
            + (
                f"already committed by attempt {summary.attempt}"
                if summary.already_committed
                else f"committed attempt {summary.attempt}: {summary.ok} ok, {summary.poisoned} poisoned, "
                f"{summary.failed} failed, {summary.adopted} adopted, {summary.generated_tokens} tokens "
                f"in {summary.seconds:.0f} s"
            )
        )
        for line in signal.describe() if signal is not None else ():
            _say(f"  {line}")
        if summary.calls_by_replica:
            _say("  calls per server: " + ", ".join(f"{url} {n}" for url, n in summary.calls_by_replica.items()))
        for failover in summary.failovers:
            _say(f"  failed over: {failover}")
    _say_lineage(lineage)
    print(json.dumps([_summary_json(s) for s in summaries], indent=2))
    return EXIT_OK


def _summary_json(summary: Any) -> dict[str, Any]:
    data = asdict(summary)
    data.pop("signal")
    if summary.signal is not None:
        data["training_signal"] = asdict(summary.signal)
    return data


def _engine_notice(args: argparse.Namespace) -> Callable[[float], Any]:
    """What the CLI does around the engine's life: say how long it starts, send its output to a log file."""
    import contextlib
    import time

    from tasks.engines.startup import engine_log_path, engine_output_to

    @contextlib.contextmanager
    def notice(expected_seconds: float) -> Any:
        _say(f"starting the engine (about {expected_seconds:.0f} s)")
        if args.verbose:
            yield
            return
        path = engine_log_path(args.batch_id, time.strftime("generate-%Y%m%d-%H%M%S") + f"-{os.getpid()}")
        _say(f"engine log: {path} (-v shows it here)")
        with engine_output_to(path):
            yield

    return notice


def _finalize(args: argparse.Namespace) -> int:
    from tasks import layout
    from tasks.finalize.stage import FinalizeOptions
    from tasks.pipeline import finalize_and_publish, thresholds_with
    from tasks.training_signal import TrainingSignal

    options = FinalizeOptions(
        on_invalid=args.on_invalid, advantage=args.advantage, allow_partial=args.allow_partial, audit=args.audit
    )
    batch, lineage = _batch(args), _lineage()
    thresholds = thresholds_with(batch, _options(args.threshold, "--threshold"))
    try:
        result = finalize_and_publish(
            batch, options, thresholds=thresholds, publish=not args.no_publish, lineage=lineage
        )
    finally:
        _say_lineage(lineage)
    marker = result.staged.marker
    metrics = batch.dataset_metrics(marker)
    _say(f"dataset {result.staged.url}/dataset: {marker.rows} rows, {marker.trainable_rows} trainable")
    if marker.partial:
        _say(f"  PARTIAL: shards {list(marker.missing_shards)} were not committed and are missing from it")
    for line in TrainingSignal.of_dataset_metrics(metrics).describe():
        _say(f"  {line}")
    for suite, outcome in result.suites.items():
        _say(f"{suite} suite: {outcome.status} (report: {outcome.report_url})")
    _say(f"overview: {batch.url_of(layout.REPORTS_INDEX)}")
    if result.published is not None:
        _say(f"published: {batch.url_of(layout.DATASET_MARKER)}")
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


def _validate(args: argparse.Namespace) -> int:
    from tasks.pipeline import describe_failure, thresholds_with, validate_suite

    batch, lineage = _batch(args), _lineage()
    thresholds = thresholds_with(batch, _options(args.threshold, "--threshold"))
    suites = SUITES if args.suite == "all" else (args.suite,)
    outcomes = {}
    for suite in suites:
        outcomes[suite] = outcome = validate_suite(suite, batch, thresholds=thresholds, lineage=lineage)
        _say(f"{suite} suite: {outcome.status} (report: {outcome.report_url})")
        if outcome.status == "failed":
            _say(f"  {describe_failure(suite, outcome)}")
    _say_lineage(lineage)
    print(json.dumps({suite: outcome.status for suite, outcome in outcomes.items()}, indent=2))
    return EXIT_FAILED if any(o.status == "failed" for o in outcomes.values()) else EXIT_OK


def _publish(args: argparse.Namespace) -> int:
    import getpass

    from tasks.lineage.datasets import publish_lineage, review_lineage
    from tasks.pipeline import decide_and_report, publish_and_report
    from tasks.records.review import PUBLISH, REJECT, new_decision

    batch, lineage = _batch(args), _lineage()
    choice = PUBLISH if args.approve else REJECT if args.reject else None
    if choice is None and (args.reason is not None or args.by is not None):
        raise ReviewInputError("--reason and --by go with --approve or --reject")
    review = None
    if choice is not None:
        wanted = new_decision(args.batch_id, choice, args.reason, decided_by=args.by or getpass.getuser(), via="cli")
        with lineage.task("review", batch) as run:
            review = decide_and_report(batch, wanted)
            run.report(lambda: review_lineage(batch))
        _say(f"review: {review.describe()}" + ("" if review == wanted else " (decided before: that decision stands)"))
        if not review.approved:
            _say_lineage(lineage)
            print(json.dumps({"batch_id": args.batch_id, "published": False, "review": asdict(review)}))
            return EXIT_OK
    with lineage.task("publish", batch) as run:
        published = publish_and_report(batch)
        run.report(lambda: publish_lineage(batch))
    _say_lineage(lineage)
    verb = "published" if published.created else "already published"
    _say(f"{verb}: {published.url}/dataset ({published.marker.rows} rows)")
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


def _status(args: argparse.Namespace) -> int:
    from tasks.status import batch_status, render_status

    status = batch_status(_batch(args))
    print(json.dumps(status.to_dict(), indent=2, sort_keys=True) if args.json else render_status(status).rstrip())
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from tasks.demo import run_demo

    run_demo(args.root, batch_id=args.batch_id)
    return EXIT_OK


def _sweep(args: argparse.Namespace) -> int:
    from tasks.lineage.datasets import sweep_lineage
    from tasks.lineage.emit import NO_LINEAGE
    from tasks.storage.sweep import sweep_orphans

    batch = _batch(args)
    lineage: LineageSink = NO_LINEAGE if args.dry_run else _lineage()
    with lineage.task("sweep_orphans", batch) as run:
        report = sweep_orphans(batch.store, args.shard, dry_run=args.dry_run)
        run.report(lambda: sweep_lineage(batch, shards=[args.shard]))
    _say_lineage(lineage)
    verb = "would delete" if args.dry_run else "deleted"
    for path in report.orphans:
        print(f"{verb} {path}")
    print(f"{verb} {len(report.orphans)} orphan object(s); kept {len(report.kept)}")
    return EXIT_OK


def _serve(args: argparse.Namespace) -> int:
    from tasks.engines.options import read_key_file
    from tasks.engines.startup import engine_log_path
    from tasks.engines.vllm.options import VllmOptions
    from tasks.engines.vllm.serve import (
        VllmServer,
        generated_key_path,
        is_loopback,
        port_taken,
        serve_until_stopped,
        write_new_key,
    )
    from tasks.models.reference import resolve_model_reference

    if args.api_key_file is None and not is_loopback(args.host):
        raise UsageError(
            f"--host {args.host} is not a loopback address: give --api-key-file, the key its clients will send "
            "(serve makes a key of its own only for a loopback server)"
        )
    if port_taken(args.host, args.port):  # checked before a new key replaces the one of a server still there
        raise UsageError(
            f"port {args.port} on {args.host} is in use: stop the server that holds it (a running serve: Ctrl-C "
            "or SIGTERM) or choose another --port"
        )
    folder = resolve_model_reference(args.model)
    options = VllmOptions.from_mapping(
        field_default("engine_options")
        if args.engine_option is None
        else _options(args.engine_option, "--engine-option")
    )
    if args.api_key_file is None:
        key_file = generated_key_path(args.port)
        api_key = write_new_key(key_file)
    else:
        key_file = Path(args.api_key_file).expanduser()
        api_key = read_key_file(key_file, what="--api-key-file")
    log_path = Path(args.log) if args.log else engine_log_path("serve", f"port-{args.port}")
    _say(f"starting a vLLM server for {args.model} on {args.host}:{args.port} (log: {log_path})")
    _say(f"every route but /health requires the API key in {key_file} (clients: --api-key-file / api_key_file)")
    server = VllmServer.start(folder, options, host=args.host, port=args.port, api_key=api_key, log_path=log_path)
    try:
        server.wait_ready(on_wait=_waiting("vLLM server starting"))
    except BaseException:
        server.stop()
        raise
    print(server.url, flush=True)
    _say(f"serving {folder} at {server.url}; Ctrl-C or SIGTERM stops it (the server ends with this process)")
    exited = serve_until_stopped(server)
    if exited is not None:
        _say(f"the vLLM server exited with {exited}; its log ({log_path}) ends:\n{server.log_tail()}")
        return EXIT_FAILED
    _say("vLLM server stopped")
    return EXIT_OK


def _refit(args: argparse.Namespace) -> int:
    import asyncio

    from tasks.engines.vllm_server.options import VllmServerOptions
    from tasks.engines.vllm_server.refit import refit_urls

    options = VllmServerOptions(urls=args.urls, api_key_file=args.api_key_file)
    urls = options.urls
    refit = asyncio.run(
        refit_urls(urls, args.folder, args.version, api_key=options.api_key(), key_source=options.key_source())
    )
    sha = refit.load.weights_sha256
    weights = (
        f"weights sha256 {sha} (hashed here)"
        if sha is not None
        else f"weights declared, not verified ({args.folder} is not a folder of weights this machine can read)"
    )
    print(f"refit {len(urls)} server(s) to {args.folder} at weight version {refit.version}: {weights}")
    return EXIT_OK


def _waiting(what: str) -> Callable[[float], None]:
    """A callback that tells the terminal every 10 s that ``what`` is still going."""
    said = [0.0]

    def on_wait(seconds: float) -> None:
        if seconds - said[0] >= 10:
            said[0] = seconds
            _say(f"{what}: {seconds:.0f} s")

    return on_wait


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


COMMANDS = {
    "plan": _plan,
    "generate": _generate,
    "finalize": _finalize,
    "validate": _validate,
    "publish": _publish,
    "status": _status,
    "sweep": _sweep,
    "serve": _serve,
    "refit": _refit,
    "demo": _demo,
}


def classify_error(exc: BaseException, command: str, root: str | None) -> tuple[int, str]:
    """The exit code and the one line a person sees for an error of ``command`` (no traceback).

    The code is the error's own (:mod:`tasks.errors`); an error reaching storage that is not ours
    (a missing bucket, no credentials) is the user's setup: a usage error.
    """
    prefix = f"rollout-ledger {command}"
    code = exit_code(exc)
    if isinstance(exc, GenerateInterrupted):
        return code, f"{prefix}: {exc}"
    if isinstance(exc, KeyboardInterrupt):
        return code, f"{prefix}: interrupted; nothing was committed by this run"
    if isinstance(exc, EngineDeadError) and command != "generate":  # plan's or refit's call to a server
        return code, f"{prefix}: failed: {exc}"
    if isinstance(exc, EngineDeadError):
        return code, (
            f"{prefix}: failed: the engine died ({exc}); receipts of completed rollouts were flushed and no "
            "shard marker was written: run generate again to adopt them and re-run the rest"
        )
    if isinstance(exc, RefusedError):
        return code, f"{prefix}: {exc}"
    if isinstance(exc, UsageError) or code == EXIT_USAGE:
        return code, f"{prefix}: error: {exc}"
    if isinstance(exc, ConflictError):
        return code, f"{prefix}: conflict: {exc}"
    if isinstance(exc, StorageUnavailableError):  # transient faults outlasted the retries: retry the command later
        return code, f"{prefix}: failed: {exc}{_where(root)}"
    if root is not None and _is_storage_access_error(exc):
        return EXIT_USAGE, f"{prefix}: error: cannot use storage {root}{_where(root)}: {type(exc).__name__}: {exc}"
    return EXIT_FAILED, f"{prefix}: failed: {type(exc).__name__}: {exc} (-v shows the traceback)"


def _where(root: str | None) -> str:
    """For an S3 root, which AWS variables were read (names, never values); else nothing."""
    if root is None or not is_s3_url(root):
        return ""
    read = aws_variables_read(os.environ)
    return f" (AWS variables read: {', '.join(read) if read else 'none set'})"


def _is_storage_access_error(exc: BaseException) -> bool:
    """Errors reaching storage (missing bucket, no credentials, endpoint down): the user's setup, not a bug."""
    module = type(exc).__module__
    return isinstance(exc, (PermissionError, FileNotFoundError, ConnectionError, TimeoutError)) or module.startswith(
        ("botocore", "aiobotocore", "s3fs")
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # libraries that narrate their internals at INFO
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return COMMANDS[args.command](args)
    except (Exception, KeyboardInterrupt) as exc:
        code, message = classify_error(exc, args.command, getattr(args, "root", None))
        if code == EXIT_FAILED and args.verbose:
            log.exception("rollout-ledger %s failed", args.command)
        print(message, file=sys.stderr)
        return code


if __name__ == "__main__":
    raise SystemExit(main())
