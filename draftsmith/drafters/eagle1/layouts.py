"""Read an EAGLE-1 head published in a common layout into an :class:`Eagle1Head`.

Layouts (``eagle1_layout``), each recognised by its config and tensor names; all share the
tensors ``fc.weight`` [H, 2H] (over ``cat(embedding, target state)``) and ``layers.{i}.*``
with no ``layers.0.input_layernorm``, and ship no ``lm_head`` (the target's is used):

- ``draftsmith``: ours (``export.py``), ``EagleLlamaForCausalLM``: vLLM's
  ``model_executor/models/llama_eagle.py``, whose ``fc`` has no bias.
- ``eagle``: SafeAILab EAGLE-1 (``eagle/model/cnets1.py``, loaded by ``ea_model.py`` with
  ``use_eagle3=False``): ``LlamaForCausalLM`` without ``draft_vocab_size``, ``fc.bias`` when
  config ``bias`` is true (its default when absent), q/k/v biases when ``qkv_bias``, and
  usually a copy of the target's ``embed_tokens``. Old heads also carry rotary buffers.
- ``sglang``: SGLang's ``LlamaForCausalLMEagle`` (``python/sglang/srt/models/llama_eagle.py``):
  SafeAILab's tensors, ``fc`` always with a bias, ``attention_bias`` or ``bias`` for the
  attention biases (``models/llama.py``).

A leading ``model.`` is dropped; rotary buffers are dropped (derived); ``embed_tokens`` is
dropped once checked against the target (``fit_eagle1``): every consumer shares the target's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.attention.llama import target_sizes
from draftsmith.drafters.eagle1.head import Eagle1Head
from draftsmith.drafters.headfiles.directory import HeadError
from draftsmith.drafters.headfiles.read import HeadFacts, check_shipped_embeddings, check_tensors

LAYOUTS = ("draftsmith", "eagle", "sglang")
ROTARY = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
EMBED = "embed_tokens.weight"


def eagle1_layout(config: dict[str, Any], names: list[str] | set[str]) -> str | None:
    """The EAGLE-1 layout (``LAYOUTS``) of a head with this ``config.json`` and these tensor
    names, or None when it is no EAGLE-1 head."""
    arch = (config.get("architectures") or ["?"])[0]
    if arch == "EagleLlamaForCausalLM":
        return "draftsmith"
    if arch == "LlamaForCausalLMEagle":
        return "sglang"
    layers0 = any(n.startswith(("layers.0.", "model.layers.0.")) for n in names)
    midlayer = any(n.startswith(("midlayer.", "model.midlayer.")) for n in names)
    if arch == "LlamaForCausalLM" and layers0 and not midlayer and "draft_vocab_size" not in config:
        return "eagle"
    return None


def _biases(
    config: dict[str, Any], layout: str, tensors: dict[str, Tensor], notes: list[str]
) -> bool:
    """Whether the attention has biases, as the layout's consumer reads its config; settles
    ``fc.bias`` in ``tensors`` the way that consumer loads it."""
    if layout != "eagle":
        if "qkv_bias" in config:
            raise HeadError(f"head: qkv_bias in a {layout} config; convert reads it only in "
                            "SafeAILab's layout")  # fmt: skip
        return bool(config.get("attention_bias") or config.get("bias"))
    declared = bool(config.get("bias", True))  # ea_model.py: con["bias"], else True
    if declared and "fc.bias" not in tensors:
        notes.append("config.json's bias is true (SafeAILab's default when absent) but no "
                     "fc.bias ships: read as fc without a bias")  # fmt: skip
    if not declared and tensors.pop("fc.bias", None) is not None:
        notes.append("fc.bias dropped: config.json's bias is false, so SafeAILab never loads it")
    qkv = bool(config.get("qkv_bias", False))
    if qkv:  # cnets1.py: q/k/v biases only; ours (and vLLM's attention_bias) add o_proj's
        for name in [n for n in tensors if n.endswith("self_attn.o_proj.weight")]:
            tensors[name.replace(".weight", ".bias")] = tensors[name].new_zeros(len(tensors[name]))
    return qkv


def read_eagle1(
    head_dir: str | Path, files: tuple[dict[str, Any], dict[str, Tensor]]
) -> tuple[Eagle1Head, HeadFacts]:
    """The EAGLE-1 head in ``head_dir`` (any ``LAYOUTS`` layout, its (config, tensors) in
    ``files``) and its facts."""
    config, raw = files
    layout = eagle1_layout(config, set(raw))
    if layout is None:
        raise HeadError(f"head: {head_dir} is no EAGLE-1 layout convert knows ({LAYOUTS})")
    if config.get("hidden_act", "silu") != "silu":
        raise HeadError(f"head: hidden_act {config['hidden_act']!r}; EAGLE-1 heads use silu")
    tensors = {n.removeprefix("model."): v for n, v in raw.items() if not n.endswith(ROTARY)}
    if "fc.weight" not in tensors:
        raise HeadError(f"head: {head_dir} has no fc.weight; not an EAGLE-1 head")
    sizes = target_sizes(config)  # the head's own config: its sizes, rope and vocabulary
    h = sizes["hidden_size"]
    if list(tensors["fc.weight"].shape) != [h, 2 * h]:
        raise HeadError(
            f"head: fc.weight is {list(tensors['fc.weight'].shape)}; an EAGLE-1 head of "
            f"hidden size {h} fuses embedding and target state: [{h}, {2 * h}]"
        )
    facts = HeadFacts(
        layout=layout,
        source=str(head_dir),
        layer_ids=None,
        verifier=((config.get("speculators_config") or {}).get("verifier") or {}).get(
            "name_or_path"
        ),
        dtype=next(t.dtype for t in tensors.values() if t.is_floating_point()),
        kind="EAGLE-1",
    )
    if len(raw) > len(tensors):
        facts.notes.append("rotary buffers dropped: derived from the config")
    facts.embed_tokens = tensors.pop(EMBED, None)
    attention_bias = _biases(config, layout, tensors, facts.notes)
    head = Eagle1Head(
        **sizes,
        num_layers=int(config.get("num_hidden_layers", 1)),
        attention_bias=attention_bias,
        fc_bias="fc.bias" in tensors,
    )
    check_tensors(layout, head.state_dict(), tensors)
    head.load_state_dict({k: v.float() for k, v in tensors.items()})
    return head, facts


def fit_eagle1(head: Eagle1Head, facts: HeadFacts, target: TargetInfo | None) -> None:
    """Refuse, in one line, a head that cannot draft for ``target`` (hidden size,
    vocabulary, shipped embeddings); without a target, note what went unchecked."""
    if target is None:
        if facts.embed_tokens is not None:
            facts.notes.append("embed_tokens dropped unchecked (no target given)")
        return
    if head.hidden_size != target.hidden_size:
        raise HeadError(
            f"head: fuses target states of size {head.hidden_size}, but {target.path} has "
            f"hidden size {target.hidden_size}"
        )
    if head.vocab_size != target.vocab_size:
        raise HeadError(
            f"head: vocabulary of {head.vocab_size} ids, but {target.path} has {target.vocab_size}"
        )
    check_shipped_embeddings(facts, target)
