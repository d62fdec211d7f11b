"""``prompts_file``: single-turn prompts read from a verl / TRL style data file, scored by a named reward.

Accepted files (any fsspec URL): ``.parquet`` (read with pyarrow), ``.jsonl`` (one JSON object
per non-blank line), ``.json`` (one JSON array of objects). Each row has:

* ``prompt``: a list of ``{"role", "content"}`` messages (verl / TRL conversational), or a
  string, which becomes one user message (TRL standard). It must not end with an assistant message.
* the ground truth: ``reward_model.ground_truth`` (verl), else a top-level ``ground_truth``;
  a string, int or float (numbers are written as strings). A row with both must agree.
* ``data_source`` (optional string), copied into the task and the reward info.

Other columns are ignored. Every row is checked when the file is loaded, including that the
reward function accepts its ground truth. ``make_tasks(n, seed)`` takes the first ``n`` rows of
a permutation of all rows seeded by ``seed``: task ``i`` does not depend on ``n``, and asking for
more tasks than rows is an error (no cycling). ``options()`` records the path, the reward and the
file's sha256; built with a ``sha256`` option, a file whose bytes changed is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tasks.environments.base import Environment, Message, Turn, check_messages
from tasks.environments.parsing import last_assistant_content
from tasks.environments.pinned_file import read_pinned, seeded_sample
from tasks.environments.rewards import reward_function
from tasks.errors import PromptFileError

SUFFIXES = (".parquet", ".jsonl", ".json")
DEFAULT_REWARD = "exact_match"


def is_prompt_file(spec: str) -> bool:
    """Whether ``spec`` names a prompt file (by its suffix)."""
    return spec.lower().endswith(SUFFIXES)


def _read_rows(path: str, data: bytes) -> list[Any]:
    lower = path.lower()
    if lower.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        return pq.read_table(pa.BufferReader(data)).to_pylist()
    text = data.decode("utf-8")
    if lower.endswith(".jsonl"):
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise PromptFileError(
                        f"{path} line {number}: invalid JSON: {error.msg} (column {error.colno})"
                    ) from None
        return rows
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as error:
        raise PromptFileError(f"{path} line {error.lineno}: invalid JSON: {error.msg} (column {error.colno})") from None
    if not isinstance(rows, list):
        raise PromptFileError(f"{path}: a .json prompt file must hold a JSON array of rows")
    return rows


def _truth_text(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise PromptFileError(f"{where}: ground truth must be a string or a number, got {value!r}")


def _task_of_row(row: object, index: int, path: str) -> dict[str, Any]:
    where = f"{path} row {index}"
    if not isinstance(row, Mapping):
        raise PromptFileError(f"{where}: a row must be an object, got {type(row).__name__}")
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise PromptFileError(f"{where}: 'prompt' must be a non-empty list of messages or a string")
    try:
        checked = check_messages(prompt, where=f"{where} prompt")
    except ValueError as error:
        raise PromptFileError(str(error)) from None
    messages = [{"role": message["role"], "content": message["content"]} for message in checked]
    if messages[-1]["role"] == "assistant":
        raise PromptFileError(f"{where}: 'prompt' must not end with an assistant message")
    reward_model = row.get("reward_model")
    nested = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
    top = row.get("ground_truth")
    if nested is None and top is None:
        raise PromptFileError(f"{where}: no ground truth (reward_model.ground_truth or ground_truth)")
    truth = _truth_text(nested if nested is not None else top, where)
    if nested is not None and top is not None and _truth_text(top, where) != truth:
        raise PromptFileError(f"{where}: reward_model.ground_truth {truth!r} differs from ground_truth {top!r}")
    source = row.get("data_source")
    if source is not None and not isinstance(source, str):
        raise PromptFileError(f"{where}: 'data_source' must be a string, got {source!r}")
    return {"row": index, "prompt": messages, "ground_truth": truth, "data_source": source}


class PromptsFile(Environment):
    """Options: ``path`` (required), ``reward`` (a name in ``rewards.REWARD_FUNCTIONS``), ``sha256`` (optional pin)."""

    name: ClassVar[str] = "prompts_file"

    def __init__(self, *, path: str, reward: str = DEFAULT_REWARD, sha256: str | None = None) -> None:
        super().__init__()
        if not isinstance(path, str) or not is_prompt_file(path):
            raise PromptFileError(f"prompt file path must be a string ending in one of {SUFFIXES}, got {path!r}")
        self._score = reward_function(reward)
        pinned = read_pinned(path, sha256, what="prompt file")
        self.path, self.reward, self.sha256 = pinned.uri, reward, pinned.sha256
        try:
            rows = _read_rows(self.path, pinned.data)
        except PromptFileError:
            raise
        except (ValueError, OSError) as error:  # JSON / UTF-8 / Arrow errors are ValueErrors or OSErrors
            raise PromptFileError(f"prompt file {self.path} cannot be read: {error}") from error
        self._tasks = [_task_of_row(row, index, self.path) for index, row in enumerate(rows)]
        for task in self._tasks:
            try:
                self._score("", task["ground_truth"])
            except ValueError as error:
                raise PromptFileError(f"{self.path} row {task['row']}: {error}") from None

    def options(self) -> dict[str, Any]:
        return {"path": self.path, "reward": self.reward, "sha256": self.sha256}

    def make_tasks(self, num_tasks: int, seed: int) -> list[dict[str, Any]]:
        return seeded_sample(self._tasks, num_tasks, seed, env=self.name, what=f"prompt file {self.path}")

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        return check_messages(task["prompt"], where=f"{self.path} row {task['row']} prompt")

    def step(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        score = self._score(last_assistant_content(messages, env=self.name), task["ground_truth"])
        return Turn.finish(
            score.reward,
            reward_fn=self.reward,
            parsed=score.parsed,
            truth=task["ground_truth"],
            row=task["row"],
            data_source=task["data_source"],
        )
