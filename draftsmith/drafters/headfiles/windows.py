"""Sliding windows in a head's ``config.json``: the fields vLLM 0.32 reads, and the line that
says when vLLM would serve a windowed head without its window.

vLLM picks the draft class from the head's own config, never from the target: a config with
a top-level ``model_type`` is read as that model's config and ``method: eagle3`` prefixes
its ``architectures[0]`` with ``Eagle3`` unless it has it (``transformers_utils/configs/
eagle.py``); a speculators-only config maps ``transformer_layer_config.model_type`` qwen3 ->
``Eagle3Qwen3ForCausalLM``, llama -> ``Eagle3LlamaForCausalLM`` (``speculators/algos.py``).
``Eagle3Qwen3ForCausalLM`` (``qwen3_eagle3.py``) gives layer i the top-level
``sliding_window`` when ``layer_types[i] == "sliding_attention"``; ``Eagle3LlamaForCausalLM``
(``llama_eagle3.py``, every other EAGLE-3 name) reads no window; DFlash
(``qwen3_dflash.py``) reads ``layer_types`` and ``dflash_config.swa_window_size`` (else
``sliding_window``), and makes sliding layers causal unless ``dflash_config.causal`` says
otherwise. transformers' ``Qwen3Config`` keeps ``sliding_window`` only with
``use_sliding_window: true``.
"""

from __future__ import annotations

from typing import Any

# The EAGLE-3 draft classes vLLM 0.32 builds from qwen3_eagle3.py (its model registry).
QWEN3_EAGLE3 = ("Eagle3Qwen3ForCausalLM", "PeagleQwen3ForCausalLM")


def eagle3_class(config: dict[str, Any]) -> str:
    """The architecture vLLM 0.32 looks up for an EAGLE-3 head with this ``config.json``."""
    if config.get("model_type") is None and "speculators_config" in config:
        kind = (config.get("transformer_layer_config") or {}).get("model_type", "llama")
        return "Eagle3Qwen3ForCausalLM" if kind == "qwen3" else "Eagle3LlamaForCausalLM"
    arch = (config.get("architectures") or ["?"])[0]
    return arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"


def window_fields(num_layers: int, window: int) -> dict[str, Any]:
    """The ``config.json`` fields of ``num_layers`` draft layers all windowed to ``window``."""
    return {
        "layer_types": ["sliding_attention"] * num_layers,
        "sliding_window": window,
        "use_sliding_window": True,
        "max_window_layers": 0,
    }


def trained_window(config: dict[str, Any]) -> int | None:
    """The window a head's ``config.json`` says its layers were trained with (None: full)."""
    layers = config.get("layer_types") or []
    dflash = config.get("dflash_config") or {}
    if "sliding_attention" in layers or dflash.get("use_swa"):
        return dflash.get("swa_window_size") or config.get("sliding_window")
    return None


def window_note(config: dict[str, Any]) -> str | None:
    """One line when vLLM 0.32 would serve this head without the window it was trained with
    (then the served head is not the trained one); None when it applies it, or there is none."""
    window = trained_window(config)
    if window is None:
        return None
    if "dflash_config" in config:
        dflash = config.get("dflash_config") or {}
        if not (dflash.get("swa_window_size") or config.get("use_sliding_window")):
            lost = "its Qwen3Config drops sliding_window without use_sliding_window: true"
        elif dflash.get("causal") is not False and config.get("is_causal") is not False:
            return (
                f"vLLM 0.32 runs this drafter's sliding_window {window} layers causally "
                "(dflash_config.causal is not false), a block trained both ways: the served "
                "drafter is not the trained one"
            )
        else:
            return None
    elif (arch := eagle3_class(config)) not in QWEN3_EAGLE3:
        lost = f"{arch} is a Llama EAGLE-3 draft there (llama_eagle3.py), which reads no window"
    elif not config.get("use_sliding_window"):
        lost = "its Qwen3Config drops sliding_window without use_sliding_window: true"
    else:
        return None
    return (
        f"the head was trained with sliding_window {window}, but vLLM 0.32 serves it with full "
        f"attention ({lost}): the served head is not the trained one"
    )
