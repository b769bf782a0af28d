"""Write an EAGLE-1 head as a directory vLLM serves as it is (``EagleLlamaForCausalLM``).

``config.json`` is the Llama config of the draft plus the speculators block
(``headfiles``); it taps no layers: EAGLE-1 reads the target's final, post-norm state.
``model.safetensors`` holds ``fc`` and the decoder layers in vLLM's keys; the embeddings and
the lm_head are the target's, shared by vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.core.errors import ConfigError
from draftsmith.core.files import write_json_atomic
from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.eagle1.head import Eagle1Head
from draftsmith.drafters.headfiles.directory import (
    HeadError,
    llama_head_fields,
    speculators_card,
    speculators_fields,
    state_tensors,
    write_head_dir,
)

ARCHITECTURE = "EagleLlamaForCausalLM"


def eagle1_config(
    head: Eagle1Head,
    target_config: dict[str, Any],
    layer_ids: list[int] | None,
    num_speculative_tokens: int,
    verifier: str,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The head's ``config.json`` (module docstring)."""
    if layer_ids:
        raise ConfigError("layer_ids: EAGLE-1 heads read the target's final state, tap none.")
    config, layer = llama_head_fields(head, ARCHITECTURE, target_config, dtype)
    return config | speculators_fields(
        "eagle", layer, num_speculative_tokens, verifier, target_config
    )


def eagle1_tensors(head: Eagle1Head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's state dict in vLLM's keys, floats cast to ``dtype`` (no lm_head: the
    target's is used)."""
    return state_tensors(head, dtype, skip=("lm_head",))


def export_eagle1(
    head: Eagle1Head,
    target: TargetInfo,
    out_dir: Path,
    *,
    layer_ids: list[int] | None = None,
    num_speculative_tokens: int | None = None,
    card: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``head`` for ``target`` to ``out_dir`` (atomically); k defaults to 3."""
    k = num_speculative_tokens or 3
    config = eagle1_config(head, target.config, layer_ids, k, target.path, dtype)

    def write(tmp: Path) -> None:
        save_file(eagle1_tensors(head, dtype), tmp / "model.safetensors", {"format": "pt"})
        write_json_atomic(tmp / "config.json", config)
        final = Path(out_dir).absolute()
        card_md = speculators_card(config, "EAGLE-1", {"method": "eagle"}, final, card or {})
        (tmp / "README.md").write_text(card_md)

    return write_head_dir(out_dir, write)


def check_eagle1_head(head: str, config: dict[str, Any], shapes: dict[str, list[int]]) -> None:
    """Refuse a directory that is no EAGLE-1 head (``fc`` over [embedding, target state]):
    a whole model passed as the head, or an EAGLE-3 one, would fail deep inside vLLM."""
    hidden = config.get("hidden_size")
    fc = shapes.get("fc.weight")
    if hidden is None or fc != [hidden, 2 * hidden]:
        raise HeadError(
            f"head: {head} fc.weight is {fc}, expected [{hidden}, 2 x {hidden}]: an EAGLE-1 "
            "head fuses the token embedding with the target's final state"
        )
