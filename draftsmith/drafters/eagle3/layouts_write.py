"""Write an EAGLE-3 head for a named consumer, in the names and config keys its loader reads.

Each writer follows the consumer's own loader (cited per writer) and writes every tensor it
loads and nothing it would skip; ``limits`` refuses a head the consumer would build
differently from ours (a flag it lacks is silently a different model, never an error there).

- ``vllm``: our export (``export.py``), vLLM's ``model_executor/models/llama_eagle3.py``.
  ``vllm-ascend`` writes the same and checks vLLM Ascend's limits as the issue states them
  (num_speculative_tokens + 1 <= 16; draft TP 1 or the target's): not verified against
  vllm-ascend's source.
- ``sglang``: ``python/sglang/srt/models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``):
  params ``midlayer.*``, ``fc``, ``norm``, ``lm_head``; ``d2t`` becomes ``hot_token_id``,
  ``t2d`` is skipped; any other name is silently skipped, so ``layers.0.*`` is never written.
- ``trtllm``: ``tensorrt_llm/_torch/models/modeling_speculative.py`` (``Eagle3DraftModel``):
  ``midlayer.*``, ``fc``, ``norm``, ``lm_head`` (else the target's), ``d2t`` when reduced,
  ``input_norm`` / ``fc_norm.{i}``; ``eagle_config.norm_before_fc``, top-level ``fc_norm``
  and ``norm_output``, ``draft_vocab_size``, ``target_hidden_size``.
- ``eagle``: SafeAILab EAGLE-3, ``eagle/model/ea_model.py`` (``pytorch_model.bin``, else
  ``model.safetensors``, loaded ``strict=False``; ``d2t`` / ``t2d`` deleted for a full
  vocabulary) and ``eagle/model/cnets.py`` (``fc`` reads ``target_hidden_size * 3``, one
  ``midlayer``, embeddings from the target): ``LlamaForCausalLM``, ``midlayer.*``, ``d2t``
  and ``t2d`` when the draft vocabulary is reduced.
- ``speculators``: ``src/speculators/models/eagle3/config.py`` (``Eagle3SpeculatorConfig``:
  ``Eagle3Speculator``, ``transformer_layer_config``, ``draft_vocab_size``,
  ``norm_before_residual``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``)
  and its converter's ``midlayer.`` -> ``layers.0.``; ``speculators_config`` as our export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.targets import text_config
from draftsmith.drafters.eagle3.export import eagle3_config, eagle3_tensors
from draftsmith.drafters.eagle3.head import Eagle3Head
from draftsmith.drafters.headfiles.directory import (
    CARD_MARK,
    HeadError,
    llama_head_fields,
    sglang_serve_command,
    speculators_fields,
    vllm_serve_command,
    write_converted,
)
from draftsmith.drafters.headfiles.read import HeadFacts

CONSUMERS = ("vllm", "vllm-ascend", "sglang", "trtllm", "eagle", "speculators")
ASCEND_MAX_TOKENS = 16  # num_speculative_tokens + 1 (the limit; not verified here)


def limits(
    head: Eagle3Head, facts: HeadFacts, consumer: str, k: int, target_layers: int | None
) -> None:
    """Refuse, in one line, a head ``consumer`` would not serve as it was trained
    (``target_layers``: the target's depth, None when no target was given)."""
    kw = head.init_kwargs
    if consumer not in CONSUMERS:
        raise HeadError(f"to: {consumer!r} is not a consumer; use one of {list(CONSUMERS)}")
    if k < 1:
        raise HeadError(f"num_speculative_tokens: {k}; give at least 1")
    if consumer == "vllm-ascend" and k + 1 > ASCEND_MAX_TOKENS:
        raise HeadError(
            f"to vllm-ascend: num_speculative_tokens {k} + 1 > {ASCEND_MAX_TOKENS}, the most "
            f"vLLM Ascend verifies per step; give at most {ASCEND_MAX_TOKENS - 1}"
        )
    if consumer in ("vllm", "vllm-ascend"):
        return
    flags = {
        "parallel_drafting (P-EAGLE)": kw["parallel_drafting"],
        "num_hidden_layers > 1 (its later layers are another block)": kw["num_layers"] > 1,
        "norm_before_residual": kw["norm_before_residual"],
    }
    if consumer in ("sglang", "eagle"):
        flags |= {
            "norm_output": kw["norm_output"],
            "norm_before_fc": kw["norm_before_fc"],
            "fc_norm": kw["fc_norm"],
            f"{kw['num_aux_states']} tapped layers (it reads exactly 3)": kw["num_aux_states"] != 3,
        }
    if consumer == "trtllm":
        flags["norm_before_fc together with fc_norm"] = kw["norm_before_fc"] and kw["fc_norm"]
    if consumer == "speculators":
        flags.pop("norm_before_residual")
    found = [name for name, on in flags.items() if on]
    if found:
        raise HeadError(
            f"to {consumer}: the head uses {', '.join(found)}, which {consumer}'s loader "
            "does not build; it would serve another model. Serve it with --to vllm."
        )
    if consumer == "eagle" and facts.layer_ids and not facts.layer_ids_defaulted:
        n = target_layers
        if n is None:
            raise HeadError(
                f"to eagle: the head taps {facts.layer_ids} and SafeAILab EAGLE always taps "
                "[2, N // 2, N - 3]; give --model TARGET so they can be checked"
            )
        if facts.layer_ids != [2, n // 2, n - 3]:
            raise HeadError(
                f"to eagle: the head taps {facts.layer_ids}; SafeAILab EAGLE always taps "
                f"[2, N // 2, N - 3] = {[2, n // 2, n - 3]}. Serve it with --to vllm."
            )


def _rename(tensors: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in tensors.items()}


def _with_t2d(head: Eagle3Head, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``d2t`` (int64) and ``t2d`` (bool [vocab]: which target ids the draft has)."""
    draft = torch.arange(head.draft_vocab_size)
    d2t = head.draft_to_target(draft) - draft
    t2d = torch.zeros(head.vocab_size, dtype=torch.bool)
    t2d[head.draft_to_target(draft)] = True
    return {**tensors, "d2t": d2t.cpu(), "t2d": t2d}


def consumer_files(
    head: Eagle3Head,
    facts: HeadFacts,
    consumer: str,
    target_config: dict[str, Any],
    verifier: str,
    k: int,
    dtype: torch.dtype,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of ``head`` for ``consumer``."""
    ids = facts.layer_ids
    reduced = head.draft_vocab_size != head.vocab_size
    tensors = eagle3_tensors(head, dtype)  # ours: vLLM's names, d2t only when reduced
    if consumer in ("vllm", "vllm-ascend"):
        return eagle3_config(head, target_config, ids, k, verifier, dtype), tensors
    kw = head.init_kwargs
    config, layer = llama_head_fields(head, "LlamaForCausalLM", target_config, dtype)
    if consumer == "sglang":
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        if ids:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
        return config, _with_t2d(head, tensors) if reduced else tensors
    if consumer == "trtllm":
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        config["eagle_config"] = {
            "norm_before_fc": bool(kw["norm_before_fc"]),
            "return_hidden_post_norm": bool(kw["norm_output"]),
            **({"eagle_aux_hidden_state_layer_ids": ids} if ids else {}),
        }
        config["fc_norm"], config["norm_output"] = bool(kw["fc_norm"]), bool(kw["norm_output"])
        return config, tensors
    if consumer == "eagle":
        return config, _with_t2d(head, tensors) if reduced else tensors
    # speculators: the decoder layer's fields live in transformer_layer_config only; vLLM
    # tells this format by a top level without model_type (transformers_utils/config.py).
    config = {k: v for k, v in config.items() if k not in layer or k == "vocab_size"}
    config["architectures"] = ["Eagle3Speculator"]
    for key in ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm"):
        config[key] = bool(kw[key])
    if ids:
        config["eagle_aux_hidden_state_layer_ids"] = ids
    config |= speculators_fields("eagle3", layer, k, verifier, target_config)
    tensors = _rename(tensors, "midlayer.", "layers.0.")
    return config, _with_t2d(head, tensors) if reduced else tensors


def serve_command(
    consumer: str,
    out_dir: Path,
    target: str,
    facts: HeadFacts,
    k: int,
    tp: tuple[int, int | None] = (1, None),
) -> str:
    """The command that serves the written head with ``target`` (``tp``: the target's and
    the draft's tensor parallelism, for vLLM)."""
    if consumer in ("vllm", "vllm-ascend"):
        return vllm_serve_command("eagle3", out_dir, target, k, tp)
    if consumer == "speculators":
        return f"vllm serve {out_dir}"
    if consumer == "sglang":
        return sglang_serve_command("EAGLE3", out_dir, target, k)
    if consumer == "trtllm":
        spec: dict[str, Any] = {
            "decoding_type": "Eagle",
            "max_draft_len": k,
            "speculative_model_dir": str(out_dir),
            "eagle3_one_model": True,
        }
        if facts.layer_ids and not facts.layer_ids_defaulted:
            spec["eagle3_layers_to_capture"] = facts.layer_ids
        yaml = json.dumps({"speculative_config": spec})
        return (
            f"echo '{yaml}' > spec.yaml && trtllm-serve {target} "
            "--extra_llm_api_options spec.yaml  # Dynamo takes the same speculative_config"
        )
    # SafeAILab's eagle/application/webui.py (--model-type defaults to llama-3-instruct;
    # its drafts form a tree sized by --total-token, not a chain of k)
    return f"python -m eagle.application.webui --ea-model-path {out_dir} --base-model-path {target}"


def write_head(
    head: Eagle3Head,
    facts: HeadFacts,
    consumer: str,
    out_dir: Path,
    target_config: dict[str, Any],
    *,
    verifier: str,
    num_speculative_tokens: int = 3,
    dtype: torch.dtype = torch.bfloat16,
    target_layers: bool = True,
) -> Path:
    """Write ``head`` for ``consumer`` to ``out_dir`` (atomically); returns the directory.
    ``target_config`` is the target's (or a stand-in built from the head when no target
    was given: then ``target_layers`` is False, the target's depth unknown)."""
    k = num_speculative_tokens
    n = text_config(target_config)["num_hidden_layers"] if target_layers else None
    limits(head, facts, consumer, k, n)
    config, tensors = consumer_files(head, facts, consumer, target_config, verifier, k, dtype)
    final = Path(out_dir).absolute()
    command = serve_command(consumer, final, verifier, facts, k)
    taps = facts.layer_ids or "the consumer's default"
    card = "\n\n".join(
        [
            f"# EAGLE-3 draft head for `{verifier}`, written for {consumer}",
            f"{CARD_MARK} from `{facts.source}` ({facts.layout} layout).",
            f"Tapped target layers: {taps}"
            + (" (defaulted: the source names none)" if facts.layer_ids_defaulted else ""),
            *facts.notes,
            f"Serve it:\n\n```bash\n{command}\n```",
        ]
    )
    return write_converted(out_dir, tensors, config, card)
