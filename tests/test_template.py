"""Chat template rendering and loss masks, on SmolLM2's real tokenizer and template."""

from __future__ import annotations

import json

import pytest
from chat_templates import HARMONY_LIKE, QWEN3_LIKE, TOOLS_LIKE

from draftsmith.conversations.sources import SkipLog, load_conversations
from draftsmith.conversations.template import (
    NotPrefixStable,
    Rendered,
    TemplateError,
    is_prefix_stable,
    mask_reasoning,
    reasoning_ends,
    render_conversation,
    render_prompt,
    render_turns,
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


THINKING = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "<think>\nSmall ones: 2, 3, 5, 7.\n</think>\n\nSeven."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "<think>\nOnly 2 is even.\n</think>\n\nTwo."},
]


def chat_ids(tokenizer, messages, **kwargs) -> list[int]:
    """What vLLM's chat endpoint feeds the target for `messages`: the template with the
    generation prompt, tokenised without special tokens added."""
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
    )


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_reasoning_template_gives_one_sample_per_turn_as_the_target_sees_it(
    tokenizer, monkeypatch, kwargs
):
    monkeypatch.setattr(tokenizer, "chat_template", QWEN3_LIKE)
    messages = THINKING
    if kwargs:  # without thinking the replies hold no reasoning
        messages = [{**m, "content": m["content"].split("\n\n")[-1]} for m in THINKING]
    assert not is_prefix_stable(tokenizer, messages, kwargs=kwargs)
    with pytest.raises(NotPrefixStable):
        render_conversation(tokenizer, messages, kwargs=kwargs)
    samples = render_turns(tokenizer, messages, kwargs=kwargs)
    assert len(samples) == 2
    for sample, i in zip(samples, (2, 4), strict=True):
        prompt = chat_ids(tokenizer, messages[:i], **kwargs)
        n = len(prompt)
        assert sample.input_ids[:n] == prompt  # exactly the prompt the target reads
        assert sample.loss_mask == [0] * n + [1] * (len(sample.input_ids) - n)
        # The turn as the target writes it (reasoning included), up to its end token.
        assert tokenizer.decode(sample.input_ids[n:]) == messages[i]["content"] + END
        if kwargs:  # the generation prompt opened (and closed) an empty block
            assert tokenizer.decode(prompt).endswith("<think>\n\n</think>\n\n")
    # The second turn's prompt holds the first reply without its reasoning.
    second = tokenizer.decode(samples[1].input_ids)
    assert "Small ones" not in second and "<|im_start|>assistant\nSeven.<|im_end|>" in second


def test_harmony_template_drops_the_analysis_channel_of_earlier_turns(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", HARMONY_LIKE)
    messages = [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven.", "reasoning": "7 is prime."},
        {"role": "user", "content": "An even one?"},
        {"role": "assistant", "content": "Two.", "reasoning": "Only 2."},
    ]
    samples = render_turns(tokenizer, messages)
    for sample, i in zip(samples, (1, 3), strict=True):
        prompt = chat_ids(tokenizer, messages[:i])
        assert sample.input_ids[: len(prompt)] == prompt
        assert tokenizer.decode(sample.input_ids[len(prompt) :]) == (
            f"<|channel|>analysis<|message|>{messages[i]['reasoning']}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{messages[i]['content']}<|return|>"
        )
    assert "7 is prime" not in tokenizer.decode(samples[1].input_ids)
    # keep_reasoning: false keeps the analysis in the sample but out of the loss.
    mask = mask_reasoning(samples[0].input_ids, samples[0].loss_mask, reasoning_ends(tokenizer))
    kept = [t for t, m in zip(samples[0].input_ids, mask, strict=True) if m]
    assert tokenizer.decode(kept) == "Seven.<|return|>"


def test_mask_reasoning_cuts_each_reply_after_its_last_marker(tokenizer):
    rendered = render_conversation(tokenizer, THINKING)  # ChatML: prefix-stable, one row
    mask = mask_reasoning(rendered.input_ids, rendered.loss_mask, reasoning_ends(tokenizer))
    runs = masked_runs(tokenizer, Rendered(rendered.input_ids, mask))
    assert runs == ["\n\nSeven." + END, "\n\nTwo." + END]
    plain = render_conversation(tokenizer, MESSAGES)  # no reasoning: nothing changes
    assert mask_reasoning(plain.input_ids, plain.loss_mask, reasoning_ends(tokenizer)) == (
        plain.loss_mask
    )


TOOL_ROW = {
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
    "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain, 14 C"},
        {"role": "assistant", "content": "Paris is sunny; Rome is rainy."},
    ],
}


def test_tool_calls_are_trained_and_tool_outputs_are_not(tokenizer, monkeypatch, tmp_path):
    monkeypatch.setattr(tokenizer, "chat_template", TOOLS_LIKE)
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(TOOL_ROW) + "\n")
    (conv,) = load_conversations(str(path), skips=SkipLog())
    assert conv.tools[0]["function"]["name"] == "get_weather"
    call = conv.messages[1]
    assert call["content"] == "" and call["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"
    }
    rendered = render_conversation(tokenizer, conv.messages, tools=conv.tools)
    calls = "".join(
        f'\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
        for city in ("Paris", "Rome")
    )
    assert masked_runs(tokenizer, rendered) == [calls + END, "Paris is sunny; Rome is rainy." + END]
    rest = unmasked_text(tokenizer, rendered)
    assert "sunny, 21 C" in rest and "rain, 14 C" in rest and '"name": "get_weather"' in rest
    # The ids equal the template's text with the tools, tokenised once.
    text = tokenizer.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False)
    assert rendered.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    # Per turn (as for a template that is not prefix-stable) the same turns are trained.
    turns = render_turns(tokenizer, conv.messages, tools=conv.tools)
    answer = "Paris is sunny; Rome is rainy." + END
    assert [masked_runs(tokenizer, t) for t in turns] == [[calls + END], [answer]]
    assert turns[1].input_ids[: turns[1].loss_mask.index(1)] == chat_ids(
        tokenizer, conv.messages[:4], tools=conv.tools
    )


@pytest.mark.parametrize("case", ["tools", "qwen3", "qwen3-no-thinking"])
def test_turn_prompts_equal_what_vllms_chat_endpoint_renders(
    tokenizer, monkeypatch, tmp_path, case
):
    """The prompt of each per-turn sample, from our row parsing and rendering, equals the
    prompt vLLM's chat endpoint builds for the same request (its message parsing, tools
    and chat-template kwargs; no engine is started)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import safe_apply_chat_template

    template, row = TOOLS_LIKE, TOOL_ROW
    kwargs = {"enable_thinking": False} if case == "qwen3-no-thinking" else {}
    if case != "tools":
        template, row = QWEN3_LIKE, {"messages": THINKING}
        if kwargs:
            row = {"messages": [{**m, "content": m["content"].split("\n\n")[-1]} for m in THINKING]}
    monkeypatch.setattr(tokenizer, "chat_template", template)
    path = tmp_path / "row.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (conv,) = load_conversations(str(path), skips=SkipLog())
    ours = render_turns(tokenizer, conv.messages, tools=conv.tools, kwargs=kwargs)
    at = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
    assert len(ours) == len(at)

    # Just what vLLM's renderer reads of a text-only model's config.
    model_config = SimpleNamespace(
        multimodal_config=None, enable_prompt_embeds=False, hf_config=SimpleNamespace()
    )
    for sample, i in zip(ours, at, strict=True):
        request = ChatCompletionRequest(
            model="m",
            messages=row["messages"][:i],
            tools=row.get("tools"),
            chat_template_kwargs=kwargs,
        )
        messages, _, _ = parse_chat_messages(request.messages, model_config, "string")
        tools = [t.model_dump() for t in request.tools] if request.tools else None
        chat = request.build_chat_params(template, "auto").get_apply_chat_template_kwargs()
        text = safe_apply_chat_template(
            model_config, tokenizer, messages, tools=tools, **{**chat, "tokenize": False}
        )
        vllm_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert sample.input_ids[: sample.loss_mask.index(1)] == vllm_ids
