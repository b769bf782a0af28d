"""Read an EAGLE-3 head published in any common layout into an :class:`Eagle3Head`.

Layouts (``detect_layout``), each recognised by its config and tensor names:

- ``draftsmith``: ours (``export.py``): ``Eagle3LlamaForCausalLM``, ``midlayer.*``.
- ``eagle``: SafeAILab EAGLE-3 (``eagle/traineagle3``): ``LlamaForCausalLM`` with
  ``draft_vocab_size``, ``midlayer.*``, ``d2t`` and ``t2d``; no tapped-layer ids (its
  consumers tap ``[2, N // 2, N - 3]``).
- ``speculators``: ``Eagle3Speculator``, the layer config nested in
  ``transformer_layer_config``, ``layers.0.*`` (``speculators/models/eagle3/config.py``).
- ``modelopt``: NVIDIA ModelOpt, ``LlamaForCausalLMEagle3`` with an ``eagle_config`` block,
  ``layers.0.*`` or ``midlayer.*``, ``lm_head`` sometimes left to the target.
- ``sglang``: SGLang / SpecForge, ``LlamaForCausalLMEagle3``, ``midlayer.*``
  (``python/sglang/srt/models/llama_eagle3.py``).

Tensor names become ours: ``layers.0.`` -> ``midlayer.`` (TensorRT-LLM's multi-layer
``midlayer.{i}.`` -> ``midlayer.`` / ``layers.{i}.``), a leading ``model.`` dropped; ``t2d``
and ``embed_tokens`` are dropped (derived from ``d2t`` / shared with the target); ``d2t`` is
kept when the draft vocabulary is reduced. A config without tapped-layer ids gets the default
taps once the target is known, recorded as ``layer_ids_defaulted``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.core.targets import TargetInfo, text_config
from draftsmith.drafters.attention.llama import target_sizes
from draftsmith.drafters.eagle3.head import Eagle3Head
from draftsmith.drafters.headfiles.directory import HeadError
from draftsmith.drafters.headfiles.read import (
    HeadFacts,
    check_shipped_embeddings,
    check_tensors,
    read_head_files,
)
from draftsmith.drafters.headfiles.windows import trained_window
from draftsmith.drafters.target.weights import load_target_weights

LAYOUTS = ("draftsmith", "eagle", "speculators", "modelopt", "sglang")
DROPPED = ("t2d",)
EMBED = "embed_tokens.weight"


def detect_layout(config: dict[str, Any], names: list[str] | set[str]) -> str:
    """The layout (``LAYOUTS``) of a head with this ``config.json`` and these tensor names."""
    arch = (config.get("architectures") or ["?"])[0]
    layers0 = any(n.startswith(("layers.0.", "model.layers.0.")) for n in names)
    midlayer = any(n.startswith(("midlayer.", "model.midlayer.")) for n in names)
    ours = ("Eagle3LlamaForCausalLM", "Eagle3Qwen3ForCausalLM")  # Qwen3: windowed heads
    if arch == "Eagle3Speculator" or (
        config.get("speculators_model_type") == "eagle3" and arch not in ours
    ):
        return "speculators"
    if arch in ours:
        return "draftsmith"
    if arch == "LlamaForCausalLMEagle3":
        # ModelOpt's eagle_config carries its own keys; SpecForge's names at most the taps.
        eagle = set(config.get("eagle_config") or {}) - {"eagle_aux_hidden_state_layer_ids"}
        return "modelopt" if eagle or layers0 else "sglang"
    if arch == "LlamaForCausalLM" and (midlayer or "draft_vocab_size" in config):
        return "eagle"
    if arch == "LlamaForCausalLM" and layers0:
        raise HeadError(
            "head: an EAGLE-1 head (LlamaForCausalLM, layers.0.*, fc 2H -> H), not an EAGLE-3 "
            "one (drafters/eagle1/layouts.py reads it; `draftsmith convert` reads both)."
        )
    raise HeadError(
        f"head: architecture {arch!r} with tensors {sorted(names)[:3]}... is no EAGLE-3 "
        f"layout convert knows ({', '.join(LAYOUTS)})."
    )


def rename(tensors: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Source names -> ours (module docstring)."""
    out: dict[str, Tensor] = {}
    for name, value in tensors.items():
        name = name.removeprefix("model.")
        if name in DROPPED:
            continue
        name = re.sub(r"^layers\.0\.", "midlayer.", name)
        if num_layers > 1:  # TensorRT-LLM's multi-layer names
            name = re.sub(r"^midlayer\.0\.", "midlayer.", name)
            name = re.sub(r"^midlayer\.(\d+)\.", r"layers.\1.", name)
        out[name] = value
    return out


def layer_config(config: dict[str, Any], layout: str) -> dict[str, Any]:
    """The decoder-layer fields of the head (speculators nests them)."""
    if layout == "speculators":
        return {**config, **config.get("transformer_layer_config", {})}
    return config


def _flag(config: dict[str, Any], key: str, default: bool = False) -> bool:
    eagle = config.get("eagle_config") or {}
    return bool(eagle.get(key, config.get(key, default)))


def read_head(
    head_dir: str | Path,
    target_config: dict[str, Any] | None = None,
    files: tuple[dict[str, Any], dict[str, Tensor]] | None = None,
) -> tuple[Eagle3Head, HeadFacts]:
    """The head in ``head_dir`` (any ``LAYOUTS`` layout) and its facts. ``target_config``
    fills what the head leaves to the target (default taps); checks against the target
    are ``fit_to_target``'s. ``files``: its (config, tensors) when already read."""
    head_dir = Path(head_dir)
    config, raw = files or read_head_files(head_dir)
    try:
        layout = detect_layout(config, set(raw))
    except HeadError as err:  # name the directory the user gave
        raise HeadError(f"head: {head_dir}: {str(err).removeprefix('head: ')}") from None
    layer = layer_config(config, layout)
    sizes = target_sizes(layer)
    num_layers = int(layer.get("num_hidden_layers", 1))
    tensors = rename(raw, num_layers)
    if "fc.weight" not in tensors:
        raise HeadError(f"head: {head_dir} has no fc.weight; not an EAGLE-3 head")
    target_hidden = int(config.get("target_hidden_size") or sizes["hidden_size"])
    fc_in = tensors["fc.weight"].shape[1]
    if fc_in % target_hidden:
        raise HeadError(
            f"head: fc.weight reads {fc_in} features, not a multiple of the target hidden "
            f"size {target_hidden}"
        )
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    draft_vocab = int(config.get("draft_vocab_size") or sizes["vocab_size"])
    facts = HeadFacts(
        layout=layout,
        source=str(head_dir),
        layer_ids=list(ids) if ids else None,
        verifier=((config.get("speculators_config") or {}).get("verifier") or {}).get(
            "name_or_path"
        ),
        dtype=next(t.dtype for t in tensors.values() if t.is_floating_point()),
    )
    facts.embed_tokens = tensors.pop(EMBED, None)
    if facts.embed_tokens is not None and target_config is None:
        facts.notes.append("embed_tokens dropped unchecked (no target given)")
    mask = tensors.get("mask_hidden")
    kwargs = dict(
        sizes,
        num_layers=num_layers,
        draft_vocab_size=draft_vocab,
        target_hidden_size=target_hidden,
        num_aux_states=fc_in // target_hidden,
        attention_bias=bool(layer.get("attention_bias", False)),
        # vLLM reads a speculators config without the flag as True (algos.update_eagle3).
        norm_before_residual=_flag(config, "norm_before_residual", layout == "speculators"),
        norm_output=_flag(config, "norm_output") or _flag(config, "return_hidden_post_norm"),
        norm_before_fc=_flag(config, "norm_before_fc") or "input_norm.weight" in tensors,
        fc_norm=_flag(config, "fc_norm") or "fc_norm.0.weight" in tensors,
        parallel_drafting=mask is not None,
        mask_token_id=config.get("mask_token_id"),
    )
    if "midlayer.self_attn.q_norm.weight" in tensors:  # Qwen3's attention
        kwargs.update(qk_norm=True, sliding_window=trained_window(config))
    head = Eagle3Head(**kwargs)
    if mask is not None:
        tensors["mask_hidden"] = mask.reshape(-1)
    d2t = tensors.pop("d2t", None)
    if draft_vocab < sizes["vocab_size"]:
        if d2t is None:
            raise HeadError(
                f"head: draft_vocab_size {draft_vocab} < vocab_size {sizes['vocab_size']} "
                "but no d2t maps draft ids to target ids"
            )
        target_ids = d2t.long() + torch.arange(d2t.numel())
        if not (0 <= int(target_ids.min()) and int(target_ids.max()) < sizes["vocab_size"]):
            raise HeadError(f"head: d2t maps draft ids outside 0..{sizes['vocab_size'] - 1}")
        try:
            head.set_draft_vocab(target_ids)
        except ValueError as err:
            raise HeadError(f"head: d2t is not a vocabulary map ({err})") from err
    if "lm_head.weight" not in tensors:
        facts.lm_head_from_target = True
        tensors["lm_head.weight"] = head.lm_head.weight.detach().clone()  # filled later
    check_tensors(layout, {k: v for k, v in head.state_dict().items() if k != "d2t"}, tensors)
    head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if facts.layer_ids is None and target_config is not None:
        n = text_config(target_config)["num_hidden_layers"]
        facts.layer_ids, facts.layer_ids_defaulted = [2, n // 2, n - 3], True
    return head, facts


def fit_to_target(head: Eagle3Head, facts: HeadFacts, target: TargetInfo) -> None:
    """Refuse, in one line, a head that cannot draft for ``target`` (hidden size,
    vocabulary, tapped layers, vocabulary map); give a head without ``lm_head`` the
    target's rows for its draft vocabulary."""
    k, n = head.init_kwargs, target.num_hidden_layers
    if k["target_hidden_size"] != target.hidden_size:
        raise HeadError(
            f"head: reads target states of size {k['target_hidden_size']}, but "
            f"{target.path} has hidden size {target.hidden_size}"
        )
    if head.vocab_size != target.vocab_size:
        raise HeadError(
            f"head: vocabulary of {head.vocab_size} ids, but {target.path} has {target.vocab_size}"
        )
    if facts.layer_ids is None:
        facts.layer_ids, facts.layer_ids_defaulted = [2, n // 2, n - 3], True
    ids = facts.layer_ids
    bad = [i for i in ids if not 0 <= i <= n]
    if bad:
        raise HeadError(f"head: taps layers {bad}, outside {target.path}'s 0..{n}")
    if len(ids) != k["num_aux_states"]:
        how = "the default taps" if facts.layer_ids_defaulted else "its config's ids"
        raise HeadError(
            f"head: fc reads {k['num_aux_states']} target states but {how} {ids} are {len(ids)}"
        )
    weights = check_shipped_embeddings(facts, target)
    if facts.lm_head_from_target:
        rows = (weights or load_target_weights(target)).lm_head
        ids_t = head.draft_to_target(torch.arange(head.draft_vocab_size))
        with torch.no_grad():
            head.lm_head.weight.copy_(rows[ids_t].float())
        facts.notes.append("lm_head taken from the target's rows of the draft vocabulary")
