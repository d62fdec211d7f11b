"""prompts_file: verl / TRL rows from Parquet, JSONL and JSON, seeded selection, sha256 pinning, row errors."""

from __future__ import annotations

import hashlib
import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.environments import load_environment
from tasks.environments.prompts_file import PromptsFile
from tasks.errors import PromptFileError

ROWS = [
    {
        "data_source": "toy_math",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + {i}?"}],
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
    }
    for i in range(10)
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(params=["parquet", "jsonl", "json"])
def prompt_file(request, tmp_path):
    path = tmp_path / f"prompts.{request.param}"
    if request.param == "parquet":
        return write_parquet(path, ROWS)
    if request.param == "jsonl":
        return write_jsonl(path, ROWS)
    path.write_text(json.dumps(ROWS))
    return path


def test_every_format_yields_the_same_tasks(prompt_file):
    env = PromptsFile(path=str(prompt_file))
    tasks = env.make_tasks(10, seed=0)
    assert sorted(task["row"] for task in tasks) == list(range(10))
    first = next(task for task in tasks if task["row"] == 3)
    assert first == {"row": 3, "prompt": ROWS[3]["prompt"], "ground_truth": "6", "data_source": "toy_math"}


def test_selection_is_a_seeded_permutation_whose_prefix_does_not_depend_on_num_tasks(prompt_file):
    env = PromptsFile(path=str(prompt_file))
    assert env.make_tasks(4, seed=5) == env.make_tasks(10, seed=5)[:4]
    assert env.make_tasks(10, seed=5) == PromptsFile(path=str(prompt_file)).make_tasks(10, seed=5)
    assert [t["row"] for t in env.make_tasks(10, seed=5)] != [t["row"] for t in env.make_tasks(10, seed=6)]


def test_asking_for_more_tasks_than_rows_is_refused(prompt_file):
    with pytest.raises(PromptFileError, match="has 10 rows, 11 tasks asked"):
        PromptsFile(path=str(prompt_file)).make_tasks(11, seed=0)


def test_fake_model_episode_is_scored_by_the_named_reward(play, prompt_file):
    env = PromptsFile(path=str(prompt_file), reward="last_number")
    task = env.make_tasks(1, seed=0)[0]
    messages, turn = play(env, task, lambda history: f"That makes {task['ground_truth']}.")
    assert messages[:-1] == task["prompt"]
    assert turn.reward == 1.0
    assert dict(turn.reward_info) == {
        "reward_fn": "last_number",
        "parsed": task["ground_truth"],
        "truth": task["ground_truth"],
        "row": task["row"],
        "data_source": "toy_math",
    }


def test_options_record_a_file_uri_reward_and_sha256_and_reload_identically(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    monkeypatch.chdir(tmp_path)
    env = load_environment("p.jsonl")
    assert env.options() == {
        "path": f"file://{path}",
        "reward": "exact_match",
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    assert load_environment("p.jsonl", env.options()).make_tasks(10, 1) == env.make_tasks(10, 1)


def test_a_changed_file_is_refused_when_its_sha256_is_pinned(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    pinned = PromptsFile(path=str(path)).options()
    write_jsonl(path, ROWS[:5])
    with pytest.raises(PromptFileError, match=f"changed: sha256 is .*, expected {pinned['sha256']}"):
        PromptsFile(**pinned)


def test_top_level_ground_truth_and_string_prompts_are_accepted(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Capital of France?", "ground_truth": "Paris"}])
    env = PromptsFile(path=str(path))
    task = env.make_tasks(1, seed=0)[0]
    assert env.initial_messages(task) == [{"role": "user", "content": "Capital of France?"}]
    assert task["data_source"] is None
    reply = [*env.initial_messages(task), {"role": "assistant", "content": "The answer is paris."}]
    assert env.step(task, reply).reward == 1.0


def test_numeric_ground_truth_is_read_as_text(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "1+1?", "reward_model": {"ground_truth": 2}}])
    assert PromptsFile(path=str(path)).make_tasks(1, 0)[0]["ground_truth"] == "2"


def test_any_fsspec_url_is_readable():
    with fsspec.open("memory://prompts/p.jsonl", "w") as handle:
        handle.write(json.dumps(ROWS[0]) + "\n")
    env = PromptsFile(path="memory://prompts/p.jsonl")
    assert env.options()["path"] == "memory://prompts/p.jsonl"
    assert env.make_tasks(1, 0)[0]["ground_truth"] == "0"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("just a string", "row 0: a row must be an object"),
        ({"ground_truth": "1"}, "row 0: 'prompt' must be a non-empty list"),
        ({"prompt": [], "ground_truth": "1"}, "row 0: 'prompt' must be a non-empty list"),
        ({"prompt": [{"role": "robot", "content": "x"}], "ground_truth": "1"}, "row 0 prompt: message 0 must be"),
        ({"prompt": [{"role": "user", "content": 3}], "ground_truth": "1"}, "row 0 prompt: message 0 .* no str"),
        ({"prompt": [{"role": "assistant", "content": "x"}], "ground_truth": "1"}, "must not end with an assistant"),
        ({"prompt": "q"}, r"row 0: no ground truth \(reward_model.ground_truth or ground_truth\)"),
        ({"prompt": "q", "reward_model": {"ground_truth": None}}, "row 0: no ground truth"),
        ({"prompt": "q", "ground_truth": ["a"]}, "row 0: ground truth must be a string or a number"),
        ({"prompt": "q", "ground_truth": True}, "row 0: ground truth must be a string or a number"),
        ({"prompt": "q", "ground_truth": "1", "reward_model": {"ground_truth": "2"}}, "'2' differs from ground_truth"),
        ({"prompt": "q", "ground_truth": "1", "data_source": 5}, "row 0: 'data_source' must be a string"),
        ({"prompt": "q", "ground_truth": " "}, "row 0: reward 'exact_match': ground truth ' ' is empty"),
    ],
)
def test_malformed_rows_are_refused_naming_the_row_and_field(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(PromptFileError, match=message):
        PromptsFile(path=str(path))


def test_ground_truth_the_reward_cannot_score_is_refused_at_load(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [ROWS[0], {"prompt": "q", "ground_truth": "Paris"}])
    with pytest.raises(PromptFileError, match="row 1: last_number: ground truth 'Paris' is not a number"):
        PromptsFile(path=str(path), reward="last_number")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("p.jsonl", '{"prompt": "q", "ground_truth": "1"}\n{not json\n', "line 2: invalid JSON"),
        ("p.json", '[{"prompt": "q",\n "ground_truth": }]', "line 2: invalid JSON"),
        ("p.json", '{"prompt": "q"}', "must hold a JSON array"),
        ("p.parquet", "not parquet", "cannot be read"),
        ("p.jsonl", b"\xff\xfe", "cannot be read"),
    ],
)
def test_unreadable_files_are_refused(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(PromptFileError, match=message):
        PromptsFile(path=str(path))


def test_missing_file_and_wrong_suffix_are_refused(tmp_path):
    with pytest.raises(PromptFileError, match="does not exist"):
        PromptsFile(path=str(tmp_path / "absent.jsonl"))
    with pytest.raises(PromptFileError, match="must be a string ending in one of"):
        PromptsFile(path=str(tmp_path / "prompts.csv"))
