"""Write a trained DFlash2 drafter as the directory vLLM 0.32 loads as ``DFlash2DraftModel``,
and read one back (``draftsmith convert``).

What vLLM reads (``model_executor/models/qwen3_dflash2.py``, ``qwen3_dflash.py``,
``v1/worker/gpu/spec_decode/dflash2/speculator.py``):

- ``config.json``: DFlash's (``drafters/dflash/export.py``: ``model_type: "qwen3"``, the
  drafter's sizes, the target's rope and vocabulary) with ``architectures:
  ["DFlash2DraftModel"]`` (``method: dflash`` then builds ``DFlash2Speculator``) and
  ``dflash_config: {mask_token_id, target_layer_ids, block_size, conv_kernel_size,
  conv_group_size, selector_rank, selector_top_k}``. No ``layer_types``: every layer is full,
  non-causal attention. No ``input_embedding_scale`` / ``output_multiplier`` /
  ``final_logit_softcapping``: vLLM's defaults (1, 1, none) are what this drafter computes.
- ``model.safetensors``: DFlash's keys plus ``layers.{i}.{attention,mlp}_conv.base_kernel``,
  ``layers.{i}.{attention,mlp}_conv.kernel_projection.weight`` and
  ``candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection.weight}``
  (vLLM prefixes ``model.``); no ``embed_tokens`` / ``lm_head`` (the target's are shared).
- ``mask_embedding.pt`` when the mask embedding was trained (DFlash's file, read by the same
  loader).

vLLM drafts ``num_speculative_tokens`` slots and sizes the convolution's blocks
``1 + num_speculative_tokens``; ``dflash_config.block_size`` is informative. Serve with k =
block_size - 1 (fewer works: taps never cross a block's start).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.dflash.export import (
    NOT_IN_SAFETENSORS,
    BlockHeadFiles,
    read_mask_embedding,
)
from draftsmith.drafters.dflash2.model import DFlash2Drafter
from draftsmith.drafters.headfiles.directory import (
    HeadError,
    block_head_fields,
    card_text,
    section,
    state_tensors,
)
from draftsmith.drafters.headfiles.read import block_layer_kwargs, check_tensors, read_head_files
from draftsmith.drafters.headfiles.windows import trained_window, window_fields

ARCHITECTURE = "DFlash2DraftModel"
SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def dflash2_config(
    head: DFlash2Drafter, target_config: dict[str, Any], dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The drafter's ``config.json`` (module docstring)."""
    config = {
        **block_head_fields(head, target_config, ARCHITECTURE, dtype),
        "dflash_config": {
            "mask_token_id": head.mask_token_id,
            "target_layer_ids": list(head.target_layer_ids),
            "block_size": head.block_size,
            **{k: head.init_kwargs[k] for k in SIZES},
        },
    }
    if head.sliding_window is not None:  # as DFlash's: every layer windowed, blocks both ways
        config |= window_fields(config["num_hidden_layers"], head.sliding_window)
        config["dflash_config"] |= {"swa_window_size": head.sliding_window, "causal": False}
    return config


def dflash2_tensors(head: DFlash2Drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's weights in vLLM's keys, cast to ``dtype``."""
    return state_tensors(head, dtype, skip=NOT_IN_SAFETENSORS)


def export_dflash2(
    head: DFlash2Drafter,
    target: TargetInfo,
    out_dir: Path,
    *,
    layer_ids: list[int] | None = None,
    num_speculative_tokens: int | None = None,
    card: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``head`` for ``target`` to ``out_dir`` (atomically). ``layer_ids``: draftsmith
    ids, checked against the drafter's; ``num_speculative_tokens``: the card's k (default
    block_size - 1); ``card``: extra model-card sections."""
    config = dflash2_config(head, target.config, dtype)
    files = BlockHeadFiles(config, dflash2_tensors(head, dtype), model_card)
    return files.write(head, target, out_dir, layer_ids, num_speculative_tokens, card, dtype)


def model_card(
    config: dict[str, Any], target: str, out_dir: Path, k: int, card: dict[str, Any]
) -> str:
    """README.md: what the drafter is, how to serve it (GPU only), then the ``card``."""
    dflash = config["dflash_config"]
    facts = {
        "target (verifier)": target,
        "method": f"vLLM `method: dflash`, `{ARCHITECTURE}` (V2 GPU model runner only)",
        "draft layers": config["num_hidden_layers"],
        "target_layer_ids": f"{dflash['target_layer_ids']} (0-based; vLLM taps id + 1)",
        "mask_token_id": dflash["mask_token_id"],
        "block_size (trained)": dflash["block_size"],
        **{name: dflash[name] for name in SIZES},
        "dtype": config["torch_dtype"],
    }
    spec = json.dumps({"method": "dflash", "model": str(out_dir), "num_speculative_tokens": k})
    parts = [
        f"# DFlash2 drafter for `{target}`",
        section(facts),
        "## Use it",
        f"vLLM drafts `num_speculative_tokens` slots per block (trained with block_size "
        f"{dflash['block_size']}: k = {dflash['block_size'] - 1}), in its V2 GPU model runner "
        "only (the V1 runner, and so vLLM's CPU build, refuses DFlash2 drafts). At temperature "
        "> 0, `draft_sample_method: probabilistic` samples the selector's path:",
        f"```bash\nvllm serve {target} --speculative-config '{spec}'\n```",
    ]
    return card_text(parts, target, spec, card)


def read_vllm(head_dir: str | Path) -> DFlash2Drafter:
    """The drafter of a vLLM-layout DFlash2 directory (this module's, or z-lab's published
    files with the fields this drafter builds); refuses, in one line, what it does not build."""
    config, tensors = read_head_files(head_dir)
    dflash = config.get("dflash_config") or {}
    where = f"head: {head_dir}"
    if (config.get("architectures") or ["?"])[0] != ARCHITECTURE or not dflash:
        raise HeadError(f"{where} is not a DFlash2DraftModel directory; give one export wrote")
    window = trained_window(config)
    unbuilt = ("layer_types", "input_embedding_scale", "output_multiplier",
               "final_logit_softcapping")  # fmt: skip
    extras = [k for k in unbuilt if (config.get(k) or dflash.get(k))
              and not (k == "layer_types" and window)]  # fmt: skip
    if extras:
        raise HeadError(f"{where} sets {extras}; draftsmith's DFlash2 drafter builds none of them")
    layers = config["num_hidden_layers"]
    norms = [tensors.get(f"layers.{i}.self_attn.k_norm.weight") for i in range(layers)]
    tied = all(n is not None and torch.equal(n, norms[0]) for n in norms) and layers > 1
    head = DFlash2Drafter(
        **block_layer_kwargs(config), target_layer_ids=dflash["target_layer_ids"],
        mask_token_id=dflash["mask_token_id"], block_size=dflash.get("block_size", 8),
        tie_k_norm=tied, sliding_window=window,
        train_mask_embedding=(Path(head_dir) / "mask_embedding.pt").is_file(),
        **{k: dflash[k] for k in SIZES},
    )  # fmt: skip
    state = head.state_dict()
    expected = {n: v for n, v in state.items() if n not in NOT_IN_SAFETENSORS}
    check_tensors("vLLM DFlash2", expected, tensors)
    with torch.no_grad():
        for name, value in tensors.items():
            state[name].copy_(value)
        if head.mask_embedding is not None:
            head.mask_embedding.copy_(read_mask_embedding(Path(head_dir))[1])
    return head
