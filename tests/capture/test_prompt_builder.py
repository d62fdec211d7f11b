"""ChatPromptBuilder equals the section-6 definition on the real SmolLM2 chat template."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.capture.splice import ChatPromptBuilder, is_message_local, render_chat_ids, splice_chat_prompt

texts = st.text(alphabet=st.sampled_from(list("ab cdé1 2.\n!?<|>")), min_size=0, max_size=20)


@st.composite
def conversations(draw):
    """A chat with at least one assistant turn and the parent's exact tokens for it."""
    turns = draw(st.integers(1, 6))
    messages = [{"role": "user", "content": draw(texts)}]
    for _ in range(turns):
        messages.append({"role": "assistant", "content": draw(texts)})
        messages.append({"role": draw(st.sampled_from(["user", "tool"])), "content": draw(texts)})
    return messages, draw(st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=conversations())
def test_builder_equals_the_token_level_definition(smollm2_tokenizer, case):
    messages, parent_ends_on_eos = case
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    history = render_chat_ids(smollm2_tokenizer, messages[: last_assistant + 1], generation_prompt=False)
    parent = history if parent_ends_on_eos else history[:-2]  # a parent cut off before its eos
    builder = ChatPromptBuilder(smollm2_tokenizer)
    assert builder.eos_text == "<|im_end|>"
    assert builder.windowed
    expected = splice_chat_prompt(smollm2_tokenizer, messages, parent)
    assert builder.prompt(messages, parent).tolist() == expected


def test_builder_root_prompt_is_the_full_render(smollm2_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    prompt = ChatPromptBuilder(smollm2_tokenizer).prompt(messages, [])
    assert prompt.tolist() == render_chat_ids(smollm2_tokenizer, messages, generation_prompt=True)


def test_builder_keeps_sampled_ids_that_re_encoding_would_change(smollm2_tokenizer):
    tok = smollm2_tokenizer
    sampled = [*tok.encode("hel", add_special_tokens=False), *tok.encode("lo", add_special_tokens=False)]
    assert tok.encode(tok.decode(sampled), add_special_tokens=False) != sampled
    head = render_chat_ids(tok, [{"role": "user", "content": "Say hello"}], generation_prompt=True)
    parent = np.array([*head, *sampled, tok.eos_token_id])
    messages = [
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Again"},
    ]
    prompt = ChatPromptBuilder(tok).prompt(messages, parent)
    assert prompt[: parent.size].tolist() == parent.tolist()


def test_builder_refuses_a_history_without_a_turn_boundary(smollm2_tokenizer):
    with pytest.raises(ValueError, match="no turn boundary"):
        ChatPromptBuilder(smollm2_tokenizer).prompt([{"role": "user", "content": "x"}], [1, 2, 3])


@pytest.mark.parametrize(
    ("template", "local"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", True),
        ("{% for m in messages %}{% if loop.first %}S{% endif %}{{ m['content'] }}{% endfor %}", True),
        ("{{ messages[0]['role'] }}{% for m in messages %}{{ m['content'] }}{% endfor %}", True),
        ("{% for m in messages %}{{ m['content'] }}{% if loop.last %}L{% endif %}{% endfor %}", False),
        ("{% for m in messages %}{{ loop.index }}{{ m['content'] }}{% endfor %}", False),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages[-1]['role'] }}", False),
        ("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
        ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}", False),
        ("{% for m in messages %}a{% endfor %}{% for m in messages %}b{% endfor %}", False),
        ("{% for m in messages[1:] %}{{ m['content'] }}{% endfor %}", False),
        ("{% for m in messages %}{% generation %}x{% endgeneration %}{% endfor %}", False),
        ("{% for m in messages %}", False),
    ],
)
def test_message_locality_is_decided_on_the_template_ast(template, local):
    assert is_message_local(template) is local


def test_a_non_local_template_still_equals_the_definition(smollm2_tokenizer):
    """Fallback path: a template that numbers turns renders the whole history, correctly."""

    class Numbered:
        eos_token_id = smollm2_tokenizer.eos_token_id
        chat_template = (
            "{% for m in messages %}<|im_start|>{{ loop.index }} {{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )

        def apply_chat_template(self, conversation, **kwargs):
            return smollm2_tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, **kwargs)

        def encode(self, text, **kwargs):
            return smollm2_tokenizer.encode(text, **kwargs)

        def convert_ids_to_tokens(self, ids):
            return smollm2_tokenizer.convert_ids_to_tokens(ids)

    tokenizer = Numbered()
    builder = ChatPromptBuilder(tokenizer)
    assert not builder.windowed
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
    ]
    parent = render_chat_ids(tokenizer, messages[:4], generation_prompt=False)
    assert builder.prompt(messages, parent).tolist() == splice_chat_prompt(tokenizer, messages, parent)
