"""Flag pieces several commands share: how a command is added, the batch it names, shards, ``KEY=JSON`` pairs."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence

from tasks.errors import ConfigError

# Adds a sub-command (name, help) and returns its parser; the command's module sets its ``run`` default.
AddCommand = Callable[[str, str], argparse.ArgumentParser]


def shard_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shard is a number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a shard is a number >= 0, got {value}")
    return value


def root_and_batch(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", required=True, help="storage root URL: a local path, s3://bucket/prefix, ...")
    parser.add_argument("--batch-id", required=True, help="the batch's id: [A-Za-z0-9][A-Za-z0-9._-]*, <= 128 chars")


def threshold_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a validation threshold of the batch config, e.g. max_poisoned_rate=0.3; repeatable",
    )


def key_json_pairs(pairs: Sequence[str], flag: str) -> dict:
    """``KEY=VALUE`` pairs as a mapping, each value parsed as JSON, else kept as a string."""
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
