"""The few target tensors a draft head shares: embeddings, final norm and lm_head.

They are read straight from the target's safetensors (through the index when sharded), so
training never loads the whole target: for Llama-3.1-8B that is 2 x 0.5B parameters instead
of 8B. Tied embeddings (``tie_word_embeddings``, as SmolLM2) give the lm_head.
``load_target_layer`` reads one decoder layer the same way (``model.init_from_target``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from draftsmith.core.readers import check_shape, open_safetensors, read_json
from draftsmith.core.targets import TargetError, TargetInfo, resolve_model

FIX = "restore the model's files, or point --model at another model directory"

# Checkpoint names tried in order (plain Llama/Qwen, then multimodal wrappers).
NAMES = {
    "embed": ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
    "norm": ("model.norm.weight", "model.language_model.norm.weight"),
    "lm_head": ("lm_head.weight", "model.lm_head.weight"),
}
LAYER_PREFIXES = ("model.layers.{i}.", "model.language_model.layers.{i}.")
# Text model types whose RMSNorm scales by (1 + w) (zero-initialised w; vLLM's GemmaRMSNorm as
# ``qwen3_next.py`` / ``qwen3_5.py`` import it): ``TargetWeights.norm`` is then 1 + w.
OFFSET_NORM_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


@dataclass
class TargetWeights:
    """Frozen target tensors: ``embed`` [V, H], ``lm_head`` [V, H], ``norm`` [H] (the
    effective final-norm scale: ``x * rsqrt(mean(x^2) + eps) * norm``), ``norm_eps``."""

    embed: Tensor
    lm_head: Tensor
    norm: Tensor
    norm_eps: float


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "safetensors index", FIX, keys=("weight_map",))["weight_map"]
        check_shape(weight_map, index, "safetensors index", FIX)
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise TargetError(
            f"model: {model_dir} has no model.safetensors(.index.json); draftsmith reads the "
            "target's embeddings and lm_head from safetensors (convert .bin checkpoints first)."
        )
    with open_safetensors(single, "target weights", FIX) as f:
        return {name: single for name in f.keys()}


def target_dir(model: str) -> Path:
    """The local directory of target ``model`` (a directory, hub id or short name); a hub id
    is downloaded, its json and safetensors files only."""
    model_dir = Path(resolve_model(model))
    if not model_dir.is_dir():
        from huggingface_hub import snapshot_download

        model_dir = Path(
            snapshot_download(str(model_dir), allow_patterns=["*.json", "*.safetensors"])
        )
    return model_dir


def read_tensor(files: dict[str, Path], name: str, dtype: torch.dtype) -> Tensor:
    with open_safetensors(files[name], "target weights", FIX) as f:
        return f.get_tensor(name).to(dtype)


def load_target_layer(
    model: str, layer: int, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """Decoder layer ``layer`` (0-based) of target ``model``, keyed inside the layer:
    ``self_attn.q_proj.weight`` [n_heads * hd, H], ``mlp.up_proj.weight`` [I, H],
    ``input_layernorm.weight`` [H], ... (biases and extra norms as the checkpoint has them)."""
    model_dir = target_dir(model)
    files = tensor_files(model_dir)
    for prefix in (p.format(i=layer) for p in LAYER_PREFIXES):
        names = [n for n in files if n.startswith(prefix)]
        if names:
            return {n.removeprefix(prefix): read_tensor(files, n, dtype) for n in names}
    tried = [p.format(i=layer) + "*" for p in LAYER_PREFIXES]
    raise TargetError(f"model: {model_dir} has no tensors of decoder layer {layer} ({tried})")


def load_target_weights(target: TargetInfo, dtype: torch.dtype = torch.float32) -> TargetWeights:
    """Read the shared tensors of ``target`` (from ``read_target``)."""
    model_dir = target_dir(target.path)
    config, text = target.config, target.text_config
    files = tensor_files(model_dir)

    def read(kind: str) -> Tensor | None:
        name = next((n for n in NAMES[kind] if n in files), None)
        return None if name is None else read_tensor(files, name, dtype)

    embed, norm, lm_head = read("embed"), read("norm"), read("lm_head")
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    if lm_head is None and tied is not False:
        # Tied, or the flag left to a config class whose default ties (as vLLM reads it): a
        # checkpoint without an lm_head can only be served with the embeddings as its lm_head.
        lm_head = embed
    missing = [k for k, v in (("embed", embed), ("norm", norm), ("lm_head", lm_head)) if v is None]
    if missing:
        tried = [n for k in missing for n in NAMES[k]]
        raise TargetError(f"model: {model_dir} has none of the tensors {tried}")
    if text.get("model_type") in OFFSET_NORM_TYPES:
        norm = norm + 1.0
    return TargetWeights(embed, lm_head, norm, float(text.get("rms_norm_eps", 1e-6)))
