"""Every file draftsmith reads is opened here: one boundary per file kind.

A damaged or foreign file fails inside a library in many ways (``SafetensorError``,
``UnpicklingError``, ``JSONDecodeError``, a tokenizers panic). Each reader turns all of
them into one :class:`ReadError` line naming the file, what it holds, what was expected
and the fix, so a stage's ``main`` ends in exit 2 instead of a traceback.

:data:`FILE_KINDS` lists every kind of file read anywhere in the package. Each reader
takes one of its keys, and the test suite's sweep (``tests/test_readers.py``) writes every
corrupt form of every kind listed here: a new kind without a sweep entry fails it.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from draftsmith.core.errors import DraftsmithError


class ReadError(DraftsmithError):
    """A file that is missing, damaged, or not what its place says it is."""


# kind -> what such a file holds (the "expected" of every error about one).
FILE_KINDS: dict[str, str] = {
    # a dataset directory (draftsmith extract)
    "dataset manifest": "a dataset's manifest.json (an object with a 'shards' list)",
    "dataset plan": "a dataset's plan.json (an object with a 'shards' list)",
    "shard": "a shard of hidden states (safetensors)",
    "shard sidecar": "a shard's sidecar shard-NNNNN.json (an object with 'sha256')",
    "kept replies": "a shard's kept replies replies/shard-NNNNN.json (with 'sequences')",
    "staged states": "hidden states our KV connector staged for one request (safetensors)",
    # a draft head directory (draftsmith export / convert / eval, model.init_from)
    "head config": "a head's config.json (a JSON object)",
    "head weights": "a head's tensors (*.safetensors)",
    "safetensors index": "a sharded model's model.safetensors.index.json (with 'weight_map')",
    "head pickle": "a head's pytorch_model.bin (plain tensors)",
    "dflash embedding": "a DFlash head's embedding file (plain tensors)",
    # training checkpoints (draftsmith train)
    "checkpoint": "a checkpoint draftsmith train wrote (.ckpt, plain tensors and containers)",
    "deepspeed checkpoint": "a DeepSpeed ZeRO checkpoint directory ('latest', a tag's shards)",
    "fsdp checkpoint": "a sharded FSDP checkpoint directory (meta.pt and the shards)",
    # configs and inputs
    "yaml config": "a YAML config (a mapping)",
    "conversations": "conversations, .json or .jsonl (optionally .gz), a row each",
    "jsonl": "JSON Lines, one JSON object a line",
    "stage record": "a record a stage wrote beside its outputs (a JSON object)",
    # the target model
    "target config": "a model's config.json (a JSON object)",
    "target weights": "a model's tensors (*.safetensors)",
    "tokenizer": "a model's tokenizer files (tokenizer.json, tokenizer_config.json)",
}

_SHAPES = {dict: "an object", list: "a list"}


def _problem(err: BaseException) -> str:
    """A library's exception as one short phrase."""
    text = " ".join(str(err).split())
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _fail(path: Path | str, kind: str, problem: str, fix: str) -> ReadError:
    return ReadError(f"{path}: {problem}; expected {FILE_KINDS[kind]}; {fix}")


def _check_kind(kind: str) -> None:
    if kind not in FILE_KINDS:
        raise KeyError(f"file kind {kind!r} is not in draftsmith.core.readers.FILE_KINDS")


def check_file(path: Path | str, kind: str, fix: str) -> None:
    """Refuse a missing, unreadable, empty file or a directory in one line, before it is read
    here or opened by a library (safetensors, torch, tokenizers)."""
    _check_kind(kind)
    try:
        size = Path(path).stat().st_size
    except FileNotFoundError:
        raise _fail(path, kind, "no such file", fix) from None
    except OSError as err:
        raise _fail(path, kind, f"cannot be read ({err.strerror or err})", fix) from None
    if Path(path).is_dir():
        raise _fail(path, kind, "is a directory", fix)
    if size == 0:
        raise _fail(path, kind, "is empty", fix)


def read_bytes(path: Path | str, kind: str, fix: str) -> bytes:
    """The whole file (:func:`check_file`'s refusals; blank counts as empty)."""
    check_file(path, kind, fix)
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise _fail(path, kind, f"cannot be read ({err.strerror or err})", fix) from None
    if not raw.strip():
        raise _fail(path, kind, "is empty", fix)
    return raw


def read_text(path: Path | str, kind: str, fix: str) -> str:
    """The file as UTF-8 text; other bytes are refused naming the first bad offset."""
    raw = read_bytes(path, kind, fix)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _fail(path, kind, f"is not UTF-8 text (byte offset {err.start})", fix) from None


def check_shape(
    data: Any, path: Path | str, kind: str, fix: str, shape: type = dict, keys: tuple = ()
) -> Any:
    """``data`` if it is a ``shape`` holding every key of ``keys``, else one line."""
    if not isinstance(data, shape):
        found = _SHAPES.get(type(data), f"a {type(data).__name__}")
        raise _fail(path, kind, f"holds {found}, not {_SHAPES[shape]}", fix)
    missing = [k for k in keys if k not in data]
    if missing:
        raise _fail(path, kind, f"has no {missing[0]!r}", fix)
    return data


def parse_json(text: str | bytes, path: Path | str, kind: str, fix: str) -> Any:
    """JSON already read from ``path``; a syntax error names its line and column."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        where = f"line {err.lineno} column {err.colno}"
        raise _fail(path, kind, f"is not valid JSON ({err.msg} at {where})", fix) from None
    except (UnicodeDecodeError, RecursionError) as err:
        raise _fail(path, kind, f"is not valid JSON ({_problem(err)})", fix) from None


def read_json(path: Path | str, kind: str, fix: str, shape: type = dict, keys: tuple = ()) -> Any:
    """A JSON file of ``shape`` (dict or list) holding ``keys``."""
    data = parse_json(read_text(path, kind, fix), path, kind, fix)
    return check_shape(data, path, kind, fix, shape, keys)


def read_json_or(path: Path | str, default: Any) -> Any:
    """A JSON file another process may be writing or removing (stream control files):
    ``default`` when it is absent or not yet whole. Writers replace such files atomically,
    so a partial one is a foreign file, not a race; it is still read as absent."""
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return default
    return data if isinstance(data, type(default)) or default is None else default


def read_jsonl(path: Path | str, kind: str, fix: str, keys: tuple = ()) -> list[dict[str, Any]]:
    """Every non-blank line of a JSON Lines file, each an object holding ``keys``; errors
    name the line."""
    rows = []
    for lineno, line in enumerate(read_text(path, kind, fix).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        rows.append(check_shape(parse_json(line, where, kind, fix), where, kind, fix, dict, keys))
    return rows


def read_yaml(path: Path | str, kind: str, fix: str, shape: type = dict) -> Any:
    """A YAML file whose top level is ``shape``. An empty file is refused: a config that
    says nothing is a mistake, never a wish for every default."""
    import yaml

    text = read_text(path, kind, fix)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        what = getattr(err, "problem", None) or type(err).__name__
        raise _fail(path, kind, f"is not valid YAML ({what}{where})", fix) from None
    if not isinstance(data, shape):
        found = {dict: "a YAML mapping", list: "a YAML list"}.get(type(data), "a YAML scalar")
        raise ReadError(f"{path} holds {found}, expected {FILE_KINDS[kind]}; {fix}")
    return data


def read_safetensors(path: Path | str, kind: str, fix: str) -> dict[str, Any]:
    """Every tensor of a safetensors file."""
    from safetensors.torch import load_file

    check_file(path, kind, fix)
    try:
        return load_file(str(path))
    except Exception as err:  # SafetensorError, OSError, a bad dtype: all one line
        raise _fail(path, kind, f"is not a whole safetensors file ({_problem(err)})", fix) from None


@contextmanager
def open_safetensors(path: Path | str, kind: str, fix: str) -> Iterator[Any]:
    """``safe_open`` for reading some tensors lazily; its header is checked on opening
    (safetensors checks that the data the header lists is all there)."""
    from safetensors import safe_open

    check_file(path, kind, fix)
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as err:
        raise _fail(path, kind, f"is not a whole safetensors file ({_problem(err)})", fix) from None
    with handle as f:
        yield f


def read_torch(path: Path | str, kind: str, fix: str, allow: tuple[type, ...] = ()) -> Any:
    """``torch.load`` that runs no code: tensors, containers and the ``allow`` types only.

    A pickle that names anything else (a function, a class from elsewhere) is refused
    unread: ``weights_only`` stops at the first such name, so nothing in it runs."""
    import torch

    check_file(path, kind, fix)
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = next((ln.strip() for ln in str(err).splitlines() if "GLOBAL" in ln), "")
        if found:
            named = f" ({found})" if found else ""
            problem = f"holds objects that are not plain tensors{named}; refused without running it"
            raise _fail(path, kind, problem, fix) from None
        raise _fail(path, kind, f"is not a whole torch file ({_problem(err)})", fix) from None
    except Exception as err:  # a zip cut short, garbage, a foreign format
        raise _fail(path, kind, f"is not a whole torch file ({_problem(err)})", fix) from None


def read_tokenizer(path: Path | str, fix: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(path)``, any failure in one line."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), **kwargs)
    except Exception as err:  # tokenizers and transformers raise many types for one bad file
        raise _fail(path, "tokenizer", f"cannot be loaded ({_problem(err)})", fix) from None


def read_model_config(path: Path | str, fix: str) -> dict[str, Any]:
    """A hub id's config through ``AutoConfig`` (a local directory's ``config.json`` is
    read with :func:`read_json`), any failure in one line."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path)).to_dict()
    except Exception as err:
        raise _fail(path, "target config", f"cannot be loaded ({_problem(err)})", fix) from None


def pickle_globals(path: Path | str, kind: str, fix: str) -> set[str]:
    """Every ``module.name`` a pickle would import, read without unpickling it: from a raw
    pickle, or from each ``*.pkl`` inside a torch zip. For files a library loads with plain
    ``pickle`` (DeepSpeed's ZeRO states, torch.distributed.checkpoint's ``.metadata``),
    which would run whatever the pickle names."""
    import zipfile

    check_file(path, kind, fix)
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                blobs = [z.read(n) for n in z.namelist() if n.endswith(".pkl")]
        except Exception as err:
            raise _fail(path, kind, f"is not a whole torch file ({_problem(err)})", fix) from None
    else:
        blobs = [Path(path).read_bytes()]
    names: set[str] = set()
    for blob in blobs:
        try:
            names |= _globals(blob)
        except Exception as err:  # not a pickle, or cut short
            raise _fail(path, kind, f"is not a whole pickle ({_problem(err)})", fix) from None
    return names


def _globals(blob: bytes) -> set[str]:
    """The imports of one pickle. STACK_GLOBAL takes its module and name from the stack,
    pushed as strings or fetched from the memo, so strings are followed through the memo."""
    import pickletools

    names: set[str] = set()
    strings: list[str] = []  # the strings pushed so far, in order
    memo: dict[int, Any] = {}
    last: Any = None  # what the last op pushed, where it was a string
    for op, arg, _ in pickletools.genops(blob):
        name = op.name
        if name in ("GLOBAL", "INST"):
            names.add(str(arg).replace(" ", "."))
            last = None
        elif name == "STACK_GLOBAL":
            if len(strings) < 2:
                raise ValueError("STACK_GLOBAL without a module and a name")
            names.add(f"{strings[-2]}.{strings[-1]}")
            last = None
        elif name == "MEMOIZE":
            memo[len(memo)] = last
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = last
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            last = memo.get(int(arg))
            if isinstance(last, str):
                strings.append(last)
        elif isinstance(arg, str) and ("UNICODE" in name or "STRING" in name):
            last = str(arg)
            strings.append(last)
        else:
            last = None
    return names


def refuse_foreign_pickle(path: Path | str, kind: str, fix: str, allowed: tuple[str, ...]) -> None:
    """Refuse, unread, a pickle that names anything outside the ``allowed`` prefixes."""
    foreign = sorted(n for n in pickle_globals(path, kind, fix) if not n.startswith(allowed))
    if foreign:
        problem = (
            f"holds objects that are not plain tensors ({foreign[0]}); refused without running it"
        )
        raise _fail(path, kind, problem, fix)
