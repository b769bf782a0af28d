"""Write an EAGLE-3 (or P-EAGLE) head as a directory vLLM serves as it is, and check one.

- ``config.json`` is a Llama config for vLLM's ``Eagle3LlamaForCausalLM`` (the draft's own
  sizes, rope and norms; the target's vocabulary and ``max_position_embeddings``), plus the
  speculators block (``headfiles.speculators_fields``), so ``vllm serve DIR`` works. Because
  the top-level ``model_type`` is ``llama``, vLLM builds the draft from the top-level fields;
  ``transformer_layer_config`` repeats them for readers of the speculators format.
- A head trained with ``sliding_window`` has Qwen3's q/k norms and is vLLM's
  ``Eagle3Qwen3ForCausalLM`` (``model_type: qwen3``, ``layer_types`` all
  ``sliding_attention``, ``sliding_window``, ``use_sliding_window``): the EAGLE-3 draft whose
  window vLLM 0.32 applies (``headfiles/windows.py``).
- A P-EAGLE head (trained with ``parallel_drafting``) is the same ``Eagle3LlamaForCausalLM``
  (vLLM prefixes any other name with ``Eagle3`` for method eagle3) plus ``mask_token_id`` and
  ``mask_hidden`` [1, n_aux * H_target]; its ``speculators_model_type: peagle`` makes
  ``vllm serve DIR`` draft with ``method: eagle3, parallel_drafting: true``.
- ``model.safetensors`` holds vLLM's checkpoint keys (no ``model.`` prefix), no
  ``embed_tokens`` (vLLM shares the target's), and ``d2t`` only when the draft vocabulary is
  reduced (vLLM refuses a ``d2t`` for a full-vocabulary head).

Layer ids: id ``k`` is the target's residual stream entering decoder layer ``k``, i.e. after
``k`` layers and before any norm (vLLM's ``_maybe_add_hidden_state`` is called with
``start_layer`` before the loop and ``idx + 1`` after layer ``idx``). Id 0 is the embedding
output, id ``N`` the last layer's output before the final norm. ``fc`` reads the tapped states
concatenated in ascending id order. vLLM sizes ``fc`` from ``eagle_config``'s ids and the
model runner taps the top-level ``eagle_aux_hidden_state_layer_ids``, so both are written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.core.errors import ConfigError
from draftsmith.core.files import write_json_atomic
from draftsmith.core.targets import TargetInfo, text_config, validate_layer_ids
from draftsmith.drafters.eagle3.head import Eagle3Head
from draftsmith.drafters.headfiles.directory import (
    HeadError,
    llama_head_fields,
    speculators_card,
    speculators_fields,
    state_tensors,
    write_head_dir,
)
from draftsmith.drafters.headfiles.windows import window_fields

ARCHITECTURE = "Eagle3LlamaForCausalLM"
QWEN3_ARCHITECTURE = "Eagle3Qwen3ForCausalLM"  # the head with q/k norms: vLLM windows it


def layer_ids_for(
    head: Eagle3Head, target_config: dict[str, Any], layer_ids: list[int] | None
) -> list[int]:
    """Check the tapped layer ids against the head and target; None: vLLM's default taps
    ``[2, N // 2, N - 3]``, written out."""
    n = text_config(target_config)["num_hidden_layers"]
    ids = validate_layer_ids(layer_ids if layer_ids is not None else [2, n // 2, n - 3], n)
    if len(ids) != head.init_kwargs["num_aux_states"]:
        raise ConfigError(
            f"layer_ids: {ids} has {len(ids)} ids but the head's fc reads "
            f"{head.init_kwargs['num_aux_states']} target states; give the ids it was trained on."
        )
    return ids


def eagle3_config(
    head: Eagle3Head,
    target_config: dict[str, Any],
    layer_ids: list[int] | None,
    num_speculative_tokens: int,
    verifier: str,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The head's ``config.json`` (module docstring)."""
    k = head.init_kwargs
    ids = layer_ids_for(head, target_config, layer_ids)
    qwen3 = bool(k.get("qk_norm"))
    arch = QWEN3_ARCHITECTURE if qwen3 else ARCHITECTURE
    config, layer = llama_head_fields(head, arch, target_config, dtype)
    if qwen3:
        config["model_type"] = layer["model_type"] = "qwen3"
    if k.get("sliding_window") is not None:  # the Llama draft ignores it: export says so
        window = window_fields(k["num_layers"], k["sliding_window"])
        config |= window
        layer |= window
    config["norm_before_residual"] = bool(k["norm_before_residual"])
    config["norm_output"] = bool(k["norm_output"])
    # Top level: vLLM's speculators conversion (algos.update_eagle3) and its Llama Eagle-3
    # model (eagle_config first, then these) both read them there.
    config["norm_before_fc"] = bool(k["norm_before_fc"])
    config["fc_norm"] = bool(k["fc_norm"])
    config["eagle_aux_hidden_state_layer_ids"] = ids
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    parallel = bool(k.get("parallel_drafting"))
    if parallel:
        config["mask_token_id"] = k["mask_token_id"]
    algorithm = "peagle" if parallel else "eagle3"
    return config | speculators_fields(
        algorithm, layer, num_speculative_tokens, verifier, target_config
    )


def eagle3_tensors(head: Eagle3Head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's state dict in vLLM's keys: floats cast to ``dtype``, ``d2t`` int64."""
    tensors = state_tensors(head, dtype)
    if "mask_hidden" in tensors:
        tensors["mask_hidden"] = tensors["mask_hidden"][None]  # [1, n_aux * H_target]
    full_vocab = head.draft_vocab_size == head.vocab_size
    if full_vocab != ("d2t" not in tensors):
        raise ValueError("d2t must be exported exactly when the draft vocabulary is reduced")
    return tensors


def export_eagle3(
    head: Eagle3Head,
    target: TargetInfo,
    out_dir: Path,
    *,
    layer_ids: list[int] | None = None,
    num_speculative_tokens: int | None = None,
    card: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``head`` for ``target`` to ``out_dir`` (atomically).

    Args:
        layer_ids: the tapped layers in vLLM's meaning (module docstring), ascending; None
            means vLLM's default ``[2, N // 2, N - 3]``.
        num_speculative_tokens: k, the default draft length for ``vllm serve <out_dir>``
            (default 3).
        card: extra model-card sections (data summary, config, metrics), rendered as tables.
    """
    k = num_speculative_tokens or 3
    config = eagle3_config(head, target.config, layer_ids, k, target.path, dtype)
    spec: dict[str, Any] = {"method": "eagle3"}
    title = "EAGLE-3"
    if config["speculators_model_type"] == "peagle":
        spec["parallel_drafting"], title = True, "P-EAGLE (parallel-drafting EAGLE-3)"

    def write(tmp: Path) -> None:
        save_file(eagle3_tensors(head, dtype), tmp / "model.safetensors", {"format": "pt"})
        write_json_atomic(tmp / "config.json", config)
        final = Path(out_dir).absolute()
        (tmp / "README.md").write_text(speculators_card(config, title, spec, final, card or {}))

    return write_head_dir(out_dir, write)


def check_eagle3_head(
    head: str, method: str, config: dict, shapes: dict[str, list[int]], target: TargetInfo
) -> None:
    """Refuse an EAGLE-3 / P-EAGLE head directory that cannot serve ``target``."""
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    n = target.num_hidden_layers
    if ids is not None:
        bad = [i for i in ids if not 0 <= i <= n]  # id n: last layer's output, before the norm
        if bad:
            raise HeadError(
                f"head: {head} taps layers {bad}, outside the target's 0..{n}; "
                "it was trained for a deeper target."
            )
    fc = shapes.get("fc.weight")
    taps = len(ids) if ids is not None else 3
    if fc is not None and fc[1] != taps * target.hidden_size:
        raise HeadError(
            f"head: {head} fc.weight is {fc}, expected [*, {taps} x {target.hidden_size}] for "
            f"{taps} tapped layers of this target."
        )
    draft_vocab = config.get("draft_vocab_size", target.vocab_size)
    lm_head = shapes.get("lm_head.weight")
    if lm_head is not None and lm_head[0] != draft_vocab:
        raise HeadError(
            f"head: {head} lm_head.weight has {lm_head[0]} rows but draft_vocab_size is "
            f"{draft_vocab}; re-export the head."
        )
    if draft_vocab < target.vocab_size and "d2t" not in shapes:
        raise HeadError(
            f"head: {head} has a reduced draft vocabulary ({draft_vocab}) but no d2t mapping."
        )
    if draft_vocab == target.vocab_size and "d2t" in shapes:
        raise HeadError(
            f"head: {head} ships d2t with a full vocabulary; vLLM refuses it. Drop d2t."
        )
    if method == "peagle" and ("mask_hidden" not in shapes or config.get("mask_token_id") is None):
        raise HeadError(
            f"head: {head} drafts in parallel only with a mask_token_id in config.json and a "
            "mask_hidden tensor; export a head trained with model.parallel_drafting true."
        )
