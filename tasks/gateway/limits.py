"""How much one request may ask of the capture gateway: :class:`GatewayLimits`.

The body cap is enforced while the body is read (:mod:`tasks.gateway.body`), the others on the
parsed request (:func:`tasks.gateway.protocol.read_chat_request`) and per route
(:mod:`tasks.gateway.app`).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024


@dataclass(frozen=True)
class GatewayLimits:
    """The caps on one request of a rollout; a request over one is refused with a named code, never truncated.

    - ``max_body_bytes`` (4 MiB): the JSON body; over it, 413 ``request_too_large``.
    - ``max_messages`` (2,048): far more than an episode's history grows to under a batch's
      ``max_turns`` (a turn adds an assistant message and its tool results), few enough that the
      per-message checks stay cheap; over it, 400 ``too_many_messages``.
    - ``max_tools`` (128): OpenAI's own cap on ``tools``; over it, 400 ``too_many_tools``.
    - ``max_message_chars`` (1,000,000) and ``max_total_chars`` (2,000,000): the characters of one
      message's content and of all of them. At about 4 characters a token, 2,000,000 is some
      500,000 tokens, past the context of the models a batch runs: the cap refuses before
      rendering and tokenizing what the engine would refuse after (``context_length_exceeded``).
      Over them, 400 ``message_too_long`` / ``messages_too_long``.
    - ``max_concurrent_requests`` (4): chat completions of one rollout in flight at once; one more
      is refused with 429 ``too_many_concurrent_requests`` (see :mod:`tasks.gateway.app`).
    """

    max_body_bytes: int = 4 * MiB
    max_messages: int = 2048
    max_tools: int = 128
    max_message_chars: int = 1_000_000
    max_total_chars: int = 2_000_000
    max_concurrent_requests: int = 4

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GatewayLimits.{name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = GatewayLimits()
