"""Flag pieces several commands share: how a command is added, the batch it names, shards, ``KEY=JSON`` pairs."""

from __future__ import annotations

import argparse
import difflib
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


def unknown_flags(parser: argparse.ArgumentParser, args: Sequence[str]) -> list[str]:
    """The arguments of ``args`` that read as flags ``parser`` does not have (``--flag=value``: the flag part).

    What reads as a flag is argparse's rule: a dash and more, not a negative number, no space; ``--``
    ends the flags.
    """
    found = []
    for arg in args:
        if arg == "--":
            break
        if len(arg) < 2 or arg[0] not in parser.prefix_chars or " " in arg:
            continue
        if parser._negative_number_matcher.match(arg) and not parser._has_negative_number_optionals:
            continue
        flag = arg.partition("=")[0] if arg.startswith("--") else arg
        if flag not in parser._option_string_actions:
            found.append(flag)
    return found


def closest_flag(parser: argparse.ArgumentParser, given: str) -> str | None:
    """The flag of ``parser`` meant by ``given``: the same with dashes for underscores (``--max_tokens``), a
    batch field's flag by its field name (``--environment_options``: ``--env-option``), else the closest
    spelling (difflib) among the parser's flags."""
    spelled: dict[str, str] = {}  # what a person might type -> the flag
    for action in parser._actions:
        longest = max(action.option_strings, key=len, default=None)
        if longest is None or action.help == argparse.SUPPRESS:
            continue
        for option in action.option_strings:
            spelled.setdefault(option, option)
        spelled.setdefault("--" + action.dest.replace("_", "-"), longest)
    normalized = given.lower().replace("_", "-")
    if normalized in spelled:
        return spelled[normalized]
    names = {s.lstrip("-"): s for s in spelled if s.startswith("--")}  # compared without the dashes all share
    match = difflib.get_close_matches(normalized.lstrip("-"), names, n=1, cutoff=0.6)
    return spelled[names[match[0]]] if match else None


def unknown_flags_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """``unrecognized argument: --max_tokens (did you mean --max-tokens?); ...``: each unknown flag with the
    closest flag of ``parser``, or where it goes (``-v`` before the command's name)."""
    before = getattr(parser, "before_command", ())
    named = []
    for extra in extras:
        flag = extra.partition("=")[0] if extra.startswith("--") else extra
        if flag in before:
            prog, _, command = parser.prog.rpartition(" ")
            named.append(f"{flag} (it goes before the command: {prog} {flag} {command} ...)")
        elif flag.startswith(tuple(parser.prefix_chars)) and (meant := closest_flag(parser, flag)) is not None:
            named.append(f"{flag} (did you mean {meant}?)")
        else:
            named.append(extra)
    noun = "argument" if len(named) == 1 else "arguments"
    return f"unrecognized {noun}: {', '.join(named)}; '{parser.prog} --help' lists its flags"
