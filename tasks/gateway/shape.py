"""What a gateway request asks of its captured call (:class:`CallShape`), beyond the messages it sends.

:func:`call_shape` reads it off a checked :class:`~tasks.gateway.protocol.ChatRequest`: the tools
the model is offered (none under ``tool_choice: "none"``), given to a chat template that renders
tools itself, else offered in the fallback format inside the rendered messages
(:mod:`tasks.gateway.tools`), with earlier tool calls rendered as that format's text; a lower
``max_tokens``; and the reply reader, which turns the sampled text back into content and tool calls
when tools were offered. Invariant: the same history and tools render the same text, so a request
that extends an earlier one still extends its render.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks.environments.base import Message
from tasks.gateway.protocol import ChatRequest
from tasks.gateway.tools import call_text, offer_tools


@dataclass(frozen=True)
class CallShape:
    """How a gateway call differs from an environment's: what the template renders, tools, fewer tokens, the reply.

    ``rendered`` are the messages the chat template renders (tools offered in the system message,
    tool calls as text); ``tools`` go to a template that renders them itself; ``offered`` are the
    tools the model is offered either way (a call offering other tools than the call its history
    extends is a root, ``tools_changed``); ``max_tokens`` may only lower the plan's; ``read_reply``
    turns (sampled text, call id) into the assistant message the client gets (and a later request's
    history holds) and the notes staged with the call; it runs where the capture renders prompts.
    """

    rendered: Sequence[Message] | None = None
    tools: Sequence[Mapping[str, Any]] = ()
    offered: Sequence[Mapping[str, Any]] = ()
    max_tokens: int | None = None
    read_reply: Callable[[str, str], tuple[Message, dict[str, Any]]] | None = None


def renders_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders the request's tools itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def call_shape(
    chat: ChatRequest,
    *,
    template_renders_tools: bool,
    read_reply: Callable[[str, str], tuple[Message, dict[str, Any]]],
) -> CallShape:
    """The shape of ``chat``'s call; ``read_reply`` reads the reply only when tools were offered."""
    offered = chat.tools if chat.tool_choice == "auto" else []
    return CallShape(
        rendered=rendered_messages(chat.messages, offered, template_renders_tools=template_renders_tools),
        tools=offered if template_renders_tools else (),
        offered=offered,
        max_tokens=chat.sampling.max_tokens,
        read_reply=read_reply if offered else None,
    )


def rendered_messages(
    messages: Sequence[Message], tools: Sequence[dict[str, Any]], *, template_renders_tools: bool
) -> list[Message]:
    """What the chat template renders: tool calls as the fallback's text, tools offered, unless it renders them."""
    if template_renders_tools:
        return [dict(m) for m in messages]
    rendered: list[Message] = []
    for message in messages:
        calls = message.get("tool_calls") or []
        out = {"role": message["role"], "content": message["content"]}
        if calls:
            out["content"] = "\n".join([message["content"], *(call_text(call) for call in calls)]).strip()
        rendered.append(out)
    return offer_tools(rendered, tools)
