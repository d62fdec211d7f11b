"""Prefix splicing (docs/architecture.md §6): continue a turn from the parent's exact tokens.

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


def render_chat(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] = (),
) -> str:
    """``messages`` rendered to text by the tokenizer's chat template (``tools`` handed to it when given)."""
    extra = {"tools": [dict(tool) for tool in tools]} if tools else {}
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt, **extra
    )


def render_chat_ids(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] = (),
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    Rendered to text and encoded without added special tokens, exactly as
    ``apply_chat_template(tokenize=True)`` does, independent of its return type.
    """
    text = render_chat(tokenizer, messages, generation_prompt=generation_prompt, tools=tools)
    return list(tokenizer.encode(text, add_special_tokens=False))


def splice_chat_prompt(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    parent_token_ids: TokenIds,
    *,
    eos_token_id: int | None = None,
    tools: Sequence[Mapping[str, Any]] = (),
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
    full = render_chat_ids(tokenizer, messages, generation_prompt=True, tools=tools)
    last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last_assistant is None:
        history: list[int] = []
    else:
        history = render_chat_ids(tokenizer, messages[: last_assistant + 1], generation_prompt=False, tools=tools)
    return replace_prefix_tokens(parent_token_ids, history, full, eos_token_id=eos)


def _ids(values: TokenIds) -> list[int]:
    return [operator.index(v) for v in values]


def is_message_local(template_source: str) -> bool:
    """True when a chat template renders each message on its own (checked on the Jinja AST).

    Message-local: one ``for message in messages`` loop; ``messages`` is otherwise only read as
    ``messages[0]``; ``loop`` is only read as ``loop.first``; no ``namespace`` state crosses
    iterations. Then the render of ``[messages[0]] + messages[j:]`` holds exactly the text the
    full render gives messages ``j..``, which lets :class:`ChatPromptBuilder` render a window.
    Anything else (``messages[-1]``, ``loop.last``, reverse scans, unknown tags) is not local.
    """
    try:
        from jinja2 import Environment, nodes
        from jinja2.ext import loopcontrols

        tree = Environment(extensions=[loopcontrols]).parse(template_source)
    except Exception:
        return False
    loops = list(tree.find_all(nodes.For))
    if len(loops) != 1:
        return False
    loop = loops[0]
    if not (isinstance(loop.iter, nodes.Name) and loop.iter.name == "messages") or loop.else_ or loop.recursive:
        return False
    if loop.test is not None or any(True for _ in tree.find_all(nodes.NSRef)):
        return False

    def allowed(node: Any, parent: Any) -> bool:
        if isinstance(node, nodes.Name) and node.name == "messages" and node is not loop.iter:
            return isinstance(parent, nodes.Getitem) and isinstance(parent.arg, nodes.Const) and parent.arg.value == 0
        if isinstance(node, nodes.Name) and node.name == "loop":
            return isinstance(parent, nodes.Getattr) and parent.attr == "first"
        return all(allowed(child, node) for child in node.iter_child_nodes())

    return allowed(tree, None)


class ChatPromptBuilder:
    """Spliced prompts equal to :func:`splice_chat_prompt`, without re-tokenizing known tokens.

    Renders are made as text only; ``n`` is counted as occurrences of the eos token's text in
    the ``T_pre`` render, and only the text of ``T`` from its n-th eos on is tokenized. That
    equals the token-level definition because the tokenizer splits its special tokens out of
    the text before anything else: the eos text always becomes exactly the eos id, and the
    tokens after it do not depend on the text before it (checked at construction; otherwise
    the token-level definition runs). For message-local templates (:func:`is_message_local`)
    only a window of the conversation is rendered, ``[messages[0]]`` plus everything from the
    last assistant message on, so the cost per call does not grow with the history.
    """

    def __init__(self, tokenizer: ChatTokenizer, *, eos_token_id: int | None = None) -> None:
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos token; pass eos_token_id (the id that closes a turn)")
        self.tokenizer = tokenizer
        self.eos_token_id = int(eos)
        convert = getattr(tokenizer, "convert_ids_to_tokens", None)
        text = convert(self.eos_token_id) if convert is not None else None
        atomic = isinstance(text, str) and text and list(tokenizer.encode(text, add_special_tokens=False)) == [eos]
        self.eos_text: str | None = text if atomic else None
        template = getattr(tokenizer, "chat_template", None)
        self.windowed = self.eos_text is not None and isinstance(template, str) and is_message_local(template)

    def prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        parent_token_ids: TokenIds,
        *,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> np.ndarray:
        """The prompt ids (int64) of a call on ``messages`` after ``parent_token_ids``; ``tools`` to the template."""
        parent = np.asarray(parent_token_ids, dtype=np.int64)
        if self.eos_text is None or tools:
            spliced = splice_chat_prompt(self.tokenizer, messages, parent, eos_token_id=self.eos_token_id, tools=tools)
            return np.asarray(spliced, dtype=np.int64)
        if parent.size == 0:
            return self._encode(self._render(messages, generation_prompt=True))
        last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last_assistant is None:
            raise ValueError(f"no turn boundary: the template prefix holds no eos token (id {self.eos_token_id})")
        tail = self._windowed_tail(messages, last_assistant) if self.windowed and last_assistant > 1 else None
        if tail is None:
            tail = self._tail(messages, last_assistant)
        cut_end = parent.size - 1 if parent[-1] == self.eos_token_id else parent.size
        return np.concatenate([parent[:cut_end], self._encode(tail)])

    def _tail(self, messages: Sequence[Mapping[str, Any]], last_assistant: int) -> str:
        """The text of ``T`` from its n-th eos on, ``n`` = eos count of ``T_pre`` (full renders)."""
        full_text = self._render(messages, generation_prompt=True)
        pre_text = self._render(messages[: last_assistant + 1], generation_prompt=False)
        n = pre_text.count(self.eos_text)  # type: ignore[arg-type]
        if n == 0:
            raise ValueError(f"no turn boundary: the template prefix holds no eos token (id {self.eos_token_id})")
        position = _nth(full_text, self.eos_text, n)  # type: ignore[arg-type]
        if position < 0:
            raise ValueError(
                f"the template prefix holds {n} eos tokens (id {self.eos_token_id}) but the full template "
                f"holds only {full_text.count(self.eos_text)}: no eos #{n} to splice at"  # type: ignore[arg-type]
            )
        return full_text[position:]

    def _windowed_tail(self, messages: Sequence[Mapping[str, Any]], last_assistant: int) -> str | None:
        """The same tail from a window render; None when the window cannot decide it alone."""
        window = [messages[0], *messages[last_assistant:]]
        pre_text = self._render(window[:2], generation_prompt=False)
        head_eos = self._render(window[:1], generation_prompt=False).count(self.eos_text)  # type: ignore[arg-type]
        n = pre_text.count(self.eos_text)  # type: ignore[arg-type]
        if n <= head_eos:
            return None  # the last assistant message closes no turn: the boundary lies before the window
        full_text = self._render(window, generation_prompt=True)
        position = _nth(full_text, self.eos_text, n)  # type: ignore[arg-type]
        return None if position < 0 or not full_text.startswith(pre_text) else full_text[position:]

    def _render(self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool) -> str:
        return render_chat(self.tokenizer, messages, generation_prompt=generation_prompt)

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)


def _nth(text: str, needle: str, n: int) -> int:
    """Index of the n-th (1-based) occurrence of ``needle`` in ``text``, -1 when there are fewer."""
    position = -1
    for _ in range(n):
        position = text.find(needle, position + 1)
        if position < 0:
            return -1
    return position
