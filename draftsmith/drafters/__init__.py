"""Drafter kinds, one folder each, and the registry that names them.

    eagle3/   EAGLE-3, with P-EAGLE as its parallel-drafting option
    eagle1/   EAGLE-1
    dflash/   DFlash
    dflash2/  DFlash2 (DFlash + grouped dynamic convolutions + candidate selector)
    dspark/   DSpark (DFlash-style block + Markov head + confidence head)
    mtp/      the target's own MTP layer, fine-tuned (vLLM's method mtp)

What kinds share lives once beside them, grouped by concern, each group a package:

    protocol/   the contract: ``Drafter``, the training ``Batch``, shared option groups
    attention/  the layers heads are built of, and training-time test (how a draft step attends)
    losses/     the draft losses and their kernels, and what validation measures (the served walk)
    headfiles/  head directories written and read, whatever the kind
    target/     what heads take from the target: weights, a start from its layers, vocabularies

A kind imports the groups, never another kind (except DFlash2, which is DFlash plus parts,
from ``dflash``); a group imports no kind.

A new kind is a folder with a :class:`~draftsmith.drafters.protocol.Drafter` subclass and one
line at the end of this file (or ``register(MyKind)`` from outside the package, before the command
runs). Training, export and eval then take ``model.kind: <name>`` and its options.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from draftsmith.core.console import say
from draftsmith.core.errors import ConfigError
from draftsmith.drafters.dflash import DFlash
from draftsmith.drafters.dflash2 import DFlash2
from draftsmith.drafters.dspark import DSpark
from draftsmith.drafters.eagle1 import Eagle1
from draftsmith.drafters.eagle3 import Eagle3
from draftsmith.drafters.mtp import MTP
from draftsmith.drafters.protocol import Drafter
from draftsmith.drafters.protocol.options import defaults, field_docs

KINDS: dict[str, type[Drafter]] = {}


def names() -> list[str]:
    return list(KINDS)


def get(name: str) -> type[Drafter]:
    """The kind called ``name`` (``model.kind``, a checkpoint's ``kind``)."""
    if name not in KINDS:
        raise ConfigError(f"model.kind: {name!r} is not a choice; use one of {names()}")
    return KINDS[name]


def option_fields() -> dict[str, tuple[Any, Any, list[str]]]:
    """Every registered option: name -> (type, default, the kinds that have it)."""
    out: dict[str, tuple[Any, Any, list[str]]] = {}
    for kind in KINDS.values():
        values = defaults(kind.Options)
        for f in fields(kind.Options):
            if f.name in out:
                out[f.name][2].append(kind.name)
            else:
                out[f.name] = (f.type, values[f.name], [kind.name])
    return out


def option_docs() -> dict[str, str]:
    """Each registered option's docstring (read from the kinds' sources: for ``--help``)."""
    docs: dict[str, str] = {}
    for kind in KINDS.values():
        docs = {**field_docs(kind.Options), **docs}
    return docs


def make(name: str, options: dict[str, Any]) -> Drafter:
    """The kind ``name`` with ``options`` (``model.*``): its own options taken; another
    kind's, set away from its default, ignored with a note (one recipe may serve several
    kinds), or refused when it changes what gets trained (``options.exclusive``); an unknown
    one refused."""
    kind = get(name)
    own = {f.name for f in fields(kind.Options)}
    every, exclusive = option_fields(), exclusive_options()
    for option, value in options.items():
        if option in own:
            continue
        if option not in every:
            raise ConfigError(f"model.{option}: not an option of any drafter kind; drop it")
        _, default, owners = every[option]
        if value == default:
            continue
        if option in exclusive:
            shown = "null" if default is None else str(default).lower()
            raise ConfigError(
                f"model.{option}: an option of model.kind {' / '.join(owners)}, not of {name}; "
                f"set it {shown} for model.kind {name}"
            )
        say(f"train: model.{option} {value} is an option of {' / '.join(owners)}; "
            f"model.kind {name} ignores it")  # fmt: skip
    return kind(kind.Options(**{k: v for k, v in options.items() if k in own}))


def exclusive_options() -> set[str]:
    """Options that are refused, not ignored, for a kind that lacks them."""
    return {
        f.name
        for kind in KINDS.values()
        for f in fields(kind.Options)
        if f.metadata.get("exclusive")
    }


def head_method(config: dict[str, Any]) -> str | None:
    """The vLLM method that serves a head with this ``config.json`` (None: no kind's)."""
    for kind in KINDS.values():
        method = kind.method_of(config)
        if method is not None:
            return method
    return None


def kind_of_method(method: str, config: dict[str, Any] | None = None) -> type[Drafter]:
    """The kind a vLLM method serves heads of; given a head's ``config.json``, the kind whose
    head it is (DFlash and DFlash2 share ``method: dflash``), else the first registered."""
    kinds = [kind for kind in KINDS.values() if method in kind.methods]
    mine = [kind for kind in kinds if config is not None and kind.method_of(config) == method]
    if mine or kinds:
        return (mine or kinds)[0]
    raise ConfigError(f"method: {method!r} serves no drafter kind; use one of {head_methods()}")


def head_methods() -> list[str]:
    """Every vLLM method that serves a trained head (each once)."""
    return list(dict.fromkeys(m for kind in KINDS.values() for m in kind.methods))


# ----- callers that name the kind ------------------------------------------------------
def from_target_config(target_config: dict[str, Any], kind: str = "eagle3", **options: Any):
    """A ``kind`` head whose sizes, rope and norms are the target's (``config.json``)."""
    return get(kind).head_from_target(target_config, **options)


def _fitting(head, kind: str) -> type[Drafter]:
    kind_cls = get(kind)
    if not isinstance(head, kind_cls.head_class):
        raise ConfigError(f"kind {kind!r} does not fit a {type(head).__name__}")
    return kind_cls


def export_head(head, kind: str, target, out_dir, **kwargs: Any):
    """Write ``head`` as ``kind``'s serving directory (``Drafter.export``)."""
    return _fitting(head, kind).export(head, target, out_dir, **kwargs)


def head_config(head, kind: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The ``config.json`` of a Llama-style head (EAGLE-3, EAGLE-1): the arguments of
    ``eagle3.export.eagle3_config``."""
    return _fitting(head, kind).head_config(head, *args, **kwargs)


def head_tensors(head, kind: str, dtype) -> dict[str, Any]:
    """The tensors a Llama-style head's ``model.safetensors`` holds."""
    return _fitting(head, kind).head_tensors(head, dtype)


def register(kind: type[Drafter]) -> type[Drafter]:
    """Add a drafter kind. An option it shares with a registered kind must have the same
    type and default there (both read the same ``model.<option>``)."""
    theirs, mine = option_fields(), defaults(kind.Options)
    for f in fields(kind.Options):
        if f.name in theirs and theirs[f.name][:2] != (f.type, mine[f.name]):
            raise TypeError(
                f"{kind.__name__}.Options.{f.name}: {f.type} = {mine[f.name]!r} clashes with "
                f"{theirs[f.name][2]}'s {theirs[f.name][0]} = {theirs[f.name][1]!r}"
            )
    KINDS[kind.name] = kind
    return kind


# The registry: one line per kind.
register(Eagle3)
register(Eagle1)
register(DFlash)
register(DSpark)
register(MTP)
register(DFlash2)
