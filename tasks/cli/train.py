"""The reference trainer: ``checkpoint-zero`` makes checkpoint 0 from a model, ``train`` takes one GRPO step.

``train`` prints the step's JSON summary on stdout (docs/training.md): the checkpoint it wrote, the datasets it
trained on and those it skipped as consumed, the step-0 ratio and the time of each part. Every dataset given
already consumed is a no-op (exit 0, ``checkpoint`` null).
"""

from __future__ import annotations

import argparse
import json
import os

from tasks.cli.context import say
from tasks.cli.flags import AddCommand
from tasks.errors import EXIT_OK, UsageError


def add_checkpoint_zero(add: AddCommand) -> None:
    parser = add(
        "checkpoint-zero",
        "make checkpoint 0 (DIR/step-000000) from a model: its files byte for byte and checkpoint.json; a no-op when "
        "DIR already holds checkpoint 0 of the same weights",
    )
    parser.add_argument(
        "--model", required=True, help="model reference (bundled:smollm2-135m-instruct) or local Hugging Face folder"
    )
    parser.add_argument("--out", required=True, help="the checkpoints root (a local folder; created if missing)")
    parser.set_defaults(run=run_checkpoint_zero)


def add_train(add: AddCommand) -> None:
    from tasks.trainer.loss import DEFAULT_CLIP, DEFAULT_TIS_CAP
    from tasks.trainer.step import DEFAULT_LEARNING_RATE, DEFAULT_RATIO_TOLERANCE

    parser = add(
        "train",
        "one GRPO step from the latest checkpoint under --checkpoints over the published datasets given (those a "
        "checkpoint already consumed are skipped); writes the next checkpoint",
    )
    parser.add_argument("--checkpoints", required=True, help="the checkpoints root (step-NNNNNN folders)")
    parser.add_argument(
        "--batch-url",
        action="append",
        required=True,
        metavar="URL",
        help="a batch whose dataset is published (ROOT/batches/BATCH_ID); repeatable: one step over all",
    )
    parser.add_argument("--lr", type=float, default=DEFAULT_LEARNING_RATE, help="AdamW learning rate")
    parser.add_argument("--clip", type=float, default=DEFAULT_CLIP, help="PPO clip range (both sides)")
    parser.add_argument("--tis-cap", type=float, default=DEFAULT_TIS_CAP, help="token-level TIS cap")
    parser.add_argument(
        "--ratio-tolerance",
        type=float,
        default=DEFAULT_RATIO_TOLERANCE,
        help="refuse to train when the step-0 ratio's token mean is farther than this from 1",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPUs this may use)")
    parser.set_defaults(run=run_train)


def run_checkpoint_zero(args: argparse.Namespace) -> int:
    from tasks.models.reference import model_reference, resolve_model_reference
    from tasks.trainer.checkpoint import checkpoint_zero, describe

    folder = resolve_model_reference(model_reference(args.model))
    checkpoint = checkpoint_zero(folder, _local_folder(args.out, "--out"))
    say(f"checkpoint 0: {checkpoint.folder} (weights sha256 {checkpoint.weights_sha256})")
    print(json.dumps(describe(checkpoint), indent=2))
    return EXIT_OK


def run_train(args: argparse.Namespace) -> int:
    from tasks.storage.options import storage_options_from_env
    from tasks.trainer.loss import GrpoLossSettings
    from tasks.trainer.step import StepSettings, train_step

    try:
        settings = StepSettings(
            lr=args.lr,
            loss=GrpoLossSettings(clip_low=args.clip, clip_high=args.clip, tis_cap=args.tis_cap),
            ratio_tolerance=args.ratio_tolerance,
            threads=args.threads,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    urls = list(dict.fromkeys(args.batch_url))
    # One set of storage options serves every batch URL; they come from the environment as for every command.
    options = storage_options_from_env(urls[0], os.environ)
    result = train_step(_local_folder(args.checkpoints, "--checkpoints"), urls, settings, storage_options=options)
    for url, by in result.skipped:
        say(f"skipped {url}: already consumed by {by}")
    if result.checkpoint is None:
        say("nothing to train: every dataset given was consumed already")
    else:
        ratio = result.ratio
        assert ratio is not None
        say(
            f"step {result.checkpoint.step}: {result.rows} rows, {result.tokens} tokens, loss {result.loss:.6f}, "
            f"step-0 ratio {ratio.mean:.6f}; wrote {result.checkpoint.folder} (weights sha256 "
            f"{result.checkpoint.weights_sha256})"
        )
    print(json.dumps(result.summary(), indent=2))
    return EXIT_OK


def _local_folder(given: str, flag: str) -> str:
    if "://" in given and not given.startswith("file://"):
        raise UsageError(f"{flag} {given}: checkpoints live in a local folder (a path or file:// URI)")
    return os.path.abspath(os.path.expanduser(given.removeprefix("file://")))
