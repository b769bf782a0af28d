"""What reading a published head directory shares, whatever its kind (``convert``,
``model.init_from``).

- ``read_head_files``: ``config.json`` and every tensor (``*.safetensors``, else
  ``pytorch_model.bin``), refused in one line when either is missing.
- ``HeadFacts``: what a head's files say beyond its weights (layout, taps, verifier, dtype,
  shipped embeddings, notes for the model card).
- ``check_shipped_embeddings``: a head that ships ``embed_tokens`` must ship the target's:
  every consumer convert writes for shares the target's table.
- ``block_layer_kwargs``: a block drafter's (DFlash2, DSpark) layer sizes from its vLLM config.

Each kind's ``layouts.py`` turns the files into its head; no kind imports another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.core.readers import check_shape, read_json, read_safetensors, read_torch
from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.headfiles.directory import HeadError
from draftsmith.drafters.target.weights import TargetWeights, load_target_weights


@dataclass
class HeadFacts:
    """What a head's files say beyond its weights."""

    layout: str
    source: str
    layer_ids: list[int] | None
    """Tapped target layers (vLLM's meaning); None until a target gives the default, and
    always None for EAGLE-1 (it reads the target's final state)."""
    layer_ids_defaulted: bool = False
    """True when the source named no ids and the default ``[2, N // 2, N - 3]`` was used."""
    verifier: str | None = None
    """The target the source names (speculators ``verifier.name_or_path``), if any."""
    lm_head_from_target: bool = False
    """The source shipped no ``lm_head``: its rows were taken from the target's."""
    dtype: torch.dtype = torch.bfloat16
    embed_tokens: Tensor | None = None
    """Embeddings the source shipped (dropped: every consumer here shares the target's;
    ``check_shipped_embeddings`` refuses them when they differ from the target's)."""
    notes: list[str] = field(default_factory=list)
    kind: str = "EAGLE-3"
    """The head's kind as the model card names it (EAGLE-3, EAGLE-1)."""


FIX = "give the head's directory as published, or download it again"
INDEX = "model.safetensors.index.json"


def read_tensors(head_dir: Path) -> dict[str, Tensor]:
    """Every tensor of a head directory: the files a sharded index names, else every
    ``*.safetensors``, else ``pytorch_model.bin`` (plain tensors only: no code runs)."""
    index = head_dir / INDEX
    if index.is_file():
        weight_map = read_json(index, "safetensors index", FIX, keys=("weight_map",))["weight_map"]
        check_shape(weight_map, index, "safetensors index", FIX)
        files = sorted({head_dir / str(name) for name in weight_map.values()})
    else:
        files = sorted(head_dir.glob("*.safetensors"))
    tensors: dict[str, Tensor] = {}
    for f in files:
        tensors.update(read_safetensors(f, "head weights", FIX))
    if not files:
        binary = head_dir / "pytorch_model.bin"
        if not binary.is_file():
            raise HeadError(f"head: {head_dir} has no *.safetensors and no pytorch_model.bin")
        tensors = read_torch(binary, "head pickle", FIX)
        check_shape(tensors, binary, "head pickle", FIX)
        if not all(isinstance(t, Tensor) for t in tensors.values()):
            raise HeadError(f"head: {binary} holds values that are not tensors; {FIX}")
    return tensors


def read_head_config(head_dir: str | Path, fix: str = FIX) -> dict[str, Any]:
    """A head directory's ``config.json`` (an object), refused in one line otherwise."""
    config_file = Path(head_dir) / "config.json"
    if not config_file.is_file():
        raise HeadError(f"head: {head_dir} has no config.json; {fix}")
    return read_json(config_file, "head config", fix)


def read_head_files(head_dir: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(``config.json``, every tensor) of a head directory; a whole model is refused."""
    head_dir = Path(head_dir)
    config, tensors = read_head_config(head_dir), read_tensors(head_dir)
    if whole := whole_model(config, tensors):
        raise HeadError(
            f"head: {head_dir} is {whole}, not a draft head; give a head's directory (to start "
            "a head from the target's own layers, use model.init_from_target: true)"
        )
    return config, tensors


def whole_model(config: dict[str, Any], tensors: dict[str, Tensor]) -> str | None:
    """ "a model with N decoder layers (ARCH)" when the files are a whole model's (its
    embeddings and a stack of ``model.layers.*``, no draft head's ``fc``), else None."""
    layers = {n.split(".")[2] for n in tensors if n.startswith("model.layers.")}
    if "fc.weight" in tensors or "model.fc.weight" in tensors or len(layers) < 2:
        return None
    arch = (config.get("architectures") or ["?"])[0]
    return f"a model with {len(layers)} decoder layers ({arch})"


def check_shipped_embeddings(facts: HeadFacts, target: TargetInfo) -> TargetWeights | None:
    """Refuse shipped ``embed_tokens`` that differ from ``target``'s (equal up to dtype
    rounding: a bf16 target's table saved in fp16 stays equal); note their drop otherwise.
    Returns the target's weights when they had to be read, else None."""
    if facts.embed_tokens is None:
        return None
    weights = load_target_weights(target)
    mine, theirs = facts.embed_tokens.float(), weights.embed.float()
    if mine.shape != theirs.shape or not torch.allclose(mine, theirs, 1e-2, 1e-4):
        raise HeadError(
            "head: ships embed_tokens that differ from the target's; the consumers "
            "convert writes for share the target's, so it would serve another model"
        )
    facts.notes.append("embed_tokens dropped: equal to the target's, which is shared")
    return weights


def check_tensors(layout: str, expected: dict[str, Tensor], found: dict[str, Tensor]) -> None:
    """Refuse, in one line, a head whose tensor names or shapes differ from what its
    config builds (``expected``: the built head's state)."""
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or extra:
        raise HeadError(
            f"head: {layout} layout, but tensors {missing[:4]} are missing and "
            f"{extra[:4]} are unknown"
        )
    for name, value in found.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise HeadError(
                f"head: {name} is {list(value.shape)}, the config says {list(expected[name].shape)}"
            )


def block_layer_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """A block drafter's layer arguments (sizes, norm, rope, vocabulary, layer count, the
    target's width) from its vLLM-layout ``config.json``: what ``headfiles.layer_fields`` wrote."""
    from draftsmith.drafters.attention.llama import target_sizes

    sizes = target_sizes(config)
    del sizes["max_position_embeddings"]  # vLLM builds a block drafter's rope from its config
    return {**sizes, "num_layers": config["num_hidden_layers"],
            "target_hidden_size": config.get("target_hidden_size")}  # fmt: skip
