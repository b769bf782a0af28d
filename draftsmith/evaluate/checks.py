"""Refuse a head that cannot work with the target before any engine starts.

A head built for another target loads in vLLM more often than not and then gets ~0%
acceptance, or fails deep inside the engine. These checks read only the head's
``config.json`` and the safetensors header, and name the mismatch and the fix.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith import drafters
from draftsmith.core.console import say
from draftsmith.core.readers import open_safetensors
from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.headfiles import read as headread
from draftsmith.drafters.headfiles.directory import HeadError
from draftsmith.drafters.headfiles.windows import window_note

MAX_K = 16
REEXPORT = "re-export the head with `draftsmith export`"


def check_k(ks: list[int]) -> list[int]:
    """Draft lengths must be in 1..MAX_K; returns them sorted and unique."""
    bad = [k for k in ks if not 1 <= k <= MAX_K]
    if not ks or bad:
        raise HeadError(f"k: {bad or ks} out of range; give draft lengths between 1 and {MAX_K}.")
    return sorted(set(ks))


MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def check_baselines(baselines: list[str], target: TargetInfo) -> None:
    """``target_mtp`` serves the target's own MTP layer: refused for a target without one."""
    if "target_mtp" not in baselines:
        return
    text = target.text_config
    if not any(int(text.get(k) or target.config.get(k) or 0) > 0 for k in MTP_LAYER_KEYS):
        raise HeadError(
            f"baselines: target_mtp serves the target's own MTP layer, but {target.architecture} "
            f"declares none ({' / '.join(MTP_LAYER_KEYS)} in its config.json); drop target_mtp"
        )


def check_section_target(section: dict, target: TargetInfo) -> None:
    """An eval section's options against the target (the pipeline's ``target`` hook)."""
    baselines = section.get("baselines")
    if isinstance(baselines, list):
        check_baselines(baselines, target)


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """Shapes of the tensors in a safetensors file, read from its header only."""
    with open_safetensors(path, "head weights", REEXPORT) as f:
        return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}


def head_method(head: str) -> str:
    """The vLLM method a head directory is served with, from its config (its kind says)."""
    config = read_head_config(head)
    method = drafters.head_method(config)
    if method is None:
        arch = (config.get("architectures") or ["?"])[0]
        raise HeadError(
            f"head: {head} is a {arch}, which no method serves; give --method and a head "
            f"exported for vLLM ({', '.join(sorted(drafters.head_methods()))})."
        )
    return method


def read_head_config(head: str) -> dict:
    """A head directory's ``config.json``, refused in one line when missing."""
    return headread.read_head_config(head, REEXPORT)


def head_kind(cfg) -> type[drafters.Drafter]:
    """The kind of ``cfg.head`` served with ``cfg.method`` (DFlash and DFlash2 share ``dflash``:
    the head's ``config.json`` tells them apart; without one, the method's first kind)."""
    has_config = cfg.head and (Path(cfg.head) / "config.json").is_file()
    config = read_head_config(cfg.head) if has_config else None
    return drafters.kind_of_method(cfg.method, config)


def check_head(head: str, method: str, target: TargetInfo) -> dict:
    """Validate a head directory against `target`; return the head's config."""
    if method not in drafters.head_methods():
        raise HeadError(
            f"method: {method!r} is unknown; use one of {sorted(drafters.head_methods())}."
        )
    config = read_head_config(head)
    kind = drafters.kind_of_method(method, config)
    weights = sorted(Path(head).glob("*.safetensors"))
    if not weights:
        raise HeadError(f"head: {head} has no .safetensors weights.")
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in kind.methods[method] and kind.method_of(config) is None:
        other = drafters.head_method(config)
        hint = f"run it with --method {other}" if other else "export it for vLLM"
        raise HeadError(f"head: {head} is a {arch}, not {article(method)} {method} head; {hint}.")
    want = config.get("target_hidden_size", config.get("hidden_size"))
    if want != target.hidden_size:
        raise HeadError(
            f"head: {head} was built for a target with hidden size {want}, but {target.path} "
            f"has {target.hidden_size}; train a head for this target."
        )
    vocab = config.get("vocab_size")
    if vocab is not None and vocab != target.vocab_size:
        raise HeadError(
            f"head: {head} has vocab_size {vocab}, the target {target.vocab_size}; "
            "the head was made for another tokenizer."
        )
    shapes = {}
    for file in weights:
        shapes.update(tensor_shapes(file))
    kind.check_head(head, method, config, shapes, target)
    if note := window_note(config):  # served, but not as it was trained
        say(f"eval: {head}: {note}")
    return config


def article(word: str) -> str:
    """'a' or 'an' before ``word`` as it is read aloud (an eagle3, a dflash, a peagle)."""
    return "an" if word[:1].lower() in "aeio" else "a"
