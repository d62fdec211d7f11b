"""Tools in a chat template that has none, and tool calls read back from the sampled text.

The fallback format (Hermes's, which vLLM's ``hermes`` tool parser reads): the request's tools
are listed as JSON inside ``<tools></tools>`` in the system message, and the model calls one by
writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. :func:`offer_tools` puts
the tools in the conversation the template renders (the same text for the same tools, so a
conversation that extends an earlier one still does); :class:`ToolCallReader` splits the sampled
text into the reply's content and tool calls with vLLM's parser. Text that opens a tool call the
parser cannot read comes back as plain content and is reported as unparsed, never guessed.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tasks.environments.base import Message

PARSER = "hermes"  # vLLM's tool parser for this format
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
TOOLS_PROMPT = (
    "You may call functions to help you answer. They are listed as JSON inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, reply with a JSON object naming it and giving its arguments, inside <tool_call></tool_call> "
    'tags:\n<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>'
)


def tools_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system-prompt text offering ``tools``: one JSON object per line, keys sorted (same tools, same text)."""
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, sort_keys=True) for tool in tools))


def offer_tools(messages: Sequence[Message], tools: Sequence[dict[str, Any]]) -> list[Message]:
    """``messages`` with ``tools`` offered in the system message (appended to the first one, else a new first one)."""
    if not tools:
        return [dict(m) for m in messages]
    offer = tools_prompt(tools)
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{offer}"
    else:
        out.insert(0, {"role": "system", "content": offer})
    return out


def call_text(tool_call: dict[str, Any]) -> str:
    """One OpenAI tool call in the fallback format (for an assistant message the gateway did not sample itself)."""
    function = tool_call["function"]
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else kept as the string the client sent
            arguments = json.loads(arguments)
    return f"{CALL_START}\n{json.dumps({'name': function['name'], 'arguments': arguments})}\n{CALL_END}"


@dataclass(frozen=True)
class ReadReply:
    """The sampled text as an assistant message: content (None when only tool calls), tool calls, unparsed or not."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    unparsed: bool


class ToolCallReader:
    """Reads tool calls out of sampled text with vLLM's parser (:data:`PARSER`), built once per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

        parser = ToolParserManager.get_tool_parser(PARSER)
        # It logs a traceback for text it cannot read; that text is reported as unparsed here instead.
        logging.getLogger(parser.__module__).setLevel(logging.CRITICAL)
        self._parser = parser(tokenizer)

    def read(self, text: str, *, call_id: str) -> ReadReply:
        """``text`` as content and tool calls; tool call ids are ``{call_id}-{index}`` (stable across retries)."""
        if CALL_START not in text:
            return ReadReply(text, [], unparsed=False)
        found = self._parser.extract_tool_calls(text, request=None)
        if not found.tools_called:
            return ReadReply(text, [], unparsed=True)
        calls = [
            {
                "id": f"{call_id}-{index}",
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for index, call in enumerate(found.tool_calls)
        ]
        return ReadReply(found.content, calls, unparsed=False)
