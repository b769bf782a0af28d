"""Planning samples for templates that render earlier turns differently, and tool rows."""

from __future__ import annotations

import pytest
from chat_templates import QWEN3_LIKE

from draftsmith.conversations.sources import Conversation, SkipLog
from draftsmith.conversations.template import render_conversation, render_turns
from draftsmith.core.errors import ConfigError
from draftsmith.extract.config import ExtractConfig
from draftsmith.extract.records import Item, common_prefix
from draftsmith.extract.sample_plan import plan_items, shard_ids, shard_items


def two_rounds(i: int) -> list[dict]:
    return [
        {"role": "user", "content": f"Question {i}?"},
        {"role": "assistant", "content": f"<think>\nThinking {i}.\n</think>\n\nAnswer {i}."},
        {"role": "user", "content": f"Follow-up {i}?"},
        {"role": "assistant", "content": f"<think>\nMore {i}.\n</think>\n\nSecond answer {i}."},
    ]


ONE_ROUND = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]


@pytest.fixture()
def qwen3_like(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", QWEN3_LIKE)
    return tokenizer


def test_each_turn_of_a_reasoning_conversation_is_its_own_sample(qwen3_like):
    tok = qwen3_like
    convs = [Conversation("c:0", two_rounds(0), "c", 0), Conversation("c:1", ONE_ROUND, "c", 1)]
    items = plan_items(convs, tok, ExtractConfig(data=["c"]), SkipLog())
    assert [(it.id, it.turn) for it in items] == [("c:0#1", 1), ("c:0#2", 2), ("c:1", None)]
    turns = render_turns(tok, two_rounds(0))
    assert [it.input_ids for it in items[:2]] == [t.input_ids for t in turns]
    assert [it.loss_mask for it in items[:2]] == [t.loss_mask for t in turns]
    # The second turn repeats the first turn's prompt (its reply is rendered shorter there).
    assert items[0].shared == 0 and items[1].shared == common_prefix(*[t.input_ids for t in turns])
    assert 0 < items[1].shared < len(items[0].input_ids)
    # A single round is prefix-stable: one sample, as before.
    assert items[2].input_ids == render_conversation(tok, ONE_ROUND).input_ids
    assert shard_ids(items, 2) == [["c:0#1", "c:0#2"], ["c:1"]]


def test_keep_reasoning_false_trains_the_answers_only(qwen3_like):
    convs = [Conversation("c:0", two_rounds(0), "c", 0)]
    cfg = ExtractConfig(data=["c"], keep_reasoning=False)
    items = plan_items(convs, qwen3_like, cfg, SkipLog())
    trained = [
        qwen3_like.decode([t for t, m in zip(it.input_ids, it.loss_mask, strict=True) if m])
        for it in items
    ]
    assert trained == ["\n\nAnswer 0.<|im_end|>", "\n\nSecond answer 0.<|im_end|>"]
    assert "Thinking 0" in qwen3_like.decode(items[0].input_ids)  # still in the sample


def test_limit_counts_conversations_not_turn_samples(qwen3_like):
    convs = [Conversation(f"c:{i}", two_rounds(i), "c", i) for i in range(3)]
    items = plan_items(convs, qwen3_like, ExtractConfig(data=["c"], limit=2), SkipLog())
    assert [it.id for it in items] == ["c:0#1", "c:0#2", "c:1#1", "c:1#2"]


def test_overlong_turn_samples_are_skipped_one_by_one(qwen3_like):
    turns = render_turns(qwen3_like, two_rounds(0))
    cfg = ExtractConfig(data=["c"], max_length=len(turns[0].input_ids), overlong="skip")
    skips = SkipLog()
    items = plan_items([Conversation("c:0", two_rounds(0), "c", 0)], qwen3_like, cfg, skips)
    assert [it.id for it in items] == ["c:0#1"]
    assert skips.by_reason() == {"too_long": 1} and skips.rows[0]["id"] == "c:0#2"


def test_regeneration_plans_a_sample_per_round_when_the_template_needs_it(tokenizer, qwen3_like):
    convs = [
        Conversation("c:0", two_rounds(0), "c", 0),
        Conversation("c:1", ONE_ROUND, "c", 1),
        Conversation(
            "c:2",
            [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "w", "arguments": {}}}
                    ],
                },
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."},
            ],
            "c",
            2,
        ),
    ]
    cfg = ExtractConfig(data=["c"], regenerate=True)
    items = plan_items(convs, qwen3_like, cfg, SkipLog())
    assert [it.sample_ids() for it in items] == [["c:0#1", "c:0#2"], ["c:1"], ["c:2"]]
    assert items[0].rounds == 2 and not items[0].input_ids  # the target answers both rounds
    assert items[2].input_ids  # tool calls cannot be regenerated: the replies are kept
    by_sample = {sid: it for it in items for sid in it.sample_ids()}
    assert shard_items(["c:0#1", "c:0#2", "c:1"], by_sample) == items[:2]


def test_regeneration_keeps_one_sample_for_a_prefix_stable_template(tokenizer):
    convs = [Conversation("c:0", two_rounds(0), "c", 0)]  # SmolLM2's ChatML template
    (item,) = plan_items(convs, tokenizer, ExtractConfig(data=["c"], regenerate=True), SkipLog())
    assert isinstance(item, Item) and item.rounds == 0 and item.sample_ids() == ["c:0"]


def test_chat_template_kwargs_that_vllm_sets_itself_are_refused():
    with pytest.raises(ConfigError, match=r"chat_template_kwargs: \['add_generation_prompt'\]"):
        ExtractConfig(data=["c"], chat_template_kwargs={"add_generation_prompt": False})
