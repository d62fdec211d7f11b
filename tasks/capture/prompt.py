"""A call's prompt (docs/architecture.md §5, steps 2-3): its parent's exact tokens, then the render spliced on.

:meth:`Prompts.parent_tokens` reads the parent's tokens through the :class:`ChainPrefixCache`
(``prefix_mismatch`` when they cannot be resolved to exactly ``prev_len`` tokens);
:meth:`Prompts.prompt` renders the chat with the capture's tokenizer and splices it onto them
(:mod:`tasks.capture.splice`). Invariant: a prompt starts with its parent's exact tokens and
leaves the engine room for one token at least (``context_length``), else the call fails.

With a ``render_executor`` (the gateway's: its calls arrive over HTTP on the loop), all of the
capture's tokenizer work (render, encode, reading the reply) runs on that one thread
(:meth:`Prompts.rendering`), with a private copy of the engine's tokenizer (:attr:`Prompts.tokenizer`):
an engine may decode with its own on the loop meanwhile (``vllm_server`` does), and a Hugging Face
tokenizer must not be used by two threads at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from tasks.capture.admission import Admitted
from tasks.capture.faults import CONTEXT_LENGTH, PREFIX_MISMATCH, SPLICE_FAILED, CallFault, RenderTokenizer
from tasks.capture.prefix_cache import (
    Admission,
    ChainPrefixCache,
    PrefixMismatchError,
    resolve_admission,
    resolve_cached_admission,
)
from tasks.capture.splice import ChatPromptBuilder
from tasks.engines.base import Engine
from tasks.environments.base import Message
from tasks.errors import StorageUnavailableError

_EMPTY = np.zeros(0, dtype=np.int64)
T = TypeVar("T")


class Prompts:
    """Prompt preparation of one shard attempt: the tokenizer it renders with, and the prefix cache."""

    def __init__(
        self,
        engine: Engine,
        prefix_cache: ChainPrefixCache | None,
        render_executor: concurrent.futures.Executor | None = None,
    ) -> None:
        """``prefix_cache`` may be None only for uncaptured calls (their parents' tokens are in memory)."""
        self._engine = engine
        self._cache = prefix_cache
        self._render_executor = render_executor
        # Used only where prompts are rendered (see the module doc), from its first use on
        # (the prompt builder is made there too).
        self.tokenizer = engine.tokenizer if render_executor is None else copy.deepcopy(engine.tokenizer)
        self._builder: ChatPromptBuilder | None = None
        self._eos_token_id = engine.eos_token_id

    async def rendering(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` where the capture's tokenizer is used: the render thread, else here on the loop."""
        if self._render_executor is None:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._render_executor, work, *args)

    async def parent_tokens(self, call: Admitted) -> np.ndarray:
        """The exact tokens ``call`` continues: none for a root, its parent's whole sequence for a child."""
        parent = call.parent
        if parent is None:
            return _EMPTY
        if not call.captured:
            return parent.token_ids
        admission = Admission(
            call_id=call.call_id,
            parent_call_id=parent.call_id,
            prev_len=parent.cum_len,
            staging_chain=parent.staging_chain,
            parent_chain_hash=parent.chain_hash,
        )
        try:
            # The parent's tokens are normally in memory (written through when it was staged): a
            # lookup on the loop. Only a miss reads staging, in a thread. With an in-process engine
            # stepping on this loop (megatron), each trip through a thread costs the call an engine step.
            cached = resolve_cached_admission(admission, self._cache)  # type: ignore[arg-type]
            if cached is not None:
                return cached
            return await asyncio.to_thread(resolve_admission, admission, self._cache)  # type: ignore[arg-type]
        except PrefixMismatchError as exc:
            raise CallFault(PREFIX_MISMATCH, str(exc)) from None
        except StorageUnavailableError:
            raise
        except Exception as exc:
            raise CallFault(
                PREFIX_MISMATCH, f"parent tokens of {call.call_id} could not be resolved: {exc!r}"
            ) from None

    async def prompt(
        self,
        call_id: str,
        messages: Sequence[Message],
        parent_tokens: np.ndarray,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> np.ndarray:
        """The prompt of ``call_id``: ``messages`` rendered (``tools`` for a template that renders them)
        and spliced onto ``parent_tokens``."""
        return await self.rendering(self._render, call_id, messages, parent_tokens, tools)

    def remember(self, staging_key: str, sequence: np.ndarray) -> None:
        """Keep a staged call's whole sequence in the prefix cache: its children read it from memory."""
        self._cache.remember(staging_key, sequence)  # type: ignore[union-attr]

    def _render(
        self, call_id: str, messages: Sequence[Message], parent_tokens: np.ndarray, tools: Sequence[Mapping[str, Any]]
    ) -> np.ndarray:
        try:
            if self._builder is None:
                self._builder = ChatPromptBuilder(RenderTokenizer(self.tokenizer), eos_token_id=self._eos_token_id)
            prompt = self._builder.prompt(messages, parent_tokens, tools=tools)
        except CallFault as fault:
            raise CallFault(fault.reason, f"prompt of {call_id}: {fault.detail}") from None
        except ValueError as exc:
            raise CallFault(SPLICE_FAILED, f"prompt of {call_id}: {exc}") from None
        if prompt.size < parent_tokens.size or not np.array_equal(prompt[: parent_tokens.size], parent_tokens):
            raise CallFault(PREFIX_MISMATCH, f"prompt of {call_id} does not start with its parent's exact tokens")
        if prompt.size >= self._engine.max_model_len:
            raise CallFault(
                CONTEXT_LENGTH,
                f"prompt of {call_id} has {prompt.size} tokens; the engine accepts {self._engine.max_model_len} in all",
            )
        return prompt
