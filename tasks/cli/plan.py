"""``rollout-ledger plan``: a flag for every recorded batch field, derived from :mod:`tasks.batch_fields`."""

from __future__ import annotations

import argparse
import json
import os
import typing
from typing import TYPE_CHECKING, Any

from tasks.batch_fields import OPTIONS_OF, BatchFields, check_values, config_paths, field_default, plan_flag
from tasks.cli.context import lineage_sink, open_new_batch, say, say_lineage
from tasks.cli.flags import AddCommand, key_json_pairs, root_and_batch
from tasks.engines.registry import engine_names
from tasks.errors import EXIT_OK

if TYPE_CHECKING:
    from tasks.batch import Batch


def add_plan(add: AddCommand) -> None:
    parser = add("plan", "expand a batch into rollouts and shards; write plan/batch.json")
    root_and_batch(parser)
    _batch_field_flags(parser)
    parser.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from tasks.lineage.datasets import plan_lineage
    from tasks.plan import plan_from_values

    values = {"batch_id": args.batch_id, **plan_values(args)}
    check_values(values, source="plan flags")  # a bad flag is named before storage is touched
    (batch, new_root), lineage = open_new_batch(args), lineage_sink()
    with lineage.task("plan", batch) as run:
        summary = plan_from_values(batch, values, source="plan flags")
        run.report(lambda: plan_lineage(batch))
    if new_root:
        say(f"rollout-ledger plan: created a new storage root {_shown_root(batch)} (it did not exist)")
    say_lineage(lineage)
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


def _shown_root(batch: Batch) -> str:
    root = batch.root_store
    return os.path.abspath(root.root) if root.is_local else root.url


def plan_values(args: argparse.Namespace) -> dict[str, Any]:
    """The batch fields the plan flags give (options as JSON objects); fields not given take their defaults."""
    values = {}
    for name in config_paths():
        value = getattr(args, name)
        if name in OPTIONS_OF.values():
            value = None if value is None else key_json_pairs(value, plan_flag(name).name or name)
        if value is not None:
            values[name] = value
    return values


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
            kind = engine_names() if name == "engine" else _flag_type(info.annotation)  # the registry's engines
            kwargs |= {"choices": kind} if isinstance(kind, tuple) else {"type": kind}
            kwargs |= {"required": True} if flag.required else {"default": field_default(name)}
        parser.add_argument(flag.name, **kwargs)


def _flag_type(annotation: Any) -> type | tuple[str, ...]:
    """What argparse converts a flag's text to: ``int``, ``float``, ``str``, or the choices of a ``Literal``."""
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return kinds[0] if kinds[0] in (int, float) else str
