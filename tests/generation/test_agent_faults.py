"""An agent attempt under faults: late calls, client retries, refused templates, failing tokenizers, no tool parser.

Real gateway, storage, ledger, finalize and official ``openai`` clients (``fault_agents.py``) over
a FAKE engine (``arithmetic_engine``: scripted answers, the real tokenizer), slowed down on the
requests the agents ask "slowly". Each test checks what the ledger holds against what the client
saw: every call is in its rollout's receipt, no row comes after a receipt, a retry is never a
second call, and every failure is a named failure row.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import threading

import pytest

from tasks.finalize.stage import FinalizeOptions, finalize_batch
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.ledger_writer import LedgerWriter
from tests.generation import fault_agents  # as the agents are loaded: by import path

from .fakes import DelegatingEngine
from .test_agent_rollouts import arithmetic_engine, run_agents
from .test_server_batches_e2e import dataset_rows

AGENTS = "tests.generation.fault_agents"
SLOW_SECONDS = 3.0  # longer than the late-call agent's client tries, with their backoff, take


class SlowWhenAsked(DelegatingEngine):
    """The arithmetic engine, taking :data:`SLOW_SECONDS` over a prompt that asks to answer slowly."""

    async def generate(self, request):
        if fault_agents.SLOW in self.inner.tokenizer.decode(list(request.prompt_token_ids)):
            fault_agents.ADMITTED.append(request.request_id)
            await asyncio.sleep(SLOW_SECONDS)
        return await self.inner.generate(request)


def ledger_order(monkeypatch) -> list[tuple[str, str]]:
    """(kind, rollout id) of every ledger row from now on, in the order they are handed to the ledger writer."""
    order: list[tuple[str, str]] = []
    for kind, method in (("call", "add_call"), ("failure", "add_failure"), ("receipt", "add_receipt")):
        original = getattr(LedgerWriter, method)

        def add(self, row, *, _kind=kind, _original=original):
            order.append((_kind, row.rollout_id))
            return _original(self, row)

        monkeypatch.setattr(LedgerWriter, method, add)
    fault_agents.SEEN.clear()
    fault_agents.ADMITTED.clear()  # request ids repeat across batches: a test reads only its own
    return order


@pytest.fixture
def written(monkeypatch) -> list[tuple[str, str]]:
    return ledger_order(monkeypatch)


def tasks_file(tmp_path, tasks: list[dict]) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    return str(path)


def nothing_after_its_receipt(written: list[tuple[str, str]]) -> bool:
    receipted: set[str] = set()
    for kind, rollout in written:
        if rollout in receipted:
            return False
        if kind == "receipt":
            receipted.add(rollout)
    return True


def test_a_call_still_running_when_the_episode_returns_is_in_its_receipt_and_the_row_stays_ok(
    tmp_path, tokenizer, written
):
    engine = SlowWhenAsked(arithmetic_engine(tokenizer))
    tasks = tasks_file(tmp_path, [{"a": a, "b": 1} for a in range(2)])
    options = {"function": f"{AGENTS}:late_call_agent", "tasks": tasks}
    batch, summary = run_agents(tmp_path, engine, "agent_callable", options, num_tasks=2, group_size=2)

    assert all(seen == {"timed_out": True} for seen in fault_agents.SEEN.values())  # each returned before its call
    assert summary.ok == 4
    slow = [r for r in engine.inner.requests if r.request_id in fault_agents.ADMITTED]
    assert len(slow) == 4  # one call per rollout, whatever its client's retries
    ledger = LedgerReader(batch.store, 0)
    for bundle in ledger.rollouts():
        assert bundle.receipt.num_calls == len(bundle.manifest) == 2 and bundle.receipt.status == "ok"
        assert bundle.receipt.terminal_call_id == bundle.manifest[0].call_id
    assert nothing_after_its_receipt(written)
    finalize_batch(batch, FinalizeOptions(audit=False))
    rows = dataset_rows(str(tmp_path / "runs"), batch.config.batch_id)
    assert len(rows) == 4 and all((row["sample_mask"], row["mask_reason"]) == (1, None) for row in rows.values())


def test_a_retry_after_a_dropped_connection_is_answered_by_the_admitted_call_never_a_second(
    tmp_path, tokenizer, written
):
    engine = SlowWhenAsked(arithmetic_engine(tokenizer))
    tasks = tasks_file(tmp_path, [{"a": a, "b": 1} for a in range(2)])
    options = {"function": f"{AGENTS}:dropped_connection_agent", "tasks": tasks}
    batch, summary = run_agents(tmp_path, engine, "agent_callable", options, num_tasks=2, group_size=1)

    assert summary.ok == 2 and {seen["tries"] for seen in fault_agents.SEEN.values()} == {2}
    assert len(engine.inner.requests) == 2  # one generation per rollout
    replied = {seen["id"] for seen in fault_agents.SEEN.values()}
    bundles = list(LedgerReader(batch.store, 0).rollouts())
    assert {f"chatcmpl-{b.manifest[0].call_id}" for b in bundles} == replied  # the retry got the first call's answer
    assert all(b.receipt.num_calls == len(b.manifest) == 1 and b.receipt.status == "ok" for b in bundles)
    assert nothing_after_its_receipt(written)


class Unencodable:
    """A tokenizer class whose ``encode`` fails on :data:`fault_agents.UNENCODABLE` (as a Rust tokenizer
    used by two threads at once fails with ``Already borrowed``)."""

    def encode(self, text, **kwargs):
        if fault_agents.UNENCODABLE in text:
            raise RuntimeError("Already borrowed")
        return super().encode(text, **kwargs)


ALTERNATE = (
    "{% for m in messages %}{% if not loop.first and m.role == 'user' and messages[loop.index0 - 1].role == 'user' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% endfor %}"
)


def test_a_template_refusal_and_a_tokenizer_error_are_named_failure_rows_with_their_statuses(
    tmp_path, tokenizer, written
):
    strict = copy.deepcopy(tokenizer)
    strict.__class__ = type("Strict", (Unencodable, type(tokenizer)), {})
    strict.chat_template = ALTERNATE + tokenizer.chat_template
    engine = arithmetic_engine(strict)
    tasks = tasks_file(tmp_path, [{"a": 2, "b": 1, "fault": "template"}, {"a": 3, "b": 1, "fault": "tokenizer"}])
    options = {"function": f"{AGENTS}:refused_agent", "tasks": tasks}
    batch, summary = run_agents(tmp_path, engine, "agent_callable", options, num_tasks=2, group_size=1)

    # 400 is not retried by the client; the 500 is, twice: the retries are calls of a poisoned rollout
    assert fault_agents.SEEN == {
        2: {"status": 400, "code": "template_error"},
        3: {"status": 500, "code": "tokenizer_error"},
    }
    assert engine.requests == [] and summary.poisoned == 2
    plan = {p.rollout_id: json.loads(p.task_json)["fault"] for p in batch.shard_plan(0)}
    for bundle in LedgerReader(batch.store, 0).rollouts():
        reason = f"{plan[bundle.rollout_id]}_error"
        assert [f.reason for f in bundle.failures] == [reason] and not bundle.manifest
        assert (bundle.receipt.status, bundle.receipt.failure_reason, bundle.receipt.num_calls) == (
            "poisoned",
            reason,
            0,
        )
    assert nothing_after_its_receipt(written)


def test_a_tool_call_without_a_tool_parser_is_a_named_failure_row(tmp_path, tokenizer, written, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.tool_parsers.abstract_tool_parser", None)  # vLLM without its parsers
    engine = arithmetic_engine(tokenizer)
    tasks = tasks_file(tmp_path, [{"a": 2, "b": 1}])
    options = {"function": "tests.generation.agents_for_tests:tool_agent", "tasks": tasks}
    batch, _ = run_agents(tmp_path, engine, "agent_callable", options, num_tasks=1, group_size=1)

    (bundle,) = LedgerReader(batch.store, 0).rollouts()
    assert [f.reason for f in bundle.failures] == ["tool_parser_missing"] and not bundle.manifest
    assert "ModuleNotFoundError" in bundle.failures[0].detail
    assert (bundle.receipt.status, bundle.receipt.failure_reason) == ("poisoned", "tool_parser_missing")
    assert nothing_after_its_receipt(written)


TOKENIZER_USES: list[tuple[int, int]] = []  # (id of the tokenizer object, thread)


class Recording:
    """A tokenizer class that notes which object does tokenizer work, on which thread."""

    def _noted(self) -> None:
        TOKENIZER_USES.append((id(self), threading.get_ident()))

    def encode(self, *args, **kwargs):
        self._noted()
        return super().encode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self._noted()
        return super().decode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self._noted()
        return super().apply_chat_template(*args, **kwargs)

    def get_vocab(self, *args, **kwargs):
        self._noted()
        return super().get_vocab(*args, **kwargs)

    def convert_ids_to_tokens(self, *args, **kwargs):
        self._noted()
        return super().convert_ids_to_tokens(*args, **kwargs)


def test_an_agent_attempts_tokenizer_work_runs_on_one_thread_with_a_tokenizer_of_its_own(tmp_path, tokenizer):
    """The engine decodes with its tokenizer on the loop (as vllm_server does); rendering, encoding and tool-call
    reading use a copy, on the render thread only."""
    recording = copy.deepcopy(tokenizer)
    recording.__class__ = type("Recorded", (Recording, type(tokenizer)), {})
    engine = arithmetic_engine(recording)
    TOKENIZER_USES.clear()
    tasks = tasks_file(tmp_path, [{"a": a, "b": 1} for a in range(2)])
    options = {"function": "tests.generation.agents_for_tests:tool_agent", "tasks": tasks}
    _, summary = run_agents(tmp_path, engine, "agent_callable", options, num_tasks=2, group_size=2)

    assert summary.ok == 4 and summary.calls == 8
    loop = threading.get_ident()  # generate ran its loop here
    threads_of: dict[int, set[int]] = {}
    for tokenizer_id, thread in TOKENIZER_USES:
        threads_of.setdefault(tokenizer_id, set()).add(thread)
    assert threads_of.pop(id(recording)) == {loop}  # the engine's: its decodes and encodes, on the loop
    (render_threads,) = threads_of.values()  # one other tokenizer: the capture's copy
    assert len(render_threads) == 1 and loop not in render_threads
