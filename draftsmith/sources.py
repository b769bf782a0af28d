"""Conversations in: JSON / JSONL files, Hugging Face datasets, MT-Bench, HumanEval, ShareGPT.

Every source becomes a list of :class:`Conversation` whose messages are plain
``{"role": "system" | "user" | "assistant", "content": str}`` dicts. Rows may be in
the ShareGPT shape (``{"conversations": [{"from": "human", "value": ...}]}``), the
OpenAI shape (``{"messages": [{"role": "user", "content": ...}]}``), or prompt-only
(``{"prompt": ...}`` / ``{"instruction": ...}``, a single user turn).

Built-in sets: ``mt_bench`` (80 first turns), ``humaneval`` (164 problems) and
``sharegpt[:full][@train|@heldout]`` (de-duplicated ShareGPT first turns, or with
``:full`` whole conversations; ``@heldout`` is a fixed 2% slice training never sees; see
:mod:`draftsmith.sharegpt`). Prompt-only sets need the target to write the replies.

A bad row either stops loading with a one-line :class:`DataError` naming the file, row
and field, or (``bad_rows="skip"``) is counted in a :class:`SkipLog` by reason.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError

# Accepted roles (OpenAI and ShareGPT names) -> the role written in messages.
ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
ROLES |= {"human": "user", "gpt": "assistant"}
FORMS = (
    "a .json/.jsonl file (optionally .gz), hf:<hub id or directory>[@split], mt_bench, "
    "humaneval, sharegpt[:full][@train|@heldout]"
)
MAX_SKIP_ROWS = 1000
ROLE_NAMES = "system/user/assistant, or ShareGPT human/gpt/system"
ROW_HINT = "fix the row, or pass bad_rows='skip' to skip and count such rows"


@dataclass
class Conversation:
    """One conversation; `id` is ``f"{label}:{row}"`` and unique across sources."""

    id: str
    messages: list[dict[str, str]]
    source: str
    row: int


class DataError(DraftsmithError):
    """A one-line error naming file, row and field, e.g.

    ``data/x.jsonl:7: field 'messages[2].role': unknown role 'bot' (expected ...); fix ...``
    `reason` is the short reason code under which the row is skipped in skip mode.
    """

    def __init__(self, message: str, reason: str = "error"):
        super().__init__(" ".join(message.split()))
        self.reason = reason

    @classmethod
    def at(cls, source: str, row: int, field: str, problem: str, hint: str, reason: str):
        return cls(f"{source}:{row}: field '{field}': {problem}; {hint}", reason)


@dataclass
class SkipLog:
    """Counts rows skipped and why; recorded later in the dataset manifest."""

    rows: list[dict] = field(default_factory=list)
    """The first :data:`MAX_SKIP_ROWS` skipped rows: source, row, id, reason, detail."""
    count: int = 0
    """Exact number of skipped rows (``rows`` is capped)."""
    truncated: int = 0
    """Conversations cut to the maximum length rather than skipped."""
    counts: Counter = field(default_factory=Counter)

    def add(
        self,
        conv_or_source: Conversation | str,
        row: int | None,
        reason: str,
        detail: str = "",
        *,
        id: str | None = None,
    ) -> None:
        """Count one skipped row.

        A :class:`Conversation` gives source, row and id. A string is the source (or, in
        later stages, the sample id); it doubles as the id unless `id` is given.
        """
        if isinstance(conv_or_source, Conversation):
            source, conv_id = conv_or_source.source, conv_or_source.id
            row = conv_or_source.row if row is None else row
        else:
            source, conv_id = conv_or_source, id if id is not None else conv_or_source
        self.count += 1
        self.counts[reason] += 1
        if len(self.rows) < MAX_SKIP_ROWS:
            entry = {"source": source, "row": row, "id": conv_id, "reason": reason}
            self.rows.append({**entry, "detail": detail} if detail else entry)

    def by_reason(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def to_dict(self) -> dict:
        return {
            "count": self.count,
            "by_reason": self.by_reason(),
            "truncated": self.truncated,
            "rows": list(self.rows),
        }


def load_conversations(
    spec: str,
    *,
    bad_rows: str = "error",
    require_assistant: bool = True,
    limit: int | None = None,
    skips: SkipLog,
) -> list[Conversation]:
    """Load the conversations of one source `spec` (see the module docstring / :data:`FORMS`).

    `bad_rows` is ``"error"`` (raise :class:`DataError`) or ``"skip"`` (count in `skips`).
    Empty conversations, and with `require_assistant` those without an assistant turn,
    are always counted skips. `limit` caps the number returned (after skips).
    """
    if bad_rows not in ("error", "skip"):
        raise ValueError(f"bad_rows: {bad_rows!r}; use 'error' or 'skip'.")
    from draftsmith import prompt_sets, sharegpt  # imported here: they import this module

    source = spec
    if spec.partition("@")[0].partition(":")[0] == "sharegpt":
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
        rows = _file_rows(Path(spec))
    out: list[Conversation] = []
    for row, conv_id, record in rows:
        if limit is not None and len(out) >= limit:
            break
        try:
            if isinstance(record, DataError):
                raise record
            messages = parse_row(record, source, row)
        except DataError as err:
            if bad_rows == "error":
                raise
            skips.add(source, row, err.reason, str(err), id=conv_id)
            continue
        conv = Conversation(conv_id, messages, source, row)
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


def parse_row(record: Any, source: str, row: int) -> list[dict[str, str]]:
    """Messages of one row in either shape; raises :class:`DataError` on a bad row."""

    def bad(field: str, problem: str, reason: str, hint: str = ROW_HINT) -> DataError:
        return DataError.at(source, row, field, problem, hint, reason)

    if not isinstance(record, dict):
        raise bad("(row)", f"is a {_kind(record)}, not an object", "unknown_shape")
    if record.get("conversations") is not None:
        key, pairs = "conversations", (("from", "value"), ("role", "content"))
    elif record.get("messages") is not None:
        key, pairs = "messages", (("role", "content"),)
    else:
        for key in ("prompt", "instruction"):
            text = record.get(key)
            if isinstance(text, str):
                return [{"role": "user", "content": text}] if text.strip() else []
            if text is not None:
                raise bad(key, f"is a {_kind(text)}, not a string", "non_string_content")
        problem = f"keys {sorted(record)} hold none of conversations/messages/prompt/instruction"
        raise bad("(row)", problem, "unknown_shape", "use the ShareGPT or OpenAI chat shape")
    turns = record[key]
    if not isinstance(turns, list):
        raise bad(key, f"is a {_kind(turns)}, not a list of turns", "unknown_shape")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise bad(where, f"is a {_kind(turn)}, not an object", "unknown_shape")
        # ShareGPT turns are {"from", "value"}, sometimes {"role", "content"}. Keys that
        # are None count as absent: `datasets` fills keys missing from some rows with None.
        role_key, content_key = next((p for p in pairs if turn.get(p[0]) is not None), pairs[0])
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str) or role not in ROLES:
            problem = f"unknown role {role!r} (expected {ROLE_NAMES})"
            raise bad(f"{where}.{role_key}", problem, "unknown_role")
        if not isinstance(content, str):
            problem = f"content is {_kind(content)}, not a string"
            raise bad(f"{where}.{content_key}", problem, "non_string_content")
        messages.append({"role": ROLES[role], "content": content})
    return messages


def _prompts_only(spec: str, more: str = "") -> DataError:
    return DataError(
        f"data: {spec} holds prompts without replies; regenerate them "
        f"(regenerate: true / require_assistant=False){more}."
    )


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# Each reader yields (row, id, record); a record that cannot be decoded is a DataError.
Rows = Iterable[tuple[int, str, Any]]


def _label(path: Path) -> str:
    """File stem without .json/.jsonl/.gz suffixes: ``data/chat.jsonl.gz`` -> ``chat``."""
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def _file_rows(path: Path) -> Rows:
    if not path.is_file():
        raise DataError(f"data: {path} does not exist (or is not a file); accepted: {FORMS}")
    name = path.name.removesuffix(".gz")
    if not name.endswith((".json", ".jsonl")):
        raise DataError(f"data: {path} is neither .json nor .jsonl; accepted: {FORMS}")
    opener = gzip.open if path.name.endswith(".gz") else open
    if name.endswith(".jsonl"):
        return jsonl_rows(path, opener, _label(path))
    with opener(path, "rt", encoding="utf-8") as f:
        try:
            data = json.load(f)
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


def jsonl_rows(path: Path, opener, label: str) -> Iterator[tuple[int, str, Any]]:
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            conv_id = f"{label}:{lineno}"
            try:
                yield lineno, conv_id, json.loads(line)
            except json.JSONDecodeError as err:
                problem = f"malformed JSON ({err.msg} at column {err.colno})"
                error = DataError.at(
                    str(path), lineno, "(line)", problem, ROW_HINT, "malformed_json"
                )
                yield lineno, conv_id, error
