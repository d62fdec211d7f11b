"""Prefix splicing (docs/architecture.md §6): the pure rule, its properties, and the real SmolLM2 template."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.capture.splice import render_chat_ids, replace_prefix_tokens, splice_chat_prompt

EOS = 2


# --- the pure rule ------------------------------------------------------------------------


def test_architecture_example_reproduces() -> None:
    parent = [11, 12, 13, 40, 41, 220, 17, 2]
    template_prefix = [1, 1000, 1001, 2]
    template = [1, 1000, 1001, 2, 21, 22, 40, 41]
    result = replace_prefix_tokens(parent, template_prefix, template, eos_token_id=2)
    assert result == [11, 12, 13, 40, 41, 220, 17, 2, 21, 22, 40, 41]


def test_empty_parent_gives_the_full_template() -> None:
    template = [5, 6, 2, 7]
    assert replace_prefix_tokens([], [], template, eos_token_id=EOS) == template


def test_parent_without_trailing_eos_is_kept_whole_and_gets_the_template_eos() -> None:
    # A generation stopped on length: nothing of the parent is cut, the turn is closed by T's eos.
    result = replace_prefix_tokens([9, 8, 7], [1, 2], [1, 2, 3, 4], eos_token_id=EOS)
    assert result == [9, 8, 7, 2, 3, 4]


def test_template_prefix_without_eos_is_refused_as_no_turn_boundary() -> None:
    with pytest.raises(ValueError, match="no turn boundary"):
        replace_prefix_tokens([9, 2], [1, 3], [1, 3, 2, 4], eos_token_id=EOS)


def test_template_with_too_few_eos_is_refused_naming_both_counts() -> None:
    with pytest.raises(ValueError, match=r"holds 2 eos tokens .* holds only 1"):
        replace_prefix_tokens([9, 2], [1, 2, 3, 2], [1, 2, 3], eos_token_id=EOS)


def test_boundary_is_found_by_counting_eos_not_by_position() -> None:
    # The history render keeps a <think> block (ids 70..72) that the full render drops, so the
    # boundary sits at different positions in T_pre and T; the second eos of T is still the one.
    template_prefix = [1, 50, 2, 1, 70, 71, 72, 60, 2]
    template = [1, 50, 2, 1, 60, 2, 1, 80, 2, 1, 90]
    result = replace_prefix_tokens([33, 34, 2], template_prefix, template, eos_token_id=EOS)
    assert result == [33, 34, 2, 1, 80, 2, 1, 90]


def test_numpy_arrays_are_accepted_and_plain_ints_returned() -> None:
    result = replace_prefix_tokens(
        np.array([11, 2], dtype=np.int64), np.array([1, 2]), np.array([1, 2, 5], dtype=np.uint64), eos_token_id=EOS
    )
    assert result == [11, 2, 5]
    assert all(type(token) is int for token in result)


def test_float_token_ids_are_refused() -> None:
    with pytest.raises(TypeError):
        replace_prefix_tokens([1.0, 2.0], [1, 2], [1, 2, 3], eos_token_id=EOS)


_tokens = st.lists(st.integers(min_value=0, max_value=6), max_size=12)


@st.composite
def splice_inputs(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], int]:
    """A non-empty parent, a history render with n >= 1 eos, a full render with at least n eos."""
    parent = draw(_tokens.filter(bool))
    n = draw(st.integers(min_value=1, max_value=4))
    extra = draw(st.integers(min_value=0, max_value=2))
    template_prefix = draw(_segments(n))
    template = draw(_segments(n + extra))
    return parent, template_prefix, template, n


def _segments(count: int) -> st.SearchStrategy[list[int]]:
    """Token lists holding exactly ``count`` eos, separated by eos-free runs."""
    no_eos = st.lists(st.integers(min_value=3, max_value=9), max_size=4)
    return st.lists(no_eos, min_size=count + 1, max_size=count + 1).map(
        lambda runs: [t for i, run in enumerate(runs) for t in ([*run, EOS] if i < count else run)]
    )


@given(splice_inputs())
def test_property_result_is_parent_then_template_from_its_nth_eos(
    inputs: tuple[list[int], list[int], list[int], int],
) -> None:
    parent, template_prefix, template, n = inputs
    result = replace_prefix_tokens(parent, template_prefix, template, eos_token_id=EOS)
    cut_end = len(parent) - 1 if parent[-1] == EOS else len(parent)
    nth_eos = [i for i, t in enumerate(template) if t == EOS][n - 1]
    assert result[:cut_end] == parent[:cut_end]
    assert result[cut_end:] == template[nth_eos:]
    assert result[: len(parent)] == parent  # the parent's exact tokens always survive whole


@given(_tokens.filter(bool), st.integers(min_value=1, max_value=4), st.data())
def test_property_template_with_fewer_eos_than_history_is_refused(
    parent: list[int], n: int, data: st.DataObject
) -> None:
    template_prefix = data.draw(_segments(n))
    template = data.draw(_segments(data.draw(st.integers(min_value=0, max_value=n - 1))))
    with pytest.raises(ValueError, match=f"holds {n} eos tokens"):
        replace_prefix_tokens(parent, template_prefix, template, eos_token_id=EOS)


# --- the real SmolLM2 chat template -------------------------------------------------------


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _non_canonical_reply(tokenizer: Any) -> list[int]:
    """Sampled ids for "hello there" that split "hello" into "hel" + "lo", then the eos."""
    return [
        *_encode(tokenizer, "hel"),
        *_encode(tokenizer, "lo"),
        *_encode(tokenizer, " there"),
        tokenizer.eos_token_id,
    ]


def test_sampled_ids_do_not_survive_decode_and_reencode(smollm2_tokenizer: Any) -> None:
    sampled = _non_canonical_reply(smollm2_tokenizer)[:-1]
    text = smollm2_tokenizer.decode(sampled)
    assert text == "hello there"
    assert _encode(smollm2_tokenizer, text) != sampled


def test_spliced_prompt_keeps_the_sampled_ids_and_continues_with_the_template(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    first = [{"role": "user", "content": "hi"}]
    root_prompt = splice_chat_prompt(tok, first, [])
    assert root_prompt == render_chat_ids(tok, first, generation_prompt=True)
    sampled = _non_canonical_reply(tok)
    parent = root_prompt + sampled
    history = [*first, {"role": "assistant", "content": tok.decode(sampled, skip_special_tokens=True)}]
    messages = [*history, {"role": "user", "content": "again"}]

    prompt = splice_chat_prompt(tok, messages, parent)

    assert prompt[: len(parent)] == parent
    assert prompt[len(parent) :] == _encode(tok, "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    retokenized = render_chat_ids(tok, messages, generation_prompt=True)
    assert prompt != retokenized  # the naive render would have trained on ids the model never sampled
    assert tok.decode(prompt) == tok.decode(retokenized)


def test_spliced_prompt_equals_the_section_6_definition(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    parent = [*render_chat_ids(tok, [{"role": "user", "content": "hi"}], generation_prompt=True)]
    parent += _non_canonical_reply(tok)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "and now?"},
    ]
    expected = replace_prefix_tokens(
        parent,
        render_chat_ids(tok, messages[:2], generation_prompt=False),
        render_chat_ids(tok, messages, generation_prompt=True),
        eos_token_id=tok.eos_token_id,
    )
    assert splice_chat_prompt(tok, messages, parent) == expected


def test_three_turn_chain_keeps_every_earlier_turn_exactly(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    system = {"role": "system", "content": "Answer tersely."}
    turn1 = _non_canonical_reply(tok)
    turn2 = [*_encode(tok, " o"), *_encode(tok, "k"), tok.eos_token_id]
    assert _encode(tok, tok.decode(turn2[:-1])) != turn2[:-1]
    messages: list[dict[str, str]] = [system, {"role": "user", "content": "hi"}]
    prompt1 = splice_chat_prompt(tok, messages, [])
    parent1 = prompt1 + turn1
    messages += [{"role": "assistant", "content": tok.decode(turn1[:-1])}, {"role": "user", "content": "more"}]
    prompt2 = splice_chat_prompt(tok, messages, parent1)
    parent2 = prompt2 + turn2
    messages += [{"role": "assistant", "content": tok.decode(turn2[:-1])}, {"role": "user", "content": "bye"}]

    prompt3 = splice_chat_prompt(tok, messages, parent2)

    assert prompt3[: len(parent2)] == parent2
    assert prompt3[: len(prompt1)] == prompt1
    assert prompt3[len(prompt1) : len(prompt1) + len(turn1)] == turn1
    assert prompt3[len(parent2) :] == _encode(tok, "\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n")


def test_parent_cut_by_length_is_closed_with_the_template_eos(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    first = [{"role": "user", "content": "hi"}]
    parent = splice_chat_prompt(tok, first, []) + _non_canonical_reply(tok)[:-1]  # no eos: stopped on length
    messages = [*first, {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "go on"}]

    prompt = splice_chat_prompt(tok, messages, parent)

    assert prompt[: len(parent)] == parent
    assert prompt[len(parent)] == tok.eos_token_id


def test_child_without_an_assistant_turn_in_its_history_is_refused(smollm2_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="no turn boundary"):
        splice_chat_prompt(smollm2_tokenizer, [{"role": "user", "content": "hi"}], [1, 2, 3, 2])
