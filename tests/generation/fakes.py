"""Fakes for fast unit tests of the generate stage. Named as fakes: no real inference happens.

:class:`FakeScriptedEngine` answers every request with scripted text, tokenized by the REAL
bundled tokenizer (so chat templates and splicing are real), plus the eos token, and records
every request and result so tests can compare staged data with what "the engine" produced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from tasks.engines.base import Engine, GenerationRequest, GenerationResult, next_weight_version
from tasks.environments.base import Environment, Message, Turn
from tasks.errors import EngineError
from tasks.records.sampling_mask import KeptSets


class FatalEngineCrash(BaseException):
    """Simulates the process dying mid-shard: escapes every ``except Exception``."""


class FakeScriptedEngine(Engine):
    """Answers every request at once with ``reply(request)`` tokenized by the real tokenizer, plus eos.

    A reply longer than the request's ``max_tokens`` is cut there (finish reason ``length``).
    Keeps every request and result for tests to compare with what was staged, unless ``record``
    is False (the memory benchmark); counts prompt and generated tokens either way. With ``masks``,
    a request that truncates (top-p / top-k) answers each token's kept set: the token and the ids
    just above it, ``(id + 1) % 7`` of them (a scripted mask, not a sampler's).
    """

    name = "fake-scripted"

    def __init__(
        self,
        tokenizer: Any,
        *,
        reply: Callable[[GenerationRequest], str] = lambda request: str(request.seed % 100 + 1),
        fail: Callable[[GenerationRequest], BaseException | None] = lambda request: None,
        max_model_len: int = 2048,
        weight_version: int = 0,
        record: bool = True,
        masks: bool = False,
    ) -> None:
        super().__init__(tokenizer=tokenizer, max_model_len=max_model_len, weight_version=weight_version)
        self._reply = reply
        self._fail = fail
        self._record = record
        self._masks = masks
        self.requests: list[GenerationRequest] = []
        self.results: dict[str, GenerationResult] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        await asyncio.sleep(0)
        if self._record:
            self.requests.append(request)
        failure = self._fail(request)
        if failure is not None:
            raise failure
        text = self._reply(request)
        ids = [*self._tokenizer.encode(text, add_special_tokens=False), self.eos_token_id]
        limit = request.max_tokens or request.sampling.max_tokens
        finish = "length" if len(ids) > limit else "stop"
        ids = ids[:limit]
        self.prompt_tokens += len(request.prompt_token_ids)
        self.generated_tokens += len(ids)
        result = GenerationResult(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=tuple(ids),
            logprobs=-np.linspace(0.01, 1.0, len(ids), dtype=np.float32),
            finish_reason=finish,
            text=text,
            kept=scripted_kept_sets(ids) if self._masks and request.sampling.truncates else None,
        )
        if self._record:
            self.results[request.request_id] = result
        return result

    async def update_weights(self, model_path: str, *, version: int | None = None) -> int:
        self._weight_version = next_weight_version(self._weight_version, version)
        return self._weight_version

    async def close(self) -> None:
        return None


def scripted_kept_sets(token_ids: Sequence[int]) -> KeptSets:
    """The fake engine's kept set of each token: the token and the ``(id + 1) % 7`` ids just above it."""
    return KeptSets.of(range(token, token + 1 + (token + 1) % 7) for token in token_ids)


def engine_failure(message: str) -> EngineError:
    return EngineError(message)


class RewritingEnvironment(Environment):
    """A test environment that rewrites history on its second turn (loaded by import path)."""

    name: ClassVar[str] = "rewriting"

    def make_tasks(self, num_tasks: int, seed: int) -> list[dict[str, Any]]:
        return [{"index": i} for i in range(num_tasks)]

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        return [{"role": "user", "content": f"Task {task['index']}: say a number."}]

    def step(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns == 1:
            return Turn.reply({"role": "user", "content": "Another one."})
        if turns == 2:
            rewritten = [{"role": "user", "content": "Forget that. Say a number."}, *messages[1:]]
            return Turn(rewrite=(*rewritten, {"role": "user", "content": "Again."}))
        return Turn.finish(1.0)


def fail_staging_writes(monkeypatch: Any, message: str) -> None:
    """Make every staging segment write raise ``OSError(message)``; ledger writes still work."""
    from tasks.storage.objects import ObjectStore

    original = ObjectStore.write_once

    def failing(self: ObjectStore, relative: str, data: bytes) -> Any:
        if relative.startswith("staging/"):
            raise OSError(message)
        return original(self, relative, data)

    monkeypatch.setattr(ObjectStore, "write_once", failing)


class DelegatingEngine(Engine):
    """Passes everything to a real engine; subclasses wrap ``generate`` (to record, or to crash)."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner

    weight_version = property(lambda self: self.inner.weight_version)
    tokenizer = property(lambda self: self.inner.tokenizer)
    eos_token_id = property(lambda self: self.inner.eos_token_id)
    max_model_len = property(lambda self: self.inner.max_model_len)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.inner.generate(request)

    async def update_weights(self, model_path: str, *, version: int | None = None) -> int:
        return await self.inner.update_weights(model_path, version=version)

    async def close(self) -> None:
        return None  # the wrapped engine belongs to whoever created it
