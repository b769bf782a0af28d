"""Loading conversations: file shapes, built-in sets, datasets, bad rows and skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.conversations.sources import (
    Conversation,
    DataError,
    SkipLog,
    load_conversations,
    load_many,
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def sharegpt(messages: list[dict]) -> dict:
    return {
        "conversations": [
            {"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages
        ]
    }


def write_jsonl(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def load(spec, **kw) -> list[Conversation]:
    kw.setdefault("skips", SkipLog())
    return load_conversations(str(spec), **kw)


def test_sharegpt_and_openai_shapes_give_the_same_messages(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [sharegpt(MESSAGES)])
    b = tmp_path / "b.json"
    b.write_text(json.dumps([{"messages": MESSAGES}]))
    (conv_a,) = load(a)
    (conv_b,) = load(b)
    assert conv_a.messages == MESSAGES
    assert conv_b.messages == MESSAGES
    # ids: file stem and 1-based line (JSONL) or 0-based index (JSON array)
    assert (conv_a.id, conv_a.row, conv_a.source) == ("a:1", 1, str(a))
    assert (conv_b.id, conv_b.row) == ("b:0", 0)


def test_wrapped_json_prompt_rows_and_blank_lines(tmp_path):
    wrapped = tmp_path / "w.json"
    wrapped.write_text(json.dumps({"data": [{"messages": MESSAGES}, sharegpt(MESSAGES)]}))
    assert [c.id for c in load(wrapped)] == ["w:0", "w:1"]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, "", {"instruction": "go"}])
    convs = load(prompts, require_assistant=False)
    assert [c.messages for c in convs] == [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "go"}],
    ]
    assert [c.row for c in convs] == [1, 3]  # the blank line 2 is ignored but counted


def test_limit_counts_after_skips(tmp_path):
    path = write_jsonl(
        tmp_path / "l.jsonl", [{"messages": []}, {"messages": MESSAGES}, sharegpt(MESSAGES)] * 2
    )
    skips = SkipLog()
    convs = load(path, limit=3, skips=skips)
    assert [c.row for c in convs] == [2, 3, 5]
    assert skips.by_reason() == {"empty_conversation": 2}


def test_mt_bench_first_turns():
    convs = load("mt_bench", require_assistant=False)
    assert len(convs) == 80
    assert len({c.id for c in convs}) == 80
    assert convs[0].id == "mt_bench:81"
    assert all(len(c.messages) == 1 and c.messages[0]["role"] == "user" for c in convs)
    assert convs[0].messages[0]["content"].startswith("Compose an engaging travel blog post")


def test_humaneval_prompts():
    convs = load("humaneval", require_assistant=False)
    assert len(convs) == 164
    assert convs[0].id == "humaneval:HumanEval/0"
    text = convs[0].messages[0]["content"]
    assert text.startswith("Complete the following Python function:\n\n```python\n")
    assert "def has_close_elements" in text and text.endswith("```")


def test_prompt_only_builtins_need_regeneration():
    with pytest.raises(DataError, match="mt_bench holds prompts without replies"):
        load("mt_bench")


def test_hf_save_to_disk_dir(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": MESSAGES}, {"messages": MESSAGES[:3]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "chat"))
    convs = load(f"hf:{tmp_path / 'chat'}")
    assert [c.id for c in convs] == ["chat:0", "chat:1"]
    assert convs[0].messages == MESSAGES and convs[1].messages == MESSAGES[:3]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert len(load(f"hf:{tmp_path / 'dd'}@test")) == 2
    with pytest.raises(DataError, match="no split 'train'"):
        load(f"hf:{tmp_path / 'dd'}")


def test_hf_load_dataset_on_a_jsonl_directory(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    folder = tmp_path / "mixed"
    folder.mkdir()
    # Mixed shapes: `datasets` fills the other shape's keys with None.
    write_jsonl(folder / "part.jsonl", [sharegpt(MESSAGES), {"messages": MESSAGES}])
    convs = load(f"hf:{folder}@train")
    assert [c.messages for c in convs] == [MESSAGES, MESSAGES]
    assert [c.id for c in convs] == ["mixed:0", "mixed:1"]


BAD_ROWS = [
    # (line, field, reason, message fragment)
    ('{"messages": [', "(line)", "malformed_json", "malformed JSON"),
    ("[1, 2]", "(row)", "unknown_shape", "not an object"),
    ({"text": "hello"}, "(row)", "unknown_shape", "none of conversations/messages"),
    (
        {"messages": [{"role": "bot", "content": "x"}]},
        "messages[0].role",
        "unknown_role",
        "unknown role 'bot' (expected system/user/assistant/tool, or ShareGPT human/gpt/system)",
    ),
    (
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 3}]},
        "conversations[1].value",
        "non_string_content",
        "content is int",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content",
        "non_string_content",
        "content is list",
    ),
    # Tool use: each bad shape names its field.
    (
        {"messages": [{"role": "assistant", "content": None, "tool_calls": {"id": "c1"}}]},
        "messages[0].tool_calls",
        "bad_tool_call",
        "is a dict, not a list of calls",
    ),
    (
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]},
        "messages[0].tool_calls[0].function",
        "bad_tool_call",
        "is null, not an object",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
        "messages[0].tool_calls[0].function.name",
        "bad_tool_call",
        "is None, not a name",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{city: 1"}}],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
        "bad_tool_call",
        "is not valid JSON",
    ),
    (
        {"messages": [{"role": "user", "content": "q", "tool_calls": []}]},
        "messages[0].tool_calls",
        "bad_tool_call",
        "on a 'user' message",
    ),
    (
        {"messages": [{"role": "tool", "tool_call_id": 7, "content": "x"}]},
        "messages[0].tool_call_id",
        "non_string_content",
        "is int, not a string",
    ),
    (
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"parameters": {}}}]},
        "tools[0].function.name",
        "bad_tool",
        "is None, not a name",
    ),
    (
        {"messages": MESSAGES, "tools": {"name": "f"}},
        "tools",
        "bad_tool",
        "is a dict, not a list of tools",
    ),
]


def test_tool_rows_are_normalised_as_vllm_hands_them_to_the_template(tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    row = {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "r"},
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "2"},
            {"role": "assistant", "content": "done", "tool_calls": []},
        ],
    }
    (conv,) = load(write_jsonl(tmp_path / "t.jsonl", [row]))
    assert conv.tools == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}}
    ]
    assert conv.messages[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**call, "function": {"name": "f", "arguments": {"x": 1}}}],
            "reasoning": "r",
            "reasoning_content": "r",
        },
        {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "f"},
        {"role": "assistant", "content": "done"},
    ]


@pytest.mark.parametrize("bad, field, reason, fragment", BAD_ROWS)
def test_bad_row_is_a_one_line_error_or_a_counted_skip(tmp_path, bad, field, reason, fragment):
    path = write_jsonl(tmp_path / "x.jsonl", [{"messages": MESSAGES}, "", bad, sharegpt(MESSAGES)])
    with pytest.raises(DataError) as info:
        load(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:3: field '{field}': ")
    assert fragment in message
    assert info.value.reason == reason

    skips = SkipLog()
    convs = load(path, bad_rows="skip", skips=skips)
    assert [c.row for c in convs] == [1, 4]
    assert skips.by_reason() == {reason: 1}
    assert skips.rows[0]["id"] == "x:3" and skips.rows[0]["row"] == 3


def test_bad_element_in_json_array_names_its_index(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([{"messages": MESSAGES}, {"messages": [{"role": "robot"}]}]))
    with pytest.raises(DataError, match=r"arr\.json:1: field 'messages\[0\]\.role'"):
        load(path)


def test_empty_and_assistantless_conversations_are_counted_skips(tmp_path):
    rows = [
        {"messages": []},
        {"conversations": []},
        {"prompt": "  "},
        {"messages": MESSAGES[:2]},
        {"messages": MESSAGES},
    ]
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    skips = SkipLog()
    convs = load(path, skips=skips)  # bad_rows="error": these are skips, not errors
    assert [c.row for c in convs] == [5]
    assert skips.to_dict()["by_reason"] == {"empty_conversation": 3, "no_assistant_turn": 1}
    assert skips.count == 4
    # Regeneration mode keeps conversations that end without an assistant turn.
    skips = SkipLog()
    assert [c.row for c in load(path, require_assistant=False, skips=skips)] == [4, 5]
    assert skips.by_reason() == {"empty_conversation": 3}


def test_skip_log_caps_rows_but_counts_exactly():
    skips = SkipLog()
    for i in range(1005):
        skips.add("data/big.jsonl", i, "too_long", id=f"big:{i}")
    conv = Conversation("c:1", [], "c.jsonl", 1)
    skips.add(conv, None, "empty_conversation", "detail here")
    out = skips.to_dict()
    assert out["count"] == 1006
    assert out["by_reason"] == {"empty_conversation": 1, "too_long": 1005}
    assert len(out["rows"]) == 1000
    assert out["rows"][0] == {
        "source": "data/big.jsonl",
        "row": 0,
        "id": "big:0",
        "reason": "too_long",
    }


def test_missing_file_lists_accepted_forms(tmp_path):
    with pytest.raises(DataError) as info:
        load(tmp_path / "nope.jsonl")
    message = str(info.value)
    assert "nope.jsonl does not exist" in message
    assert "hf:" in message and "mt_bench" in message and "humaneval" in message
    assert "sharegpt[:full|:code|:long][@train|@heldout]" in message
    with pytest.raises(DataError, match="does not exist"):
        load("mt-bench")  # a typo of a built-in is not silently a file


def test_load_many_concatenates_and_rejects_duplicate_ids(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": MESSAGES}])
    other = tmp_path / "sub"
    other.mkdir()
    b = write_jsonl(other / "b.jsonl", [{"messages": MESSAGES}] * 2)
    convs = load_many([str(a), str(b)], skips=SkipLog())
    assert [c.id for c in convs] == ["a:1", "b:1", "b:2"]
    dup = write_jsonl(other / "a.jsonl", [{"messages": MESSAGES}])  # same stem as `a`
    with pytest.raises(DataError, match="duplicate id 'a:1'"):
        load_many([str(a), str(dup)], skips=SkipLog())
