"""What an OpenAI-style client may send the capture gateway, and the errors it gets back.

:func:`read_chat_request` turns a ``POST …/v1/chat/completions`` body into a
:class:`ChatRequest`, or raises :class:`GatewayError` carrying the status and the OpenAI error
body (``{"error": {"message", "type", "param", "code"}}``) a client expects. Sampling is the
plan's, so that every captured logprob is one of the distribution the batch trains on: a request
may lower ``max_tokens`` (or ``max_completion_tokens``) but names ``temperature``, ``top_p`` or
``top_k`` only with the plan's value. Fields that would change what is sampled or returned in a
way the ledger cannot record (``n`` > 1, ``logprobs``, ``logit_bias``, ``response_format``, …)
are refused by name, never ignored. A request over the :class:`GatewayLimits` (messages, tools,
characters of content) is refused before its messages are checked one by one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks.environments.base import Message, check_messages
from tasks.gateway.limits import DEFAULT_LIMITS, GatewayLimits
from tasks.sampling import SamplingSettings

# Accepted and used, or accepted because they change nothing that is sampled or recorded.
USED_FIELDS = frozenset(
    {"messages", "model", "tools", "tool_choice", "stream", "stream_options", "n", "max_tokens"}
    | {"max_completion_tokens", "temperature", "top_p", "top_k", "parallel_tool_calls"}
)
INERT_FIELDS = frozenset({"user", "metadata", "store", "seed"})  # seed: the plan seeds every call
REFUSED_FIELDS = {
    "logprobs": "the gateway records logprobs itself and does not return them",
    "top_logprobs": "the gateway records logprobs itself and does not return them",
    "logit_bias": "it would change the sampled distribution away from the plan's",
    "presence_penalty": "it would change the sampled distribution away from the plan's",
    "frequency_penalty": "it would change the sampled distribution away from the plan's",
    "response_format": "structured output would constrain sampling away from the plan's",
    "stop": "stop strings would cut the sampled tokens the ledger records",
    "functions": "the legacy functions API is not supported: send tools",
    "function_call": "the legacy functions API is not supported: send tool_choice",
    "audio": "only text chat is supported",
    "modalities": "only text chat is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "the plan fixes the model's sampling",
    "web_search_options": "only the agent's own tools are supported",
}
TOOL_CHOICES = ("auto", "none")


class GatewayError(Exception):
    """A request the gateway refuses: the HTTP status, the OpenAI-style error body and any response headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """``{"error": ...}`` holding the ``openai`` package's ``ErrorObject`` (message, type, param, code)."""
        from openai.types.shared import ErrorObject

        error = ErrorObject(message=self.message, type=self.kind, param=self.param, code=self.code)
        return {"error": error.to_dict(mode="json")}


def invalid(message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    """A 400 ``invalid_request_error``, as OpenAI answers a malformed or unsupported request."""
    return GatewayError(400, message, kind="invalid_request_error", param=param, code=code)


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request: messages, tools, how to answer, and the call's sampling."""

    messages: list[Message]
    sampling: SamplingSettings
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"
    stream: bool = False
    include_usage: bool = False
    model: str | None = None


def read_chat_request(body: object, plan: SamplingSettings, limits: GatewayLimits = DEFAULT_LIMITS) -> ChatRequest:
    """``body`` (the parsed JSON) as a :class:`ChatRequest` under the plan's sampling ``plan`` and ``limits``;
    else GatewayError."""
    if not isinstance(body, Mapping):
        raise invalid("the request body must be a JSON object")
    for name, why in REFUSED_FIELDS.items():
        if body.get(name) is not None:
            raise invalid(f"{name} is not supported by the capture gateway: {why}", param=name)
    unknown = sorted(str(k) for k in body if k not in USED_FIELDS | INERT_FIELDS | set(REFUSED_FIELDS))
    if unknown:
        raise invalid(f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", param="messages")
    _check_counts(messages, body.get("tools"), limits)
    try:
        checked = check_messages([_message(m) for m in messages], where="messages")
    except ValueError as exc:
        raise invalid(str(exc), param="messages") from None
    _check_chars(checked, limits)
    if body.get("n", 1) != 1:
        raise invalid("n must be 1: each call is one sampled completion in the ledger", param="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise invalid("stream_options must be an object", param="stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model must be a string", param="model")
    return ChatRequest(
        messages=checked,
        sampling=_sampling(body, plan),
        tools=_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("tool_choice", "auto")),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        model=model,
    )


def _check_counts(messages: list[Any], tools: object, limits: GatewayLimits) -> None:
    if len(messages) > limits.max_messages:
        raise invalid(
            f"messages has {len(messages)} messages, more than the gateway's {limits.max_messages}",
            param="messages",
            code="too_many_messages",
        )
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise invalid(
            f"tools has {len(tools)} tools, more than the gateway's {limits.max_tools}",
            param="tools",
            code="too_many_tools",
        )


def _check_chars(messages: list[Message], limits: GatewayLimits) -> None:
    """The characters of each message's content, and of all of them, within ``limits``."""
    total = 0
    for index, message in enumerate(messages):
        chars = len(message["content"])
        if chars > limits.max_message_chars:
            raise invalid(
                f"messages[{index}] has {chars} characters of content, more than the gateway's "
                f"{limits.max_message_chars}",
                param="messages",
                code="message_too_long",
            )
        total += chars
    if total > limits.max_total_chars:
        raise invalid(
            f"messages have {total} characters of content, more than the gateway's {limits.max_total_chars}",
            param="messages",
            code="messages_too_long",
        )


def _message(message: object) -> object:
    """A client's message with the keys OpenAI allows as null dropped (``content: null`` beside tool calls)."""
    if not isinstance(message, Mapping):
        return message
    out = {k: v for k, v in message.items() if v is not None or k == "content"}
    if out.get("content") is None and out.get("tool_calls"):
        out["content"] = ""
    if isinstance(out.get("content"), list):  # content parts: text only
        out["content"] = _text_of_parts(out["content"])
    return out


def _text_of_parts(parts: list[Any]) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid("only text content parts are supported", param="messages")
        texts.append(part["text"])
    return "".join(texts)


def _sampling(body: Mapping[str, Any], plan: SamplingSettings) -> SamplingSettings:
    for name in ("temperature", "top_p", "top_k"):
        value = body.get(name)
        if value is not None and value != getattr(plan, name):
            raise invalid(
                f"{name} {value!r} differs from the plan's {getattr(plan, name)!r}: every call of a batch samples "
                "with the plan's settings (leave it out)",
                param=name,
            )
    max_tokens = plan.max_tokens
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise invalid(f"{name} must be a positive integer", param=name)
        if value > plan.max_tokens:
            raise invalid(f"{name} {value} is above the plan's max_tokens {plan.max_tokens}", param=name)
        max_tokens = min(max_tokens, value)
    return SamplingSettings(temperature=plan.temperature, top_p=plan.top_p, top_k=plan.top_k, max_tokens=max_tokens)


def _tools(tools: object) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise invalid("tools must be a list", param="tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
            raise invalid(f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid(f"tools[{index}].function.name must be a non-empty string", param="tools")
    return [dict(tool) for tool in tools]


def _tool_choice(choice: object) -> str:
    """``auto`` (the model may call a tool) or ``none`` (tools are not offered); forcing a call would need
    constrained decoding, which samples away from the plan's distribution."""
    if choice in TOOL_CHOICES:
        return str(choice)
    raise invalid(
        f"tool_choice must be one of {TOOL_CHOICES}: forcing a tool call (required, a named function) would "
        "constrain sampling away from the plan's",
        param="tool_choice",
    )
