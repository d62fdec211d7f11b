"""The ``rollout-ledger`` parser and dispatch: each command's module adds its parser and sets ``run``.

The sub-commands appear in :data:`COMMANDS`' order (``--help`` lists them so); :func:`main` runs
the one named and turns an error into its exit code and one line (:mod:`tasks.entry_point`).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from tasks.cli.batches import add_demo, add_status, add_sweep
from tasks.cli.dataset import add_finalize, add_publish, add_validate
from tasks.cli.flags import AddCommand, unknown_flags, unknown_flags_message
from tasks.cli.generate import add_generate
from tasks.cli.lineage_cmd import add_lineage
from tasks.cli.plan import add_plan
from tasks.cli.servers import add_refit, add_serve
from tasks.cli.train import add_checkpoint_zero, add_train
from tasks.entry_point import configure_logging, run_command
from tasks.errors import EXIT_USAGE

COMMANDS: tuple[Callable[[AddCommand], None], ...] = (
    add_plan,
    add_generate,
    add_finalize,
    add_validate,
    add_publish,
    add_status,
    add_lineage,
    add_sweep,
    add_serve,
    add_refit,
    add_checkpoint_zero,
    add_train,
    add_demo,
)


class _Parser(argparse.ArgumentParser):
    """Exits 2 on a usage error with its own usage line; never takes an abbreviation of a flag; an unknown flag
    is named with the closest flag of this (sub-)command (:func:`tasks.cli.flags.unknown_flags_message`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False  # --num-task is not --num-tasks: a prefix is an unknown flag
        super().__init__(*args, **kwargs)
        self.before_command: tuple[str, ...] = ()  # the main parser's flags, which go before a command's name

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        args = sys.argv[1:] if args is None else list(args)
        # Unknown flags are named first (before a missing required flag): a command's own, or those before it.
        own = args if self._subparsers is None else list(itertools.takewhile(lambda a: a.startswith("-"), args))
        self._refuse_unknown(unknown_flags(self, own))
        namespace, extras = super().parse_known_args(args, namespace)
        self._refuse_unknown(extras)
        return namespace, extras

    def _refuse_unknown(self, extras: Sequence[str]) -> None:
        if extras:
            self.error(unknown_flags_message(self, extras))

    def error(self, message: str) -> NoReturn:  # argparse exits 2 on usage errors already; keep the message short
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each valued flag's default, except where there is none to show (switches, required flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default is None or action.default == [] or action.required:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rollout-ledger",
        description="Token-exact rollout capture and GRPO dataset finalization.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging; show the engine's own log lines")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)
        parser.before_command = ("-v", "--verbose")
        return parser

    for add in COMMANDS:
        add(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(verbose=args.verbose)
    return run_command(args.command, getattr(args, "root", None), lambda: args.run(args), verbose=args.verbose)
