"""Agents: environments whose episode is the user's own agent, calling the model over HTTP (docs/agents.md).

An :class:`Agent` makes its tasks from a task file (JSONL, one JSON object per line, pinned by
sha256 like a prompt file) and runs each rollout's episode itself: :meth:`Agent.run` gets the
rollout's :class:`AgentDoor` (the base URL of its OpenAI-compatible route on the capture gateway
and the bearer key of that route) and the task, and returns an :class:`AgentResult`. Whatever
goes wrong is an :class:`AgentFailure` whose reason is one of :data:`AGENT_FAILURES`; it fails
that rollout only.

* ``agent_command`` runs ``command`` (an argv list, any language) once per rollout with
  ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``ROLLOUT_LEDGER_TASK`` (the task as JSON) in an
  allow-listed environment, under limits (:mod:`tasks.environments.agent_process`). The reward
  is the JSON object on the last line of its stdout (``{"reward": 1.0, ...}``), or what
  ``scorer`` (``module:function``, ``(task, stdout) -> reward``) makes of its stdout. An
  ``agent_callable`` runs inside the worker's process: it is trusted code (docs/security.md).
* ``agent_callable`` awaits ``function`` (``module:function``, ``async (client, task) -> reward``)
  with an ``openai.AsyncOpenAI`` client pointed at the rollout's route.

A reward is a number or an object ``{"reward": number, ...}``; the object may also name the
scored response (``response_id``, the ``id`` of a chat completion) or its text (``final_output``),
witnesses of which call was scored. The other keys are kept as the rollout's reward info.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import inspect
import json
import math
import os
import ssl
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tasks.environments.agent_process import (
    LAUNCH_FAILED,
    AgentLimits,
    AgentWatchdog,
    FreshHome,
    OutputPipes,
    agent_environment,
    fresh_home,
    kill_group,
    launcher_argv,
)
from tasks.environments.agent_sandbox import (
    BWRAP_PREFIX,
    ISOLATION_PROCESS,
    ISOLATION_SANDBOX,
    SANDBOX_HOME,
    SANDBOX_TMP,
    Sandbox,
    binds_of,
    check_isolation,
    check_sandbox,
    resolve_executable,
)
from tasks.environments.imports import ImportPathError, import_object
from tasks.environments.pinned_file import read_pinned, seeded_sample
from tasks.errors import AgentCommandError, TaskFileError

AGENT_EXIT = "agent_exit"  # the command exited non-zero
AGENT_TIMEOUT = "agent_timeout"  # the episode outlasted timeout_s
AGENT_ERROR = "agent_error"  # the callable raised, or the command could not start
AGENT_NO_REWARD = "agent_no_reward"  # no reward, or one that is not a finite number
SCORER_ERROR = "scorer_error"  # the scorer raised
AGENT_OUTPUT_LIMIT = "agent_output_limit"  # the command wrote more than limits.output_bytes to stdout or stderr
AGENT_FAILURES = (AGENT_EXIT, AGENT_TIMEOUT, AGENT_ERROR, AGENT_NO_REWARD, SCORER_ERROR, AGENT_OUTPUT_LIMIT)
WITNESS_KEYS = ("response_id", "final_output")
DEFAULT_TIMEOUT_S = 600.0
MAX_SHOWN_OUTPUT = 2000  # characters of an agent's stderr or stdout a failure keeps
BASE_URL_VARIABLE, API_KEY_VARIABLE, TASK_VARIABLE = "OPENAI_BASE_URL", "OPENAI_API_KEY", "ROLLOUT_LEDGER_TASK"
LAUNCH_EXIT = 127
OUTPUTS = ("stdout", "stderr")
OUTPUT_GRACE_S = 10.0  # how long the output may stay open after the agent exited and its group was killed
MIN_REDACTED_CHARS = 8  # a passed variable's value this long or longer is kept out of failure messages
PYTHON_PLACEHOLDER = "{python}"  # in a command: the interpreter that runs generate


@dataclass(frozen=True)
class AgentDoor:
    """Where a rollout's agent calls the model: the route's OpenAI base URL (ends in ``/v1``) and its key."""

    base_url: str
    api_key: str


@dataclass(frozen=True)
class AgentResult:
    """What an episode scored: the reward, the other keys the agent reported, and its witnesses of the scored call."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    response_id: str | None = None
    final_output: str | None = None


class AgentFailure(Exception):
    """An episode that gave no reward; ``reason`` is one of :data:`AGENT_FAILURES`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def result_of(value: object, *, source: str) -> AgentResult:
    """A reported reward (a number, or an object with a numeric ``reward``) as a result; else ``agent_no_reward``."""
    report = dict(value) if isinstance(value, Mapping) else {"reward": value}
    reward = report.pop("reward", None)
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise AgentFailure(AGENT_NO_REWARD, f"{source} gave no finite numeric reward: {_shown(value)}")
    witnesses = {key: report.pop(key, None) for key in WITNESS_KEYS}
    for key, witness in witnesses.items():
        if witness is not None and (not isinstance(witness, str) or not witness):
            raise AgentFailure(AGENT_NO_REWARD, f"{source} reported {key} {_shown(witness)}: not a non-empty string")
    return AgentResult(float(reward), report, **witnesses)


def _shown(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= MAX_SHOWN_OUTPUT else f"...{text[-MAX_SHOWN_OUTPUT:]}"


def _positive(value: object, name: str, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value


def _callable_at(spec: object, name: str) -> Callable[..., Any]:
    if not isinstance(spec, str):
        raise ValueError(f"{name} must be an import path 'package.module:function', got {spec!r}")
    try:
        found = import_object(spec)
    except ImportPathError as error:
        raise ValueError(f"{name} {spec!r}: {error} [{error.reason}]") from None
    if not callable(found):
        raise ValueError(f"{name} {spec!r} is {found!r}, not a function")
    return found


class Agent(abc.ABC):
    """An agent environment: tasks from a pinned task file, one :meth:`run` per rollout.

    Options shared by every agent: ``tasks`` (path or URL of the task file), ``sha256`` (its pin,
    filled in at planning), ``timeout_s`` (one episode's limit) and ``max_concurrency`` (episodes
    at once in a generate attempt; None: the batch's ``max_in_flight``).
    """

    name: ClassVar[str] = "agent"

    def __init__(
        self,
        *,
        tasks: str,
        sha256: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_concurrency: int | None = None,
    ) -> None:
        if not isinstance(tasks, str) or not tasks:
            raise ValueError(f"tasks must be the path or URL of a JSONL task file, got {tasks!r}")
        self.timeout_s = float(_positive(timeout_s, "timeout_s"))
        if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)):
            raise ValueError(f"max_concurrency must be a positive integer, got {max_concurrency!r}")
        self.max_concurrency = _positive(max_concurrency, "max_concurrency", optional=True)
        pinned = read_pinned(tasks, sha256, what="task file", error=TaskFileError)
        self.tasks_path, self.sha256 = pinned.uri, pinned.sha256
        self._tasks = _task_rows(pinned.data, pinned.uri)

    def options(self) -> dict[str, Any]:
        """The options as recorded in the batch config (the task file as a URI with its sha256)."""
        return {
            "tasks": self.tasks_path,
            "sha256": self.sha256,
            "timeout_s": self.timeout_s,
            "max_concurrency": self.max_concurrency,
        }

    def make_tasks(self, num_tasks: int, seed: int) -> list[dict[str, Any]]:
        """The first ``num_tasks`` tasks of the file's permutation seeded by ``seed``."""
        return seeded_sample(
            self._tasks, num_tasks, seed, env=self.name, what=f"task file {self.tasks_path}", error=TaskFileError
        )

    async def run(self, door: AgentDoor, task: Mapping[str, Any]) -> AgentResult:
        """One episode within ``timeout_s``; every way it can fail is an :class:`AgentFailure`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.episode(door, task)
        except TimeoutError:
            raise AgentFailure(AGENT_TIMEOUT, f"the agent did not finish within timeout_s={self.timeout_s:g}") from None

    def check_can_run(self) -> None:
        """Before an engine starts: raise naming what keeps the agent from running here (nothing, by default)."""
        return None

    def close(self) -> None:
        """The attempt is over: end whatever the agent still runs (nothing, unless it starts processes)."""
        return None

    @abc.abstractmethod
    async def episode(self, door: AgentDoor, task: Mapping[str, Any]) -> AgentResult:
        """Run the agent on ``task`` against ``door``; cancelled when the time-out expires."""


def _task_rows(data: bytes, uri: str) -> list[dict[str, Any]]:
    rows = []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TaskFileError(f"task file {uri} is not UTF-8: {error}") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise TaskFileError(f"task file {uri} line {number}: invalid JSON: {error.msg}") from None
        if not isinstance(row, dict):
            raise TaskFileError(f"task file {uri} line {number}: a task must be a JSON object, got {_shown(row)}")
        rows.append(row)
    if not rows:
        raise TaskFileError(f"task file {uri} holds no tasks")
    return rows


class AgentCommand(Agent):
    """Options: ``command`` (argv list; ``{python}`` in it is the worker's interpreter), ``scorer`` (optional
    ``module:function``), ``env`` (names of worker variables the agent receives), ``limits``
    (:class:`~tasks.environments.agent_process.AgentLimits`), ``isolation`` (``sandbox``, the default, or
    ``process``), ``binds`` (what the sandbox shows besides the system, the worker's Python and the files the
    command names: :class:`~tasks.environments.agent_sandbox.Bind`), and :class:`Agent`'s. The process runs as
    :mod:`tasks.environments.agent_process` says (allow-listed variables, a fresh home, rlimits, bounded
    output, it dies with its episode and its worker), inside the OS sandbox of
    :mod:`tasks.environments.agent_sandbox` unless ``isolation`` is ``process``."""

    name: ClassVar[str] = "agent_command"

    def __init__(
        self,
        *,
        command: list[str],
        scorer: str | None = None,
        env: list[str] | None = None,
        limits: Mapping[str, Any] | None = None,
        isolation: str = ISOLATION_SANDBOX,
        binds: list[Any] | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
            raise ValueError(f"command must be a non-empty list of non-empty strings (an argv), got {command!r}")
        if env is not None and (not isinstance(env, list) or not all(isinstance(n, str) and n for n in env)):
            raise ValueError(f"env must be a list of variable names, got {env!r}")
        self.command, self.scorer, self.env = list(command), scorer, list(env or [])
        self.limits = AgentLimits.of(limits)
        self.isolation = check_isolation(isolation)
        self.sandbox = Sandbox(binds_of(binds))
        if self.isolation == ISOLATION_PROCESS and self.sandbox.binds:
            raise ValueError(
                "binds: an agent with isolation 'process' sees the whole file system; binds are for 'sandbox'"
            )
        self._score = _callable_at(scorer, "scorer") if scorer is not None else None
        self._watchdog = AgentWatchdog()
        super().__init__(**options)

    def options(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "scorer": self.scorer,
            "env": self.env,
            "limits": self.limits.as_options(),
            "isolation": self.isolation,
            "binds": [bind.as_option() for bind in self.sandbox.binds],
            **super().options(),
        }

    @property
    def argv(self) -> list[str]:
        """The command as it runs here: ``{python}`` is this process's interpreter."""
        return [arg.replace(PYTHON_PLACEHOLDER, sys.executable) for arg in self.command]

    def check_can_run(self) -> None:
        """Before an engine starts: the command's executable resolves here, and the agent's sandbox starts on this
        host (unless ``isolation: process``); an :class:`AgentCommandError` or
        :class:`~tasks.errors.SandboxUnavailableError` names what is wrong and what to do."""
        path = os.environ.get("PATH")
        if resolve_executable(self.argv[0], path, os.getcwd()) is None:
            raise AgentCommandError(
                f"agent command {self.command!r}: its executable {self.argv[0]!r} is not found (PATH={path!r}); give "
                f"its absolute path, or {PYTHON_PLACEHOLDER!r} for the interpreter that runs generate"
            )
        if self.isolation == ISOLATION_SANDBOX:
            check_sandbox()

    def close(self) -> None:
        """Kill whatever agents are still running and end the watchdog (the attempt is over)."""
        self._watchdog.close()

    async def episode(self, door: AgentDoor, task: Mapping[str, Any]) -> AgentResult:
        rollout = {BASE_URL_VARIABLE: door.base_url, API_KEY_VARIABLE: door.api_key, TASK_VARIABLE: json.dumps(task)}
        passed = [os.environ[n] for n in self.env if len(os.environ.get(n, "")) >= MIN_REDACTED_CHARS]
        secrets = [door.api_key, *passed]  # the route's key is worthless after the attempt; still, never kept
        sandboxed = self.isolation == ISOLATION_SANDBOX
        with fresh_home((SANDBOX_HOME, SANDBOX_TMP) if sandboxed else None) as home:
            returncode, out, err = await self._run(home, agent_environment(rollout, self.env, home))
        stdout, stderr = (_redacted(s.decode("utf-8", "replace"), secrets) for s in (out, err))
        launch_failed = returncode == LAUNCH_EXIT and stderr.startswith(LAUNCH_FAILED)
        if launch_failed or (sandboxed and _sandbox_refused(stderr)):
            raise AgentFailure(AGENT_ERROR, f"command {self.command!r} could not start: {_shown(stderr.strip())}")
        if returncode != 0:
            raise AgentFailure(AGENT_EXIT, f"the command exited with {returncode}: {_shown(stderr.strip())}")
        if self._score is not None:
            try:
                return result_of(self._score(dict(task), stdout), source=f"scorer {self.scorer}")
            except AgentFailure:
                raise
            except Exception as error:
                detail = f"scorer {self.scorer} raised {_redacted(repr(error), secrets)}"
                raise AgentFailure(SCORER_ERROR, detail) from None
        lines = stdout.strip().splitlines()
        try:
            report = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            report = None
        if not isinstance(report, dict):
            last = lines[-1] if lines else "(no output)"
            raise AgentFailure(AGENT_NO_REWARD, f"the last line of stdout is not a JSON object: {_shown(last)}")
        return result_of(report, source="the command's last stdout line")

    def _launched(self, home: FreshHome, environ: Mapping[str, str]) -> list[str]:
        """What the launcher execs: the command, or ``bwrap`` running it in the agent's sandbox."""
        if self.isolation == ISOLATION_PROCESS:
            return self.argv
        return self.sandbox.argv(self.argv, home=home.home, tmp=home.tmp, cwd=os.getcwd(), path=environ.get("PATH"))

    async def _run(self, home: FreshHome, environ: dict[str, str]) -> tuple[int, bytes, bytes]:
        """Run the command to its end (its whole process group killed then, or on any way out of here)."""
        async with OutputPipes() as pipes:
            try:
                process = await asyncio.create_subprocess_exec(
                    *launcher_argv(self._launched(home, environ), self.limits),
                    env=environ,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=pipes.writers[0],
                    stderr=pipes.writers[1],
                    start_new_session=True,  # its own process group: the agent's children end with it
                )
            finally:
                pipes.child_started()
            self._watchdog.watch(process.pid)
            bound = self.limits.output_bytes
            outputs = zip(pipes.readers, OUTPUTS, strict=True)
            reading = asyncio.gather(*(_read_bounded(reader, bound, name) for reader, name in outputs))
            try:
                exited = asyncio.ensure_future(process.wait())
                await asyncio.wait({reading, exited}, return_when=asyncio.FIRST_COMPLETED)
                if reading.done():
                    reading.result()  # past the output bound: fail now
                returncode = await exited
                kill_group(process.pid)  # what it left running holds the pipes open: the output ends with the agent
                try:
                    out, err = await asyncio.wait_for(reading, OUTPUT_GRACE_S)
                except TimeoutError:
                    detail = f"a process that left the agent's group kept its output open {OUTPUT_GRACE_S:g} s after it"
                    raise AgentFailure(AGENT_ERROR, detail) from None
                return returncode, out, err
            finally:
                reading.cancel()
                kill_group(process.pid)
                await asyncio.shield(process.wait())  # the pipes are ours: this waits for the exit only
                self._watchdog.release(process.pid)


async def _read_bounded(stream: asyncio.StreamReader, cap: int, name: str) -> bytes:
    """Everything ``stream`` gives until EOF, or ``agent_output_limit`` past ``cap`` bytes (nothing more kept)."""
    data = bytearray()
    while chunk := await stream.read(64 * 1024):
        if len(data) + len(chunk) > cap:
            raise AgentFailure(AGENT_OUTPUT_LIMIT, f"the command wrote more than {cap} bytes to {name}")
        data += chunk
    return bytes(data)


def _sandbox_refused(stderr: str) -> bool:
    """Whether ``bwrap`` itself failed: it could not set the sandbox up or exec the command (its own message)."""
    return stderr.startswith(BWRAP_PREFIX)


def _redacted(text: str, secrets: list[str]) -> str:
    """``text`` with each passed variable's value replaced (an agent printing a secret keeps it out of records)."""
    for secret in secrets:
        text = text.replace(secret, "[redacted]")
    return text


class AgentCallable(Agent):
    """Options: ``function`` (``module:function``, ``async (client, task) -> reward``), and :class:`Agent`'s."""

    name: ClassVar[str] = "agent_callable"

    def __init__(self, *, function: str, **options: Any) -> None:
        self.function = function
        self._function = _callable_at(function, "function")
        if not inspect.iscoroutinefunction(self._function):
            raise ValueError(f"function {function!r} must be an async function (client, task) -> reward")
        super().__init__(**options)

    def options(self) -> dict[str, Any]:
        return {"function": self.function, **super().options()}

    @functools.cached_property
    def _tls(self) -> ssl.SSLContext:
        """One TLS context for every episode's client: building one loads the CA bundle (about 50 ms, on the
        loop that serves the gateway), although the gateway is plain HTTP."""
        return ssl.create_default_context()

    async def episode(self, door: AgentDoor, task: Mapping[str, Any]) -> AgentResult:
        import openai

        http = openai.DefaultAsyncHttpxClient(verify=self._tls)  # closed with the client
        async with openai.AsyncOpenAI(base_url=door.base_url, api_key=door.api_key, http_client=http) as client:
            try:
                value = await self._function(client, dict(task))
            except (asyncio.CancelledError, AgentFailure):
                raise
            except Exception as error:
                raise AgentFailure(AGENT_ERROR, f"{self.function} raised {error!r}") from None
        return result_of(value, source=self.function)
