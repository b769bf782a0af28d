"""A DSpark drafter in vllm-project/speculators' layout (``draftsmith export --to speculators``),
written and read back.

What speculators writes for DSpark (``src/speculators/models/dspark/config.py``,
``.../dspark/core.py``, ``.../dflash/config.py``, ``.../dflash/core.py`` and ``model.py`` at
commit c05b95b3, main of 2026-08-20; DSpark came with speculators #677):

- ``config.json``: ``DSparkSpeculatorConfig`` (``speculators_model_type: "dspark"``,
  ``architectures: ["DSparkSpeculator"]``, no top-level ``model_type``) with the DFlash fields
  it inherits (``transformer_layer_config``: a Qwen3 config of the draft layers,
  ``draft_vocab_size``, ``block_size``, ``target_hidden_size``, ``aux_hidden_state_layer_ids``,
  ``mask_token_id``, ``sliding_window_non_causal``) and its own (``sample_from_anchor``,
  ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
  ``confidence_head_with_markov``), plus ``speculators_config`` (greedy proposal of
  ``block_size`` tokens when ``sample_from_anchor``, the verifier).
  ``aux_hidden_state_layer_ids`` count the embeddings as 0 (id k: after k decoder layers,
  draftsmith's layer ids): vLLM's ``update_dspark`` (``transformers_utils/configs/
  speculators/algos.py``) turns them into ``target_layer_ids`` = id - 1.
- ``model.safetensors``: the module's state minus what ``_keys_to_ignore_on_save`` drops
  (``verifier_lm_head``, ``verifier_norm``): vLLM's names (``fc``, ``hidden_norm``, ``norm``,
  ``layers.{i}.*``, ``markov_head.markov_w{1,2}``, ``confidence_head.proj.*``) plus
  ``embed_tokens.weight`` and ``lm_head.weight``, copies of the verifier's (``t2d`` / ``d2t``
  only for a reduced vocabulary, never here). speculators' loader lists only ``embed_tokens``
  among the keys a checkpoint may lack and refills a table from the verifier only while it is
  NaN, so both are written; vLLM compares them with the target's and shares the target's when
  equal (``_should_share``).

The export keeps the confidence head in float32 as the vLLM layout does (vLLM reads either).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.drafters.dspark.model import DSparkDrafter
from draftsmith.drafters.headfiles.directory import HeadError, block_head_fields, speculators_fields
from draftsmith.drafters.headfiles.read import check_tensors, read_head_files
from draftsmith.drafters.target.weights import TargetWeights

ARCHITECTURE = "DSparkSpeculator"
SHARED = ("embed_tokens.weight", "lm_head.weight")  # the verifier's tables, copied
NOT_LAYER = ("architectures", "target_hidden_size", "torch_dtype")


def speculators_config(
    head: DSparkDrafter,
    target_config: dict[str, Any],
    verifier: str,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The drafter's speculators ``config.json`` (module docstring); ``verifier``: the
    target's name or path."""
    fields = block_head_fields(head, target_config, ARCHITECTURE, dtype)
    layer = {k: v for k, v in fields.items() if k not in NOT_LAYER}
    return {
        "architectures": [ARCHITECTURE],
        **speculators_fields("dspark", layer, head.block_size, verifier, target_config),
        "draft_vocab_size": head.vocab_size,
        "block_size": head.block_size,
        "target_hidden_size": fields["target_hidden_size"],
        "aux_hidden_state_layer_ids": [i + 1 for i in head.target_layer_ids],
        "mask_token_id": head.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": True,
        "markov_rank": head.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": head.confidence_head is not None,
        "confidence_head_with_markov": True,
        "torch_dtype": fields["torch_dtype"],
    }


def speculators_tensors(
    drafter_tensors: dict[str, Tensor], weights: TargetWeights, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The drafter's tensors (vLLM's names) plus the verifier's ``embed_tokens`` [V, H] and
    ``lm_head`` [V, H] in ``dtype``, as speculators saves them."""
    tables = {"embed_tokens.weight": weights.embed, "lm_head.weight": weights.lm_head}
    copies = {n: t.detach().to("cpu", dtype, copy=True).contiguous() for n, t in tables.items()}
    return {**drafter_tensors, **copies}


def drafter_kwargs(config: dict[str, Any], where: str) -> dict[str, Any]:
    """``DSparkDrafter`` arguments from a speculators DSpark ``config.json``; refuses, in one
    line, a variant this drafter does not build."""
    if config.get("speculators_model_type") != "dspark":
        kind = config.get("speculators_model_type")
        raise HeadError(
            f"head: {where} is not a speculators DSpark head (speculators_model_type {kind!r}); "
            "give one written for dspark"
        )
    layer = config["transformer_layer_config"]
    unsupported = {
        "markov_head_type": (config.get("markov_head_type", "vanilla"), "vanilla"),
        "sample_from_anchor": (config.get("sample_from_anchor", True), True),
        "confidence_head_with_markov": (config.get("confidence_head_with_markov", True), True),
        "draft_vocab_size": (config.get("draft_vocab_size"), layer["vocab_size"]),
    }
    for name, (value, ours) in unsupported.items():
        if value != ours:
            raise HeadError(
                f"head: {where} has {name} {value!r}; draftsmith's DSpark drafter builds "
                f"{name} {ours!r} only"
            )
    rope = dict(layer.get("rope_parameters") or {"rope_theta": layer.get("rope_theta", 1e4)})
    theta = rope.pop("rope_theta")
    return {
        "hidden_size": layer["hidden_size"],
        "num_heads": layer["num_attention_heads"],
        "num_kv_heads": layer.get("num_key_value_heads"),
        "head_dim": layer.get("head_dim"),
        "intermediate_size": layer["intermediate_size"],
        "vocab_size": layer["vocab_size"],
        "num_layers": layer["num_hidden_layers"],
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
        "target_hidden_size": config.get("target_hidden_size"),
        "target_layer_ids": [i - 1 for i in config["aux_hidden_state_layer_ids"]],
        "mask_token_id": config["mask_token_id"],
        "block_size": config["block_size"],
        "markov_rank": config["markov_rank"],
        "confidence_head": bool(config.get("enable_confidence_head", True)),
    }


def read_speculators(head_dir: str | Path) -> tuple[DSparkDrafter, dict[str, Tensor]]:
    """(the drafter, the verifier tables the files ship) of a speculators DSpark directory."""
    config, tensors = read_head_files(head_dir)
    try:
        head = DSparkDrafter(**drafter_kwargs(config, str(head_dir)))
    except KeyError as missing:
        raise HeadError(
            f"head: {head_dir}/config.json lacks {missing}; give the directory speculators "
            "(or draftsmith export --to speculators) wrote"
        ) from None
    shared = {n: tensors.pop(n) for n in SHARED if n in tensors}
    expected = {n: v for n, v in head.state_dict().items() if n != "embed_tokens"}
    check_tensors("speculators", expected, tensors)
    with torch.no_grad():
        for name, value in tensors.items():
            expected[name].copy_(value)
    return head, shared
