"""Refuse a head that cannot work with the target before any engine starts.

A head built for another target loads in vLLM more often than not and then gets ~0%
acceptance, or fails deep inside the engine. These checks read only the head's
``config.json`` and the safetensors header, and name the mismatch and the fix.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import TargetInfo

ARCHITECTURES = {
    "eagle3": ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3Speculator"),
    "eagle": ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle"),
    "dflash": ("DFlashDraftModel",),
}
ARCHITECTURES["peagle"] = ARCHITECTURES["eagle3"]  # EAGLE-3 drafting in parallel: the config
# says so with speculators_model_type "peagle" (``head_method``)
HEAD_METHODS = tuple(ARCHITECTURES)  # the methods that serve a trained head
MAX_K = 16


class HeadError(DraftsmithError):
    """The head directory cannot serve this target; the message says why and how to fix it."""


def check_k(ks: list[int]) -> list[int]:
    """Draft lengths must be in 1..MAX_K; returns them sorted and unique."""
    bad = [k for k in ks if not 1 <= k <= MAX_K]
    if not ks or bad:
        raise HeadError(f"k: {bad or ks} out of range; give draft lengths between 1 and {MAX_K}.")
    return sorted(set(ks))


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """Shapes of the tensors in a safetensors file, read from its header only."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def head_method(head: str) -> str:
    """The vLLM method a head directory is served with, from its config's architecture."""
    config_file = Path(head) / "config.json"
    if not config_file.is_file():
        raise HeadError(
            f"head: {head} has no config.json; give a directory written by `draftsmith export`."
        )
    config = json.loads(config_file.read_text())
    arch = (config.get("architectures") or ["?"])[0]
    if config.get("speculators_model_type") == "peagle":
        return "peagle"
    found = [m for m, archs in ARCHITECTURES.items() if arch in archs]
    if not found:
        raise HeadError(
            f"head: {head} is a {arch}, which no method serves; give --method and a head "
            f"exported for vLLM ({', '.join(sorted(ARCHITECTURES))})."
        )
    return found[0]


def check_head(head: str, method: str, target: TargetInfo) -> dict:
    """Validate a head directory against `target`; return the head's config."""
    if method not in ARCHITECTURES:
        raise HeadError(f"method: {method!r} is unknown; use one of {sorted(ARCHITECTURES)}.")
    root = Path(head)
    if not (root / "config.json").is_file():
        raise HeadError(
            f"head: {head} has no config.json; give a directory written by `draftsmith export`."
        )
    weights = sorted(root.glob("*.safetensors"))
    if not weights:
        raise HeadError(f"head: {head} has no .safetensors weights.")
    config = json.loads((root / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES[method]:
        other = [m for m, archs in ARCHITECTURES.items() if arch in archs]
        hint = f"run it with --method {other[0]}" if other else "export it for vLLM"
        raise HeadError(f"head: {head} is a {arch}, not an {method} head; {hint}.")
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
    if method in ("eagle3", "peagle"):
        _check_eagle3(head, config, shapes, target)
    if method == "peagle" and ("mask_hidden" not in shapes or config.get("mask_token_id") is None):
        raise HeadError(
            f"head: {head} drafts in parallel only with a mask_token_id in config.json and a "
            "mask_hidden tensor; export a head trained with model.parallel_drafting true."
        )
    if method == "dflash":
        _check_dflash(head, config, shapes, target)
    return config


def _check_dflash(head: str, config: dict, shapes: dict, target: TargetInfo) -> None:
    ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    n = target.num_hidden_layers
    if not ids or any(not 0 <= i < n for i in ids):
        raise HeadError(
            f"head: {head} dflash_config.target_layer_ids {ids} must be 0-based layers of the "
            f"target's 0..{n - 1}; it was trained for another target."
        )
    fc = shapes.get("fc.weight")
    if fc is not None and fc[1] != len(ids) * target.hidden_size:
        raise HeadError(
            f"head: {head} fc.weight is {fc}, expected [*, {len(ids)} x {target.hidden_size}] "
            f"for its {len(ids)} target_layer_ids."
        )


def _check_eagle3(head: str, config: dict, shapes: dict, target: TargetInfo) -> None:
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    n = target.num_hidden_layers
    if ids is not None:
        bad = [i for i in ids if not 0 <= i <= n]  # id n: last layer's output, before the norm
        if bad:
            raise HeadError(
                f"head: {head} taps layers {bad}, outside the target's 0..{n}; "
                "it was trained for a deeper target."
            )
    fc = shapes.get("fc.weight")
    taps = len(ids) if ids is not None else 3
    if fc is not None and fc[1] != taps * target.hidden_size:
        raise HeadError(
            f"head: {head} fc.weight is {fc}, expected [*, {taps} x {target.hidden_size}] for "
            f"{taps} tapped layers of this target."
        )
    draft_vocab = config.get("draft_vocab_size", target.vocab_size)
    lm_head = shapes.get("lm_head.weight")
    if lm_head is not None and lm_head[0] != draft_vocab:
        raise HeadError(
            f"head: {head} lm_head.weight has {lm_head[0]} rows but draft_vocab_size is "
            f"{draft_vocab}; re-export the head."
        )
    if draft_vocab < target.vocab_size and "d2t" not in shapes:
        raise HeadError(
            f"head: {head} has a reduced draft vocabulary ({draft_vocab}) but no d2t mapping."
        )
    if draft_vocab == target.vocab_size and "d2t" in shapes:
        raise HeadError(
            f"head: {head} ships d2t with a full vocabulary; vLLM refuses it. Drop d2t."
        )
