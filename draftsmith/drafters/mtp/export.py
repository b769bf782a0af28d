"""Read the target's MTP tensors, and write a fine-tuned layer where vLLM's ``method: mtp``
loads it.

What is written: a draft directory, not a stitched copy of the target. vLLM's
``speculative_config.model`` may name any directory for ``method: mtp`` (it defaults to the
target's, ``config/speculative.py:1148-1158``); the draft's config goes through the same
``hf_config_override`` as the target's (its ``architectures`` pick the MTP class), and its
tokenizer is the target's. So the directory holds:

- ``config.json``: the target's, plus ``draftsmith_mtp`` (the family, the steps trained;
  ``method_of`` recognises the directory by it).
- ``model.safetensors``: the MTP tensors in the target's own names (``families.py``), the
  shared MTP-namespace tensors the target ships (GLM's ``shared_head.head``), and copies of
  the target's ``model.embed_tokens.weight`` / ``lm_head.weight``: the MTP classes own those
  parameters and vLLM's loader refuses a checkpoint that leaves any unloaded
  (``model_loader/default_loader.py:561-566``), although the proposer then swaps in the
  target's (``spec_decode/llm_base_proposer.py:1467-1500, 1546-1575``).
- ``README.md``: how to serve it.

A stitched copy (the target directory with its MTP tensors replaced) would serve too, as
``vllm serve COPY --speculative-config '{"method": "mtp"}'``, at the cost of a second copy
of the whole target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from draftsmith.core.errors import ConfigError
from draftsmith.core.files import write_json_atomic
from draftsmith.core.targets import TargetInfo, text_config
from draftsmith.drafters.headfiles.directory import card_text, section, write_head_dir
from draftsmith.drafters.mtp.families import Family, family_of
from draftsmith.drafters.mtp.model import MTPLayer
from draftsmith.drafters.target.weights import read_tensor, target_dir, tensor_files

MARKER = "draftsmith_mtp"


def read_mtp_tensors(target: TargetInfo, family: Family) -> dict[str, Tensor]:
    """Every MTP-namespace tensor of the target's checkpoint, in its own names (float32)."""
    files = tensor_files(target_dir(target.path))
    n = text_config(target.config)["num_hidden_layers"]
    return {
        name: read_tensor(files, name, torch.float32) for name in files if family.is_mtp(name, n)
    }


def load_target_mtp(head: MTPLayer, target: TargetInfo, family: Family) -> None:
    """Load the target's own MTP layer into ``head``; refuse a checkpoint missing any of it."""
    n = head.num_hidden_layers
    tensors = read_mtp_tensors(target, family)
    state = {family.to_head(k, n): v for k, v in tensors.items() if family.to_head(k, n)}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        missing = [family.to_checkpoint(m, n) for m in missing]
        raise ConfigError(
            f"model: {target.path} lacks MTP tensors {missing[:4]} (has unexpected "
            f"{sorted(unexpected)[:4]}); model.kind mtp fine-tunes the MTP layer the target "
            "ships: use the original checkpoint"
        )


def mtp_tensors(head: MTPLayer, family: Family, dtype: torch.dtype) -> dict[str, Tensor]:
    """The head's weights in the target's names, cast to ``dtype``."""
    n = head.num_hidden_layers
    return {family.to_checkpoint(k, n): v.detach().to(dtype).contiguous().clone()
            for k, v in head.state_dict().items()}  # fmt: skip


def export_mtp(
    head: MTPLayer,
    target: TargetInfo,
    out_dir: Path,
    *,
    layer_ids: list[int] | None = None,
    num_speculative_tokens: int | None = None,
    card: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``head`` as a draft directory for ``target`` (module docstring)."""
    family = family_of(target.architecture, target.config)
    if family.name != head.family:
        raise ConfigError(f"the layer is a {head.family} MTP layer, {target.path} a {family.name}")
    files = tensor_files(target_dir(target.path))
    n = head.num_hidden_layers
    tensors = mtp_tensors(head, family, dtype)
    shared = [k for k in files if family.is_mtp(k, n) and family.to_head(k, n) is None]
    names = [k for k in ("model.embed_tokens.weight", "lm_head.weight") if k in files]
    if not names:
        raise ConfigError(f"model: {target.path} has no model.embed_tokens.weight to share")
    for name in shared + names:
        tensors[name] = read_tensor(files, name, dtype).contiguous()
    k = num_speculative_tokens or 1
    config = {**target.config, MARKER: {"family": family.name, "num_speculative_tokens": k}}

    def write(tmp: Path) -> None:
        save_file(tensors, tmp / "model.safetensors", {"format": "pt"})
        write_json_atomic(tmp / "config.json", config)
        (tmp / "README.md").write_text(model_card(family, target.path, Path(out_dir), k, card))

    return write_head_dir(out_dir, write)


def model_card(family: Family, target: str, out_dir: Path, k: int, card: dict | None) -> str:
    """README.md: what the directory is and how vLLM serves it."""
    spec = json.dumps({"method": "mtp", "model": str(Path(out_dir).absolute()),
                       "num_speculative_tokens": k})  # fmt: skip
    facts = {
        "target (verifier)": target,
        "method": "vLLM `method: mtp` (the target's own MTP layer, fine-tuned)",
        "family": family.name,
        "state fed at step 0": f"{family.fed.replace('_', '-')} ({family.fed_source})",
    }
    parts = [
        f"# Fine-tuned MTP layer for `{target}`",
        section(facts),
        "## Use it",
        f"```bash\nvllm serve {target} --speculative-config '{spec}'\n```",
    ]
    return card_text(parts, target, spec, card or {})
