"""The ``rollout-ledger`` parser and dispatch: each command's module adds its parser and sets ``run``.

The sub-commands appear in :data:`COMMANDS`' order (``--help`` lists them so); :func:`main` runs
the one named and turns an error into its exit code and one line (:mod:`tasks.entry_point`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tasks.cli.batches import add_demo, add_status, add_sweep
from tasks.cli.dataset import add_finalize, add_publish, add_validate
from tasks.cli.flags import AddCommand
from tasks.cli.generate import add_generate
from tasks.cli.plan import add_plan
from tasks.cli.servers import add_refit, add_serve
from tasks.entry_point import configure_logging, run_command
from tasks.errors import EXIT_USAGE

COMMANDS: tuple[Callable[[AddCommand], None], ...] = (
    add_plan,
    add_generate,
    add_finalize,
    add_validate,
    add_publish,
    add_status,
    add_sweep,
    add_serve,
    add_refit,
    add_demo,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 on usage errors already; keep the message short
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
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)

    for add in COMMANDS:
        add(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(verbose=args.verbose)
    return run_command(args.command, getattr(args, "root", None), lambda: args.run(args), verbose=args.verbose)
