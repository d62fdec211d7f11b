"""A gateway call's reply: the sampled text read back into the assistant message the client gets.

:class:`ReplyReader` returns the text as content when it opens no tool call; else it reads the
tool calls with vLLM's parser (:class:`~tasks.gateway.tools.ToolCallReader`, built on first use,
with the tokenizer the capture renders with). Text that opens a tool call the parser cannot read
stays content and is noted ``{"tool_calls": "unparsed"}`` (staged with the call), never guessed.
A parser that cannot be built raises :class:`ToolParserMissing`: the call's failure, not a guess.
"""

from __future__ import annotations

from typing import Any

from tasks.environments.base import Message
from tasks.gateway.tools import CALL_START, PARSER, ToolCallReader

UNPARSED_TOOL_CALL = "unparsed"  # the note of a reply that opened a tool call the parser could not read


class ToolParserMissing(Exception):
    """vLLM's tool parser is not importable here, or refuses the tokenizer."""


class ReplyReader:
    """(sampled text, call id) → (the assistant message, the notes to stage); use it on one thread only."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._reader: ToolCallReader | None = None

    def __call__(self, text: str, call_id: str) -> tuple[Message, dict[str, Any]]:
        if CALL_START not in text:
            return {"role": "assistant", "content": text}, {}
        if self._reader is None:
            try:
                self._reader = ToolCallReader(self._tokenizer)
            except Exception as error:  # vLLM or its parser is not importable, or refuses the tokenizer
                raise ToolParserMissing(f"vLLM's {PARSER!r} tool parser is unavailable: {error!r}") from None
        read = self._reader.read(text, call_id=call_id)
        message: Message = {"role": "assistant", "content": read.content or ""}
        if read.tool_calls:
            message["tool_calls"] = read.tool_calls  # type: ignore[assignment]
        return message, ({"tool_calls": UNPARSED_TOOL_CALL} if read.unparsed else {})
