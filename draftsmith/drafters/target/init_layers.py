"""``model.init_from_target``: start a draft head from the target's own top decoder layers.

Draft decoder layer i of L starts as a copy of target layer ``N - L + i`` (N = the target's
``num_hidden_layers``), so a one-layer head (the default) starts as the target's LAST layer:

- ``self_attn.o_proj``, ``mlp.{gate,up,down}_proj``, ``post_attention_layernorm`` and any
  attention biases are copied as they are, ``input_layernorm`` too where the draft layer has
  one (EAGLE-1's first layer has none: vLLM runs it without).
- EAGLE-3's first layer reads ``cat(input_layernorm(embeds), hidden_norm(hidden))`` [2H]: its
  q/k/v weights get the target's on the hidden half (input columns H..2H) and zeros on the
  embedding half, so they start by reading the target state alone (the embedding half still
  gets gradients, so it learns); ``input_layernorm`` and ``hidden_norm`` both start as the
  target's ``input_layernorm``.
- ``fc`` passes one state through: EAGLE-3's ``fc`` [H, n_aux * H_target] is the identity on
  the deepest tapped layer (the last slice: aux states come in ascending layer-id order) and
  zero elsewhere, which needs H == H_target; EAGLE-1's ``fc`` [H, 2H] over ``cat(embeds,
  hidden)`` is the identity on the hidden half. Norms before ``fc`` keep their ones.
- EAGLE-3's final ``norm`` starts as the target's final norm; its lm_head starts as the
  target's rows anyway (``DraftModule.set_draft_vocab``). So the head starts as the target's
  top layer(s), final norm and lm_head applied to the deepest tapped state: when that state
  is the input of layer N - 1 (id N - 1) and no norm option is on, step 0 reproduces the
  target's own next-token logits.

Target tensors a draft layer has no place for (e.g. Qwen3's ``q_norm``/``k_norm``) are unused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.attention.layers import DecoderLayer
from draftsmith.drafters.attention.llama import LlamaDraftHead
from draftsmith.drafters.target.weights import OFFSET_NORM_TYPES, load_target_layer

QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
SOURCE = {"hidden_norm.weight": "input_layernorm.weight"}  # draft key -> target layer key


def copy_layer(layer: DecoderLayer, target: dict[str, Tensor], target_layer: int) -> None:
    """Copy target decoder layer ``target_layer`` (``load_target_layer``'s keys) into
    ``layer``; EAGLE-3's first layer gets zeros on the embedding half of q/k/v."""
    for name, param in layer.named_parameters():
        key = SOURCE.get(name, name)
        if key not in target:
            raise ConfigError(
                f"model.init_from_target: target layer {target_layer} has no {key} (it has "
                f"{sorted(target)}); set model.init_from_target false for this target"
            )
        value = target[key]
        if layer.eagle3_first and name in QKV:  # [out, H] -> [out, 2H]: cat(embeds, hidden)
            value = torch.cat([torch.zeros_like(value), value], dim=1)
        if value.shape != param.shape:
            raise ConfigError(
                f"model.init_from_target: the draft's {name} is {tuple(param.shape)} but target "
                f"layer {target_layer}'s {key} is {tuple(value.shape)}; the head needs the "
                "target's layer sizes, or set model.init_from_target false"
            )
        param.copy_(value)


def pass_through_fc(head: LlamaDraftHead) -> None:
    """``fc`` = identity on its last H input columns (EAGLE-3: the deepest tapped layer;
    EAGLE-1: the hidden half of ``cat(embeds, hidden)``), zero elsewhere."""
    weight = head.fc.weight  # [H, n_aux * H_target] or [H, 2H]
    hidden = weight.shape[0]
    source = head.init_kwargs.get("target_hidden_size") or hidden
    if source != hidden:
        raise ConfigError(
            f"model.init_from_target: fc can pass the deepest tapped layer through only when "
            f"the head's hidden size ({hidden}) equals the target's ({source}); set "
            "model.init_from_target false"
        )
    weight.zero_()
    weight[:, -hidden:] = torch.eye(hidden, dtype=weight.dtype, device=weight.device)


def init_from_target(head: LlamaDraftHead, target: TargetInfo, final_norm: Tensor) -> list[int]:
    """Start ``head`` from ``target``'s top decoder layers (module docstring).

    ``final_norm`` [H] is the target's final norm weight (``TargetWeights.norm``). Returns the
    target layer ids copied, in draft-layer order.
    """
    layers = head.decoder_layers()
    n = target.num_hidden_layers
    kind = target.text_config.get("model_type")
    if kind in OFFSET_NORM_TYPES:
        raise ConfigError(
            f"model.init_from_target: {kind} layers scale their norms by (1 + w) and gate their "
            "attention, which the head's Llama layer does not; set model.init_from_target false"
        )
    act = target.text_config.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(
            f"model.init_from_target: the target's MLPs use {act!r}, the head's use silu, so "
            "copied MLP weights would compute something else; set model.init_from_target false"
        )
    if len(layers) > n:
        raise ConfigError(
            f"model.init_from_target: the head has {len(layers)} layers, the target only {n}; "
            "lower model.num_layers or set model.init_from_target false"
        )
    ids = list(range(n - len(layers), n))
    with torch.no_grad():
        for layer, i in zip(layers, ids, strict=True):
            copy_layer(layer, load_target_layer(target.path, i), i)
        pass_through_fc(head)
        if getattr(head, "norm", None) is not None:  # EAGLE-3's final norm: the target's
            head.norm.weight.copy_(final_norm)
    return ids
