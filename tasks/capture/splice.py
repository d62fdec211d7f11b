"""Prefix splicing (ARCHITECTURE section 6): continue a turn from the parent's exact tokens.

Re-encoding a rendered chat does not give back the ids the model sampled, so the prompt of a
child call is the parent's exact tokens ``P`` followed by the part of the fresh render ``T``
that starts at the turn boundary closing the history. The invariant this module protects:
the spliced prompt always starts with ``P`` (``P``'s trailing eos, when present, is replaced by
the identical eos of ``T``), so the parent's sampled ids reach the model unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

TokenIds = Sequence[int] | np.ndarray


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer that splicing uses."""

    eos_token_id: int | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


def replace_prefix_tokens(
    model_prefix_token_ids: TokenIds,
    template_prefix_token_ids: TokenIds,
    template_token_ids: TokenIds,
    *,
    eos_token_id: int,
) -> list[int]:
    """Splice the parent's exact tokens ``P`` onto the full template render ``T``.

    ``P`` empty gives ``T``. Otherwise ``n`` = the number of eos tokens in the template-prefix
    render ``T_pre``; the result is ``P`` without a trailing eos, followed by ``T`` from its
    n-th eos on. The eos is found by counting, not by position, so templates that rewrite the
    history (e.g. drop ``<think>`` blocks) still splice at the right boundary.

    Raises ``ValueError`` when ``T_pre`` holds no eos (no turn boundary) or ``T`` holds fewer
    than ``n`` eos tokens.
    """
    prefix = _ids(model_prefix_token_ids)
    template = _ids(template_token_ids)
    if not prefix:
        return template
    cut_end = len(prefix) - 1 if prefix[-1] == eos_token_id else len(prefix)
    n = _ids(template_prefix_token_ids).count(eos_token_id)
    if n == 0:
        raise ValueError(f"no turn boundary: the template prefix holds no eos token (id {eos_token_id})")
    seen = 0
    for position, token in enumerate(template):
        if token == eos_token_id:
            seen += 1
            if seen == n:
                return prefix[:cut_end] + template[position:]
    raise ValueError(
        f"the template prefix holds {n} eos tokens (id {eos_token_id}) but the full template holds only {seen}: "
        f"no eos #{n} to splice at"
    )


def render_chat_ids(
    tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    Rendered to text and encoded without added special tokens, exactly as
    ``apply_chat_template(tokenize=True)`` does, independent of its return type.
    """
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def splice_chat_prompt(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    parent_token_ids: TokenIds,
    *,
    eos_token_id: int | None = None,
) -> list[int]:
    """The prompt of a call: the parent's exact tokens spliced onto the rendered chat.

    ``T`` is the full render with the generation prompt; ``T_pre`` renders the messages
    through the last assistant message without it (empty when there is none, which is an
    error unless the call is a root). ``eos_token_id`` defaults to the tokenizer's eos, the
    token that closes a turn. Equals :func:`replace_prefix_tokens` on those renders.
    """
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token; pass eos_token_id (the id that closes a turn)")
    full = render_chat_ids(tokenizer, messages, generation_prompt=True)
    last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last_assistant is None:
        history: list[int] = []
    else:
        history = render_chat_ids(tokenizer, messages[: last_assistant + 1], generation_prompt=False)
    return replace_prefix_tokens(parent_token_ids, history, full, eos_token_id=eos)


def _ids(values: TokenIds) -> list[int]:
    return [operator.index(v) for v in values]
