"""Write a trained DSpark drafter as the directory vLLM 0.32 loads as ``Qwen3DSparkModel``.

What vLLM reads (``model_executor/models/qwen3_dspark.py``, ``qwen3_dflash.py``,
``config/speculative.py``, ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``):

- ``config.json``: ``architectures: ["Qwen3DSparkModel"]`` (selects ``method: dspark``),
  ``model_type: "qwen3"``, the drafter's layer sizes and the target's rope and vocabulary;
  ``target_layer_ids`` (0-based: vLLM taps ``i + 1`` when no ``eagle_aux_hidden_state_layer_ids``
  or ``dflash_config`` says otherwise), ``mask_token_id``, ``block_size`` (vLLM's default
  ``num_speculative_tokens``), ``markov_rank``, ``markov_head_type: "vanilla"``,
  ``enable_confidence_head``, ``confidence_head_with_markov: true``,
  ``sample_from_anchor: true`` (the anchor slot predicts the first draft) and
  ``draft_vocab_size`` = the target's vocabulary (no ``d2t``).
- ``model.safetensors``: ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``,
  ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm
  .weight``, ``markov_head.markov_w1.weight`` [V, r], ``markov_head.markov_w2.weight`` [V, r],
  ``confidence_head.proj.{weight,bias}`` (float32: vLLM keeps the head in float32). No
  ``embed_tokens`` / ``lm_head`` (vLLM shares the target's) and no mask embedding (vLLM's
  DSpark loader drops it: mask slots read the target's row of ``mask_token_id``).
- ``README.md``: how to serve it.

``to="speculators"`` writes vllm-project/speculators' DSpark layout instead
(``speculators.py``): ``vllm serve DIR`` alone serves it, and speculators' own loader reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.core.errors import ConfigError
from draftsmith.core.files import write_json_atomic
from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.dspark.model import DSparkDrafter
from draftsmith.drafters.dspark.speculators import (
    read_speculators,
    speculators_config,
    speculators_tensors,
)
from draftsmith.drafters.headfiles.directory import (
    HeadError,
    block_head_fields,
    card_text,
    section,
    state_tensors,
    write_head_dir,
)
from draftsmith.drafters.headfiles.read import block_layer_kwargs, check_tensors, read_head_files
from draftsmith.drafters.target.weights import load_target_weights

ARCHITECTURE = "Qwen3DSparkModel"
LAYOUTS = ("vllm", "speculators")


def dspark_config(
    head: DSparkDrafter, target_config: dict[str, Any], dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The drafter's ``config.json`` (module docstring)."""
    k = head.init_kwargs
    return {
        **block_head_fields(head, target_config, ARCHITECTURE, dtype),
        "draft_vocab_size": k["vocab_size"],
        "target_layer_ids": list(head.target_layer_ids),
        "mask_token_id": head.mask_token_id,
        "block_size": head.block_size,
        "markov_rank": head.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": head.confidence_head is not None,
        "confidence_head_with_markov": True,
        "sample_from_anchor": True,
    }


def dspark_tensors(head: DSparkDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's weights in vLLM's keys: ``dtype``, the confidence head float32."""
    out = state_tensors(head, dtype)
    for name in [n for n in out if n.startswith("confidence_head.")]:
        out[name] = out[name].float()
    return out


def export_dspark(
    head: DSparkDrafter,
    target: TargetInfo,
    out_dir: Path,
    *,
    layer_ids: list[int] | None = None,
    num_speculative_tokens: int | None = None,
    card: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    to: str = "vllm",
) -> Path:
    """Write ``head`` for ``target`` to ``out_dir`` (atomically). ``layer_ids``: draftsmith
    ids, checked against the drafter's; ``num_speculative_tokens``: the card's suggestion,
    default block_size; ``card``: extra model-card sections; ``to``: the layout, vllm or
    speculators (module docstring)."""
    if to not in LAYOUTS:
        raise ConfigError(f"to: {to!r} is not a DSpark layout; use one of {list(LAYOUTS)}")
    if layer_ids is not None and [i - 1 for i in layer_ids] != head.target_layer_ids:
        raise ConfigError(
            f"layer_ids {layer_ids} do not match the drafter's target_layer_ids "
            f"{head.target_layer_ids} (+1 each); export the checkpoint as it was trained"
        )
    config = facts = dspark_config(head, target.config, dtype)
    k = num_speculative_tokens or head.block_size
    tensors = dspark_tensors(head, dtype)
    if to == "speculators":  # its config names k: the whole block, as speculators writes it
        config = speculators_config(head, target.config, target.path, dtype)
        tensors = speculators_tensors(tensors, load_target_weights(target), dtype)
        k = head.block_size

    def write(tmp: Path) -> None:
        save_file(tensors, tmp / "model.safetensors", {"format": "pt"})
        write_json_atomic(tmp / "config.json", config)
        final = Path(out_dir).absolute()
        text = model_card(facts, target.path, final, k, card or {}, to)
        (tmp / "README.md").write_text(text)

    return write_head_dir(out_dir, write)


def model_card(
    config: dict[str, Any],
    target: str,
    out_dir: Path,
    k: int,
    card: dict[str, Any],
    to: str = "vllm",
) -> str:
    """README.md: what the drafter is (``config``: its vLLM-layout config), how to serve the
    ``to`` layout, then the ``card`` sections."""
    facts = {
        "layout": "vllm-project/speculators (DSparkSpeculator)" if to == "speculators" else "vLLM",
        "target (verifier)": target,
        "method": f"vLLM `method: dspark`, `{ARCHITECTURE}` (V2 GPU model runner only)",
        "draft layers": config["num_hidden_layers"],
        "target_layer_ids": f"{config['target_layer_ids']} (0-based; vLLM taps id + 1)",
        "mask_token_id": config["mask_token_id"],
        "block_size (trained)": config["block_size"],
        "markov_rank": config["markov_rank"],
        "confidence head": config["enable_confidence_head"],
        "dtype": config["torch_dtype"],
    }
    spec = json.dumps({"method": "dspark", "model": str(out_dir), "num_speculative_tokens": k})
    parts = [
        f"# DSpark drafter for `{target}`",
        section(facts),
        "## Use it",
        f"vLLM drafts `num_speculative_tokens` slots per block (trained with block_size "
        f"{config['block_size']}); DSpark runs "
        "only in vLLM's V2 GPU model runner:",
        f"```bash\nvllm serve {target} --speculative-config '{spec}'\n```",
    ]
    if to == "speculators":
        parts += [
            "The config names the verifier and k, so the directory alone serves both:",
            f"```bash\nvllm serve {out_dir}\n```",
        ]
    return card_text(parts, target, spec, card)


def read_dspark(head_dir: str | Path) -> DSparkDrafter:
    """The drafter of a DSpark directory in either layout (``draftsmith convert``): the
    speculators one (``speculators.read_speculators``), or vLLM's as ``export_dspark`` writes
    it; refuses, in one line, a variant this drafter does not build."""
    config, tensors = read_head_files(head_dir)
    if "speculators_config" in config:
        return read_speculators(head_dir)[0]
    where = f"head: {head_dir}"
    if (config.get("architectures") or ["?"])[0] != ARCHITECTURE:
        raise HeadError(f"{where} is not a {ARCHITECTURE} directory; give one export wrote")
    fixed = {"markov_head_type": "vanilla", "sample_from_anchor": True,
             "confidence_head_with_markov": True}  # fmt: skip
    for name, ours in fixed.items():
        if config.get(name, ours) != ours:
            raise HeadError(f"{where} has {name} {config[name]!r}; draftsmith's DSpark drafter "
                            f"builds {name} {ours!r} only")  # fmt: skip
    head = DSparkDrafter(
        **block_layer_kwargs(config), target_layer_ids=config["target_layer_ids"],
        mask_token_id=config["mask_token_id"], block_size=config["block_size"],
        markov_rank=config["markov_rank"],
        confidence_head=bool(config.get("enable_confidence_head", True)),
    )  # fmt: skip
    check_tensors("vLLM DSpark", head.state_dict(), tensors)
    head.load_state_dict(tensors)  # copied into the drafter's float32
    return head
