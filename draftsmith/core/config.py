"""One way to configure every stage: typed dataclasses parsed by jsonargparse.

A stage declares a dataclass whose field docstrings become ``--help``; users pass
``--config file.yaml`` (several apply in order, last wins) and dotted overrides such
as ``--engine.max_model_len 4096``. The train stage uses LightningCLI, which is built
on the same parser, so flags look the same everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator
from typing import Any, TypeVar

import yaml
from jsonargparse import ArgumentError, ArgumentParser, set_parsing_settings

from draftsmith.core.errors import ConfigError

os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
set_parsing_settings(docstring_parse_attribute_docstrings=True)

T = TypeVar("T")


def build_parser(cls: type, prog: str, description: str) -> ArgumentParser:
    """A parser whose flags are the fields of dataclass `cls`, plus ``--config``."""
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False)
    parser.add_argument("--config", action="config", help="YAML file(s) with the fields below.")
    parser.add_class_arguments(cls, None, as_group=False)
    return parser


def parse_config(cls: type[T], args: list[str] | None, prog: str) -> T:
    """Parse `args` (``sys.argv[1:]`` when None) into an instance of dataclass `cls`.

    A value the parser refuses is a one-line :class:`ConfigError` (invalid choices list
    the allowed values); ``--help`` still prints and exits."""
    parser = build_parser(cls, prog, (cls.__doc__ or "").strip())
    with parse_errors():
        return _instance(cls, parser, parser.parse_args(args))


def parse_section(cls: type[T], section: dict[str, Any], prog: str) -> T:
    """Parse a config section already in memory (the pipeline's) into dataclass `cls`:
    the same checks and defaults as :func:`parse_config`, without a file in between."""
    parser = build_parser(cls, prog, (cls.__doc__ or "").strip())
    with parse_errors():
        return _instance(cls, parser, parser.parse_object(section))


def _instance(cls: type[T], parser: ArgumentParser, parsed: Any) -> T:
    namespace = parser.instantiate(parsed)
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(namespace).items() if k in names})


@contextlib.contextmanager
def parse_errors() -> Iterator[None]:
    """Turn jsonargparse's multi-line ArgumentError into one line naming the option."""
    try:
        yield
    except ArgumentError as err:
        raise ConfigError(one_line(str(err))) from err


_KEY = re.compile(r'Parser key "(?P<key>[^"]+)"')
_LITERAL = re.compile(r"typing\.Literal\[(?P<allowed>[^\]]*)\]")
_VALUE = re.compile(r"(?:Got value|Given value): (?P<value>[^\n]*)")


_SUBTYPES = re.compile(r"Subtypes: \[(?P<types>.*)\]\n")
_EXPECTED = re.compile(
    r"Expected an? (?P<type>.+?)\.? (?:Got value|Given value): (?P<value>[^\n]*)"
)
_GIVEN = re.compile(r"\n\s*Given value: (?P<value>[^\n]*)")


def one_line(message: str) -> str:
    """A parser's error as one line in the user's words: an invalid choice (a Literal,
    optional or not) names the allowed values; a wrong type (a union's, a list element's)
    says what was expected and what was given."""
    key, allowed, value = (r.search(message) for r in (_KEY, _LITERAL, _VALUE))
    if key and allowed and value:
        return (f"{key['key']}: {value['value'].strip()!r} is not a choice; use one of "
                f"[{allowed['allowed']}]")  # fmt: skip
    subtypes, given = _SUBTYPES.search(message), _GIVEN.search(message)
    if key and subtypes and given:
        expected = " or ".join(type_words(t) for t in _split_types(subtypes["types"]))
        inner = [m for m in _EXPECTED.finditer(message) if "NoneType" not in m["type"]]
        why = (f" ({inner[0]['value'].strip()!r} is not {type_words(inner[0]['type'])})"
               if inner else "")  # fmt: skip
        return f"{key['key']}: expected {expected}; got {given['value'].strip()}{why}"
    expected = _EXPECTED.search(message)
    if key and expected:
        return (f"{key['key']}: expected {type_words(expected['type'])}; got "
                f"{expected['value'].strip()!r}")  # fmt: skip
    return " ".join(message.split())


_WORDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "dict": "a mapping (key: value)",
    "list": "a list",
}


def type_words(annotation: str) -> str:
    """``<class 'int'>`` -> "an integer", ``list[int]`` -> "a list of integers", NoneType ->
    "null": a type as a user reads it."""
    t = re.sub(r"<class '(?:[\w.]*\.)?(\w+)'>", r"\1", annotation.strip())
    if t == "NoneType":
        return "null"
    if t.startswith(("list[", "tuple[")) and t.endswith("]"):
        items = [type_words(i).split(" ", 1)[-1] for i in _split_types(t[t.index("[") + 1 : -1])]
        return "a list of " + " or ".join(f"{i}s" if i in ("integer", "number", "string") else i
                                          for i in items)  # fmt: skip
    if t.startswith("dict["):
        return "a mapping (key: value)"
    return _WORDS.get(t, t)


def _split_types(text: str) -> list[str]:
    """``"list[int], <class 'NoneType'>"`` -> its top-level comma-separated parts."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "[(" and 1 or (-1 if char in "])" else 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in [*parts, text[start:]] if p.strip()]


def to_dict(config) -> dict:
    """A dataclass config as plain JSON-able data (for manifests and reports)."""
    return dataclasses.asdict(config)


def merge(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` merged in at every depth (``extra`` wins)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def section_overrides(
    args: list[str], sections: tuple[str, ...]
) -> tuple[list[str], dict[str, Any]]:
    """Split ``--<section>.<key...> VALUE`` (or ``=VALUE``) out of ``args``, for each
    section in ``sections`` (dict-valued config fields that pass through unparsed).

    Returns the other arguments and ``{"train.model.lr": 0.001, ...}``; values are read as
    YAML, so ``'[a.jsonl, b.jsonl]'`` is a list and ``3e-4`` a number."""
    rest: list[str] = []
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        key, sep, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key.split(".", 1)[0] in sections and "." in key:
            if not sep:
                if i + 1 >= len(args):
                    raise ConfigError(f"--{key}: no value given; write --{key} VALUE")
                value, i = args[i + 1], i + 1
            overrides[key] = yaml.safe_load(value) if value.strip() else value
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree["a"]["b"]["c"] = value`` for ``"a.b.c"``, creating the levels between."""
    *path, last = dotted.split(".")
    node = tree
    for key in path:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[last] = value
