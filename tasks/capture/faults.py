"""Named faults of a call's steps: the failure reasons, :class:`CallFault`, and :class:`RenderTokenizer`.

Every step of a call that fails for a reason the ledger should name raises :class:`CallFault`; the
call then writes its failure row with that reason (:mod:`tasks.capture.calls`). The reasons are
stable names (:data:`FAILURE_REASONS`, listed in docs/generation.md). :class:`RenderTokenizer`
wraps the tokenizer prompts are rendered with, so that a chat template that refuses the messages
(``template_error``: a role-order check, a template bug, no template at all) and a tokenizer that
fails to encode the render (``tokenizer_error``) are told apart, whatever exception either raised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.engines.base import GenerationResult

HISTORY_DIVERGED = "history_diverged"
PREFIX_MISMATCH = "prefix_mismatch"
SPLICE_FAILED = "splice_failed"
TEMPLATE_ERROR = "template_error"
TOKENIZER_ERROR = "tokenizer_error"
TOOL_PARSER_MISSING = "tool_parser_missing"  # raised by the gateway's reply reader (tasks.generate.agent_rollouts)
CONTEXT_LENGTH = "context_length"
ENGINE_ERROR = "engine_error"
ENGINE_PROMPT_MISMATCH = "engine_prompt_mismatch"
SAMPLING_MASK_OVERFLOW = "sampling_mask_overflow"  # a kept set larger than the engine could return
SAMPLING_MASK_MISSING = "sampling_mask_missing"  # a truncated call answered without its kept sets
INVALID_DELTA = "invalid_delta"
STAGING_FAILED = "staging_failed"
LEDGER_FAILED = "ledger_failed"
FAILURE_REASONS = (
    HISTORY_DIVERGED,
    PREFIX_MISMATCH,
    SPLICE_FAILED,
    TEMPLATE_ERROR,
    TOKENIZER_ERROR,
    TOOL_PARSER_MISSING,
    CONTEXT_LENGTH,
    ENGINE_ERROR,
    ENGINE_PROMPT_MISMATCH,
    SAMPLING_MASK_OVERFLOW,
    SAMPLING_MASK_MISSING,
    INVALID_DELTA,
    STAGING_FAILED,
    LEDGER_FAILED,
)
MAX_SHOWN_ERROR = 500  # characters of the underlying error kept in a fault's detail


class CallFault(Exception):
    """A step of a call failed: ``reason`` is the failure row's, ``detail`` says what happened, and
    ``completion`` is the engine's answer when the call got one (the caller still gets it)."""

    def __init__(self, reason: str, detail: str, completion: GenerationResult | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.completion = completion


def _shown(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:MAX_SHOWN_ERROR]


class RenderTokenizer:
    """A tokenizer whose chat-template renders and encodes raise :class:`CallFault` naming which failed.

    Everything else (``eos_token_id``, ``chat_template``, ``convert_ids_to_tokens``, ...) is the
    wrapped tokenizer's.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.inner = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        try:
            return self.inner.apply_chat_template(conversation, **kwargs)
        except Exception as error:
            raise CallFault(TEMPLATE_ERROR, f"the chat template refused the messages: {_shown(error)}") from None

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        try:
            return self.inner.encode(text, **kwargs)
        except Exception as error:
            raise CallFault(TOKENIZER_ERROR, f"the tokenizer could not encode the render: {_shown(error)}") from None
