"""The ``rollout-ledger`` command: one sub-command per stage. Scripts depend on it; keep it stable.

Exit codes: 0 done (committed), 1 failed, 2 usage error (bad arguments or config). S3 settings
come from the standard AWS environment variables (``AWS_ENDPOINT_URL``, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

from tasks.config import ADVANTAGES, ON_INVALID, BatchConfig, ConfigError, EngineSpec, ModelSpec
from tasks.engines.base import SamplingSettings
from tasks.environments.registry import EnvironmentLoadError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
log = logging.getLogger("rollout_ledger")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 on usage errors already; keep the message short
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rollout-ledger", description="Token-exact rollout capture and GRPO dataset finalization.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser("plan", help="expand a batch into rollouts and shards; write plan/batch.json")
    _root_and_batch(plan)
    plan.add_argument("--environment", required=True, help="built-in name, pkg.module:Class, or a prompt file path")
    plan.add_argument(
        "--env-option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="environment option (value parsed as JSON, else taken as a string); repeatable",
    )
    plan.add_argument("--num-tasks", type=int, required=True)
    plan.add_argument("--group-size", type=int, required=True)
    plan.add_argument("--shards", type=int, required=True)
    plan.add_argument("--model", default=None, help="local Hugging Face model folder (default: bundled SmolLM2-135M)")
    plan.add_argument("--max-turns", type=int, default=BatchConfig.max_turns)
    plan.add_argument("--max-tokens", type=int, default=SamplingSettings.max_tokens)
    plan.add_argument("--temperature", type=float, default=SamplingSettings.temperature)
    plan.add_argument("--top-p", type=float, default=SamplingSettings.top_p)
    plan.add_argument("--top-k", type=int, default=SamplingSettings.top_k)
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--max-in-flight", type=int, default=BatchConfig.max_in_flight)
    plan.add_argument("--engine", default="vllm", help="inference backend (vllm; megatron on GPU)")
    plan.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="engine option passed through, e.g. max_model_len=2048; repeatable",
    )

    generate = sub.add_parser("generate", help="run one shard's rollouts and commit it")
    _root_and_batch(generate)
    generate.add_argument("--shard", type=int, required=True)
    generate.add_argument("--attempt", type=int, default=None, help="default: the next unused attempt")
    generate.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")

    finalize = sub.add_parser("finalize", help="verify, linearize and publish the batch's GRPO dataset")
    _root_and_batch(finalize)
    finalize.add_argument("--on-invalid", choices=ON_INVALID, default=None, help="default: the batch config's")
    finalize.add_argument("--advantage", choices=ADVANTAGES, default=None, help="default: the batch config's")
    finalize.add_argument("--allow-partial", action="store_true", help="finalize only the committed shards")
    audit = finalize.add_mutually_exclusive_group()
    audit.add_argument(
        "--audit",
        dest="audit",
        action="store_true",
        default=None,
        help="recompute a sample of logprobs with the HF model (default: on for the bundled model)",
    )
    audit.add_argument("--no-audit", dest="audit", action="store_false")

    demo = sub.add_parser("demo", help="plan, generate and finalize a small batch on the embedded defaults")
    demo.add_argument("--root", default=".demo/runs", help="storage root (default .demo/runs)")
    demo.add_argument("--batch-id", default=None, help="default: demo-<timestamp>")

    sweep = sub.add_parser("sweep", help="delete objects of a committed shard that its marker does not name")
    _root_and_batch(sweep)
    sweep.add_argument("--shard", type=int, required=True)
    sweep.add_argument("--dry-run", action="store_true", help="list the orphans, delete nothing")
    return parser


def _root_and_batch(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", required=True, help="storage root URL: a local path, s3://bucket/prefix, ...")
    parser.add_argument("--batch-id", required=True)


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


def _plan(args: argparse.Namespace) -> int:
    from tasks.models.bundled import resolve_model
    from tasks.models.provenance import model_provenance
    from tasks.plan import plan_batch

    model_path = resolve_model(args.model)
    provenance = model_provenance(model_path)
    config = BatchConfig(
        batch_id=args.batch_id,
        environment=args.environment,
        environment_options=_options(args.env_option, "--env-option"),
        num_tasks=args.num_tasks,
        group_size=args.group_size,
        shards=args.shards,
        seed=args.seed,
        model=ModelSpec(path=str(model_path), **provenance),
        engine=EngineSpec(name=args.engine, options=_options(args.engine_option, "--engine-option")),
        sampling=SamplingSettings(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens
        ),
        max_turns=args.max_turns,
        max_in_flight=args.max_in_flight,
        code_version=_code_version(),
    )
    summary = plan_batch(args.root, config)
    verb = "planned" if summary.created else "already planned (same config)"
    print(
        f"{verb} batch {summary.batch_id}: {summary.rollouts} rollouts in {len(summary.shards)} shards at "
        f"{summary.batch_url}"
    )
    return EXIT_OK


def _generate(args: argparse.Namespace) -> int:
    from tasks.generate import generate_shard

    summary = generate_shard(
        args.root, args.batch_id, args.shard, attempt=args.attempt, progress=False if args.no_progress else None
    )
    print(json.dumps(asdict(summary), indent=2))
    return EXIT_OK


def _finalize(args: argparse.Namespace) -> int:
    from tasks.finalize.run import FinalizeOptions, finalize_batch

    options = FinalizeOptions(
        on_invalid=args.on_invalid, advantage=args.advantage, allow_partial=args.allow_partial, audit=args.audit
    )
    published = finalize_batch(args.root, args.batch_id, options)
    marker = published.marker
    print(
        json.dumps(
            {
                "batch_id": marker.batch_id,
                "dataset": f"{published.url}/dataset",
                "already_finalized": not published.created,
                "rows": marker.rows,
                "trainable_rows": marker.trainable_rows,
                "groups": marker.groups,
                "parts": [p.path for p in marker.parts],
            },
            indent=2,
        )
    )
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from tasks.demo import run_demo

    run_demo(args.root, batch_id=args.batch_id)
    return EXIT_OK


def _sweep(args: argparse.Namespace) -> int:
    from tasks.plan import batch_store
    from tasks.storage.sweep import sweep_orphans

    report = sweep_orphans(batch_store(args.root, args.batch_id), args.shard, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for path in report.orphans:
        print(f"{verb} {path}")
    print(f"{verb} {len(report.orphans)} orphan object(s); kept {len(report.kept)}")
    return EXIT_OK


def _code_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"rollout-ledger {version('rollout-ledger')}"
    except PackageNotFoundError:
        return "rollout-ledger (not installed)"


COMMANDS = {"plan": _plan, "generate": _generate, "finalize": _finalize, "demo": _demo, "sweep": _sweep}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # stdout carries the command's result (scripts parse it); engine logs go to stderr.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, EnvironmentLoadError, FileExistsError) as exc:
        print(f"rollout-ledger {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        log.exception("rollout-ledger %s failed", args.command)
        print(f"rollout-ledger {args.command}: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
