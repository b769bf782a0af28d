"""Chat template rendering and loss masks, on SmolLM2's real tokenizer and template."""

from __future__ import annotations

import json

import pytest

from draftsmith.sources import SkipLog, load_conversations
from draftsmith.template import (
    Rendered,
    TemplateError,
    render_conversation,
    render_prompt,
)

SYSTEM = "Answer in one short sentence."
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven is prime."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "Two is the only even prime."},
]
END = "<|im_end|>"


def masked_runs(tokenizer, rendered: Rendered) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for tok, m in zip(rendered.input_ids, rendered.loss_mask, strict=True):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def unmasked_text(tokenizer, rendered: Rendered) -> str:
    ids = [t for t, m in zip(rendered.input_ids, rendered.loss_mask, strict=True) if not m]
    return tokenizer.decode(ids)


@pytest.mark.parametrize("shape", ["sharegpt", "openai"])
def test_multi_turn_mask_covers_exactly_the_assistant_turns(tokenizer, tmp_path, shape):
    if shape == "sharegpt":
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        row = {
            "conversations": [{"from": names[m["role"]], "value": m["content"]} for m in MESSAGES]
        }
    else:
        row = {"messages": MESSAGES}
    path = tmp_path / f"{shape}.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (conv,) = load_conversations(str(path), skips=SkipLog())

    rendered = render_conversation(tokenizer, conv.messages)
    assert len(rendered.input_ids) == len(rendered.loss_mask)
    assert masked_runs(tokenizer, rendered) == [
        "Seven is prime." + END,
        "Two is the only even prime." + END,
    ]
    rest = unmasked_text(tokenizer, rendered)
    for text in (SYSTEM, "Name a prime number.", "And an even one?"):
        assert text in rest
    # The user turn between the two replies is unmasked, token by token.
    user_ids = tokenizer("And an even one?", add_special_tokens=False)["input_ids"]
    ids = rendered.input_ids
    at = next(i for i in range(len(ids)) if ids[i : i + len(user_ids)] == user_ids)
    assert rendered.loss_mask[at : at + len(user_ids)] == [0] * len(user_ids)


def test_ids_are_the_full_render_tokenised_once(tokenizer):
    rendered = render_conversation(tokenizer, MESSAGES)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert rendered.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert rendered.input_ids.count(tokenizer.bos_token_id) <= text.count(tokenizer.bos_token)
    # The newline the template writes after the final <|im_end|> is never generated.
    assert tokenizer.decode(rendered.input_ids[-1]) == "\n"
    assert rendered.loss_mask[-2:] == [1, 0]


def test_injected_default_system_prompt_is_not_masked(tokenizer):
    rendered = render_conversation(tokenizer, MESSAGES[1:])
    assert "You are a helpful AI assistant named SmolLM" in unmasked_text(tokenizer, rendered)
    assert masked_runs(tokenizer, rendered)[0] == "Seven is prime." + END


def test_empty_reply_still_trains_the_end_token(tokenizer):
    messages = [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]
    assert masked_runs(tokenizer, render_conversation(tokenizer, messages)) == [END]


def test_conversation_ending_with_a_user_turn_masks_only_earlier_replies(tokenizer):
    rendered = render_conversation(tokenizer, MESSAGES[:4])
    assert masked_runs(tokenizer, rendered) == ["Seven is prime." + END]


def test_render_prompt_ends_with_the_generation_prompt(tokenizer):
    prompt = render_prompt(tokenizer, MESSAGES[:2])
    assert isinstance(prompt, list)
    assert tokenizer.decode(prompt).endswith(
        "Name a prime number.<|im_end|>\n<|im_start|>assistant\n"
    )
    # Here the prompt's tokens are a prefix of the full conversation's tokens.
    full = render_conversation(tokenizer, MESSAGES[:3])
    assert full.input_ids[: len(prompt)] == prompt
    assert not any(full.loss_mask[: len(prompt)]) and all(full.loss_mask[len(prompt) : -1])


def test_render_prompt_with_mask_covers_earlier_replies(tokenizer):
    rendered = render_prompt(tokenizer, MESSAGES[:4], with_mask=True)
    assert isinstance(rendered, Rendered)
    assert masked_runs(tokenizer, rendered) == ["Seven is prime." + END]
    assert tokenizer.decode(rendered.input_ids).endswith("<|im_start|>assistant\n")
    assert rendered.loss_mask[-1] == 0


def test_render_prompt_needs_a_final_user_turn(tokenizer):
    with pytest.raises(TemplateError, match="not a user turn"):
        render_prompt(tokenizer, MESSAGES[:3])


def test_missing_chat_template_is_an_error_with_a_fix(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(TemplateError, match="no chat template.*chat_template"):
        render_conversation(tokenizer, MESSAGES)


def test_template_that_is_not_prefix_stable_names_the_message(tokenizer, monkeypatch):
    # Like "thinking" templates: earlier replies are rendered shortened, the last in full.
    template = (
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.role == 'assistant' and not loop.last %}{{ m.content[:3] }}"
        "{% else %}{{ m.content }}{% endif %}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    monkeypatch.setattr(tokenizer, "chat_template", template)
    with pytest.raises(TemplateError, match=r"not prefix-stable at messages\[2\]"):
        render_conversation(tokenizer, MESSAGES)


def test_token_straddling_the_turn_start_is_not_masked(tokenizer, monkeypatch):
    # The generation prompt ends in a space that the tokenizer joins to the reply's
    # first word (" Seven"): that token starts in the prompt, so it is not masked.
    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    monkeypatch.setattr(tokenizer, "chat_template", template)
    rendered = render_conversation(tokenizer, MESSAGES[1:3])
    assert masked_runs(tokenizer, rendered) == [" is prime."]


def test_template_exception_becomes_a_template_error(tokenizer, monkeypatch):
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    monkeypatch.setattr(tokenizer, "chat_template", template)
    with pytest.raises(TemplateError, match="roles must alternate"):
        render_conversation(tokenizer, MESSAGES)
