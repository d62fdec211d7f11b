"""Every command block of README.md and docs/ runs as written, or its flags are checked against the real parser.

A command block is a fenced block labelled ``bash``; a block of commands left unlabelled is an
error (label it, so this test finds it). Each command (a line with its backslash continuations)
is checked by its program:

* ``rollout-ledger`` (bare or ``.venv/bin/``): parsed by the CLI's own parser (unknown flags,
  abbreviations, missing required flags and bad values all fail it);
* ``make``: a target of the Makefile;
* ``airflow``: parsed by Airflow's own CLI parser, in a process of a local Airflow home;
* ``python`` scripts and modules: they exist, answer ``--help``, and name every flag given;
* the programs of :data:`NOT_CHECKED` (no container engine or deployment here) are listed, not run.

The README's command-line batch is also run as written, in order, for as long as no engine is
needed (plan and status; generate starts one, minutes on 2 cores), with a root and batch id of
this test's own.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.M | re.S)
CLI = ("rollout-ledger", ".venv/bin/rollout-ledger")
PYTHON = ("python", ".venv/bin/python", "python3")
NOT_CHECKED = ("docker", "curl", "kubectl", "jq", "export", "for", "done", "helm")
PROGRAMS = (*CLI, *PYTHON, "make", "airflow", *NOT_CHECKED)


@dataclass(frozen=True)
class Command:
    page: str
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}: {shlex.join(self.argv)}"


def commands() -> list[Command]:
    """Every command of every ``bash`` block, in page order (environment assignments before it dropped)."""
    found = []
    for page in PAGES:
        for block in BLOCK.finditer(page.read_text()):
            if block.group("lang") != "bash":
                continue
            pending = ""
            for line in block.group("body").replace("\\\n", " ").splitlines():
                pending += line + "\n"
                try:
                    argv = shlex.split(pending, comments=True)
                except ValueError:  # a quotation that goes on to the next line
                    continue
                pending = ""
                while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
                    argv = argv[1:]
                if argv and argv[-1] == "&":  # started in the background
                    argv = argv[:-1]
                if argv:
                    found.append(Command(page.name, tuple(argv)))
            assert not pending, f"{page.name}: a command block ends inside a quotation: {pending!r}"
    return found


def test_every_command_block_is_labelled_and_names_a_known_program():
    unlabelled = []
    for page in PAGES:
        for block in BLOCK.finditer(page.read_text()):
            first = (block.group("body").split() or [""])[0]
            if not block.group("lang") and first in PROGRAMS:
                unlabelled.append(f"{page.name}: {block.group('body').splitlines()[0]}")
    assert not unlabelled, f"label these command blocks bash: {unlabelled}"
    unknown = [str(c) for c in commands() if c.argv[0] not in PROGRAMS and not c.argv[0].startswith("$")]
    assert not unknown, f"commands of a program this test does not check: {unknown}"


@pytest.mark.parametrize("command", [c for c in commands() if c.argv[0] in CLI], ids=str)
def test_every_rollout_ledger_command_parses(command):
    try:
        build_parser().parse_args(list(command.argv[1:]))
    except SystemExit as exit_:
        pytest.fail(f"{command} does not parse (exit {exit_.code})")


def test_every_make_target_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = {(str(c), c.argv[1]) for c in commands() if c.argv[0] == "make"}
    assert named and not [shown for shown, target in named if target not in targets]


def test_every_python_script_answers_help_and_takes_its_flags():
    for command in (c for c in commands() if c.argv[0] in PYTHON):
        script = command.argv[1:2] if command.argv[1] != "-m" else command.argv[1:3]
        shown = subprocess.run(
            [sys.executable, *script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
        )
        assert shown.returncode == 0, f"{command}: {shown.stderr[-2000:]}"
        flags = [arg.split("=")[0] for arg in command.argv[len(script) + 1 :] if arg.startswith("--")]
        assert all(flag in shown.stdout for flag in flags), f"{command}: {flags} not all in its --help"


def test_every_airflow_command_parses_with_airflows_own_parser(tmp_path):
    from tasks.orchestration import local_airflow

    argvs = [list(c.argv[1:]) for c in commands() if c.argv[0] == "airflow"]
    check = (
        "import json, sys\n"
        "from airflow.cli.cli_parser import get_parser\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    get_parser().parse_args(argv)\n"
    )
    env = {**os.environ, **local_airflow.airflow_environment(tmp_path / "airflow")}
    parsed = subprocess.run(
        [sys.executable, "-c", check, json.dumps(argvs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert argvs and parsed.returncode == 0, parsed.stderr[-3000:]


def test_the_readmes_command_line_batch_runs_as_written_until_it_needs_an_engine(tmp_path):
    """plan, then status, of the README's block, with this test's root and batch id; what follows needs an engine."""
    from tests.test_cli import run_cli

    readme = [c for c in commands() if c.page == "README.md" and c.argv[0] in CLI]
    assert [c.argv[1] for c in readme][:2] == ["plan", "generate"]
    root, batch_id = str(tmp_path / "runs"), "docs-readme"
    for command in (c for c in readme if c.argv[1] in ("plan", "status")):
        argv = list(command.argv[1:])
        argv[argv.index("--root") + 1], argv[argv.index("--batch-id") + 1] = root, batch_id
        done = run_cli(*argv)
        assert done.returncode == 0, f"{command}:\n{done.stderr[-3000:]}"
    assert f"batch {batch_id}" in done.stdout and "plan:" in done.stdout  # status of the planned batch
