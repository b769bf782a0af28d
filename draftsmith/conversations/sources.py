"""Conversations in: JSON / JSONL files, Hugging Face datasets, MT-Bench, HumanEval, ShareGPT.

Every source becomes a list of :class:`Conversation` whose messages are plain
``{"role": "system" | "user" | "assistant", "content": str}`` dicts. Rows may be in
the ShareGPT shape (``{"conversations": [{"from": "human", "value": ...}]}``), the
OpenAI shape (``{"messages": [{"role": "user", "content": ...}]}``), or prompt-only
(``{"prompt": ...}`` / ``{"instruction": ...}``, a single user turn). OpenAI rows may
also hold tool calls, tool messages and a ``tools`` list (see :mod:`.rows`).

Built-in sets: ``mt_bench`` (80 first turns), ``humaneval`` (164 problems) and
``sharegpt[:full|:code][@train|@heldout]`` (de-duplicated ShareGPT first turns; with
``:full`` whole conversations, with ``:code`` the first turns about programming;
``@heldout`` is a fixed 2% slice training never sees; see
:mod:`draftsmith.conversations.sharegpt`) and ``sharegpt:long[@train|@heldout]`` (whole
conversations with the corpus's chunks joined back, for long contexts; see
:mod:`draftsmith.conversations.longctx`). Prompt-only sets need the target to write the
replies.

A bad row either stops loading with a one-line :class:`DataError` naming the file, row
and field, or (``bad_rows="skip"``) is counted in a :class:`SkipLog` by reason.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

from draftsmith.conversations import longctx, prompt_sets, sharegpt
from draftsmith.conversations.rows import (
    Conversation,
    DataError,
    Rows,
    SkipLog,
    decode_text,
    jsonl_rows,
    parse_row,
    parse_tools,
)

FORMS = (
    "a .json/.jsonl file (optionally .gz), hf:<hub id or directory>[@split], mt_bench, "
    "humaneval, sharegpt[:full|:code|:long][@train|@heldout]"
)


def load_conversations(
    spec: str,
    *,
    bad_rows: str = "error",
    require_assistant: bool = True,
    limit: int | None = None,
    skips: SkipLog,
    encoding: str = "utf-8",
) -> list[Conversation]:
    """Load the conversations of one source `spec` (see the module docstring / :data:`FORMS`).

    `bad_rows` is ``"error"`` (raise :class:`DataError`) or ``"skip"`` (count in `skips`).
    Empty conversations, and with `require_assistant` those without an assistant turn,
    are always counted skips. `limit` caps the number returned (after skips). `encoding`
    is the text encoding of JSON / JSONL files.
    """
    if bad_rows not in ("error", "skip"):
        raise DataError(f"bad_rows: {bad_rows!r} is not a choice; use 'error' or 'skip'.")
    if limit is not None and limit < 0:
        raise DataError(f"limit: {limit} is negative; give a number of conversations >= 0.")

    source = spec
    if longctx.is_long(spec):
        rows = longctx.rows(spec, skips, bad_rows)
    elif spec.partition("@")[0].partition(":")[0] == "sharegpt":
        full, _split = sharegpt.parse_spec(spec)
        if require_assistant and not full:
            raise _prompts_only(spec, "; or use sharegpt:full for its own replies")
        rows = sharegpt.rows(spec, skips, bad_rows)
    elif spec in ("mt_bench", "humaneval"):
        if require_assistant:
            raise _prompts_only(spec)
        rows = prompt_sets.mt_bench_rows() if spec == "mt_bench" else prompt_sets.humaneval_rows()
    elif spec.startswith("hf:"):
        source, rows = spec, prompt_sets.hf_rows(spec)
    else:
        source = str(Path(spec))
        rows = _file_rows(Path(spec), encoding)
    out: list[Conversation] = []
    for row, conv_id, record in rows:
        if limit is not None and len(out) >= limit:
            break
        try:
            if isinstance(record, DataError):
                raise record
            messages = parse_row(record, source, row)
            tools = parse_tools(record, source, row)
        except DataError as err:
            if bad_rows == "error":
                raise
            skips.add(source, row, err.reason, str(err), id=conv_id)
            continue
        conv = Conversation(conv_id, messages, source, row, tools)
        if not messages:
            skips.add(conv, row, "empty_conversation")
        elif require_assistant and not any(m["role"] == "assistant" for m in messages):
            skips.add(conv, row, "no_assistant_turn")
        else:
            out.append(conv)
    return out


def load_many(specs: list[str], **kw: Any) -> list[Conversation]:
    """Concatenate :func:`load_conversations` over `specs`; ids must stay unique."""
    out: list[Conversation] = []
    seen: dict[str, str] = {}
    for spec in specs:
        for conv in load_conversations(spec, **kw):
            if conv.id in seen:
                raise DataError(
                    f"{conv.source}:{conv.row}: duplicate id {conv.id!r}, also given by "
                    f"{seen[conv.id]}; list each source once and give files distinct names."
                )
            seen[conv.id] = conv.source
            out.append(conv)
    return out


def _prompts_only(spec: str, more: str = "") -> DataError:
    return DataError(
        f"data: {spec} holds prompts without replies; regenerate them "
        f"(regenerate: true / require_assistant=False){more}."
    )


def _label(path: Path) -> str:
    """File stem without .json/.jsonl/.gz suffixes: ``data/chat.jsonl.gz`` -> ``chat``."""
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def _file_rows(path: Path, encoding: str = "utf-8") -> Rows:
    if not path.is_file():
        raise DataError(f"data: {path} does not exist (or is not a file); accepted: {FORMS}")
    name = path.name.removesuffix(".gz")
    if not name.endswith((".json", ".jsonl")):
        raise DataError(f"data: {path} is neither .json nor .jsonl; accepted: {FORMS}")
    opener = gzip.open if path.name.endswith(".gz") else open
    if name.endswith(".jsonl"):
        return jsonl_rows(path, opener, _label(path), encoding)
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as err:  # a .gz cut short, not gzip at all
        raise DataError(f"{path}: cannot be read ({type(err).__name__}: {err}); "
                        "give a whole .json or .json.gz file") from None  # fmt: skip
    try:
        data = json.loads(decode_text(raw, path, encoding))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from err
    if isinstance(data, dict):
        data = _unwrap(data, path)
    if not isinstance(data, list):
        raise DataError(f"{path}: holds a {type(data).__name__}; expected a JSON array of rows")
    label = _label(path)
    return ((i, f"{label}:{i}", record) for i, record in enumerate(data))


def _unwrap(data: dict, path: Path) -> Any:
    """The row list of ``{"data": [...]}`` or ``{"conversations": [...]}``."""
    if isinstance(data.get("data"), list):
        return data["data"]
    rows = data.get("conversations")
    row_keys = ("conversations", "messages", "prompt", "instruction")
    if isinstance(rows, list) and all(
        isinstance(r, dict) and any(k in r for k in row_keys) for r in rows
    ):
        return rows
    raise DataError(
        f"{path}: is one JSON object; expected an array of rows, or rows under 'data' "
        "or 'conversations' (a single conversation must be wrapped in [ ])"
    )
