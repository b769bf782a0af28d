"""Write a trained DFlash drafter as a directory vLLM 0.32 serves with ``method: dflash``.

- ``config.json``: ``architectures: ["DFlashDraftModel"]``, ``model_type: "qwen3"``, the
  drafter's own sizes, the target's rope (vLLM would otherwise default rope_theta to 1e6)
  and vocabulary, and ``dflash_config: {mask_token_id, target_layer_ids, block_size}``.
  ``target_layer_ids`` are vLLM's 0-based ids (it taps ``i + 1``); no ``eagle_config`` or
  ``eagle_aux_hidden_state_layer_ids``, which vLLM would read first.
- ``model.safetensors``: vLLM's keys (its ``dflash.py``), no ``embed_tokens`` / ``lm_head``
  (the target's are shared) and no mask embedding.
- ``mask_embedding.pt`` when the mask embedding was trained: ``{"mask_token_id": int,
  "embedding": [H] tensor}``, which vLLM reads with ``torch.load(weights_only=True)`` and
  substitutes for ``embed_tokens[mask_token_id]`` in the mask slots.
- ``README.md``: how to serve it.

``dflash_config.block_size`` is informative: vLLM drafts ``num_speculative_tokens`` slots.

A drafter trained with a sliding window adds ``layer_types`` (all ``sliding_attention``),
``sliding_window``, ``use_sliding_window`` (transformers' ``Qwen3Config`` drops the window
without it) and ``dflash_config.swa_window_size``, and sets ``dflash_config.causal: false``:
vLLM (``qwen3_dflash._resolve_layer_attention``) otherwise makes sliding layers causal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.core.errors import ConfigError
from draftsmith.core.files import write_json_atomic
from draftsmith.core.readers import check_shape, read_torch
from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.headfiles.directory import (
    block_head_fields,
    card_text,
    section,
    state_tensors,
    write_head_dir,
)
from draftsmith.drafters.headfiles.windows import window_fields

ARCHITECTURE = "DFlashDraftModel"
MASK_EMBEDDING_FILE = "mask_embedding.pt"
NOT_IN_SAFETENSORS = ("embed_tokens", "mask_embedding")


def dflash_config(
    head: DFlashDrafter, target_config: dict[str, Any], dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The drafter's ``config.json`` (module docstring)."""
    config = {
        **block_head_fields(head, target_config, ARCHITECTURE, dtype),
        "dflash_config": {
            "mask_token_id": head.mask_token_id,
            "target_layer_ids": list(head.target_layer_ids),
            "block_size": head.block_size,
        },
    }
    if head.sliding_window is not None:  # every layer windowed, the block still both ways
        config |= window_fields(config["num_hidden_layers"], head.sliding_window)
        config["dflash_config"] |= {"swa_window_size": head.sliding_window, "causal": False}
    return config


def dflash_tensors(head: DFlashDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's weights in vLLM's keys, cast to ``dtype``."""
    return state_tensors(head, dtype, skip=NOT_IN_SAFETENSORS)  # tied norms: own copies


def write_mask_embedding(head: DFlashDrafter, out_dir: Path, dtype: torch.dtype) -> Path | None:
    """``mask_embedding.pt`` when the drafter trained one; None otherwise."""
    if head.mask_embedding is None:
        return None
    path = out_dir / MASK_EMBEDDING_FILE
    embedding = head.mask_embedding.detach().cpu().to(dtype).clone()
    torch.save({"mask_token_id": head.mask_token_id, "embedding": embedding}, path)
    return path


def read_mask_embedding(head_dir: Path) -> tuple[int, torch.Tensor] | None:
    """(mask_token_id, embedding [H]) from ``mask_embedding.pt``, read as vLLM reads it."""
    path = Path(head_dir) / MASK_EMBEDDING_FILE
    if not path.is_file():
        return None
    fix = "re-export the head with `draftsmith export`"
    state = check_shape(read_torch(path, "dflash embedding", fix), path, "dflash embedding", fix,
                        keys=("mask_token_id", "embedding"))  # fmt: skip
    return int(state["mask_token_id"]), state["embedding"].reshape(-1)


def export_dflash(
    head: DFlashDrafter,
    target: TargetInfo,
    out_dir: Path,
    *,
    layer_ids: list[int] | None = None,
    num_speculative_tokens: int | None = None,
    card: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``head`` for ``target`` to ``out_dir`` (atomically). ``layer_ids``: draftsmith
    ids, checked against the drafter's; ``num_speculative_tokens``: the card's suggestion,
    default block_size - 1; ``card``: extra model-card sections."""
    config = dflash_config(head, target.config, dtype)
    files = BlockHeadFiles(config, dflash_tensors(head, dtype), model_card)
    return files.write(head, target, out_dir, layer_ids, num_speculative_tokens, card, dtype)


@dataclass
class BlockHeadFiles:
    """What a DFlash-family directory holds (DFlash2 writes its own config, tensors, card)."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    card: Callable[..., str]
    """``card(config, target path, final directory, k, card sections)`` -> README.md."""

    def write(self, head: DFlashDrafter, target: TargetInfo, out_dir: Path,
              layer_ids: list[int] | None, num_speculative_tokens: int | None,
              card: dict[str, Any] | None, dtype: torch.dtype) -> Path:  # fmt: skip
        """The directory, atomically: the files, ``mask_embedding.pt`` and the card."""
        if layer_ids is not None and [i - 1 for i in layer_ids] != head.target_layer_ids:
            raise ConfigError(
                f"layer_ids {layer_ids} do not match the drafter's target_layer_ids "
                f"{head.target_layer_ids} (+1 each); export the checkpoint as it was trained"
            )
        k = num_speculative_tokens or head.block_size - 1

        def write(tmp: Path) -> None:
            save_file(self.tensors, tmp / "model.safetensors", {"format": "pt"})
            write_mask_embedding(head, tmp, dtype)
            write_json_atomic(tmp / "config.json", self.config)
            final = Path(out_dir).absolute()
            readme = self.card(self.config, target.path, final, k, card or {})
            (tmp / "README.md").write_text(readme)

        return write_head_dir(out_dir, write)


def model_card(
    config: dict[str, Any], target: str, out_dir: Path, k: int, card: dict[str, Any]
) -> str:
    """README.md: what the drafter is, how to serve it, then the ``card`` sections."""
    dflash = config["dflash_config"]
    facts = {
        "target (verifier)": target,
        "method": f"vLLM `method: dflash`, `{ARCHITECTURE}`",
        "draft layers": config["num_hidden_layers"],
        "target_layer_ids": f"{dflash['target_layer_ids']} (0-based; vLLM taps id + 1)",
        "mask_token_id": dflash["mask_token_id"],
        "block_size (trained)": dflash["block_size"],
        "dtype": config["torch_dtype"],
    }
    spec = json.dumps({"method": "dflash", "model": str(out_dir), "num_speculative_tokens": k})
    parts = [
        f"# DFlash drafter for `{target}`",
        section(facts),
        "## Use it",
        f"vLLM drafts `num_speculative_tokens` slots per block (trained with {k}):",
        f"```bash\nvllm serve {target} --speculative-config '{spec}'\n```",
    ]
    return card_text(parts, target, spec, card)
