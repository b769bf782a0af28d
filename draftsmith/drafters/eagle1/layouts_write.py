"""Write an EAGLE-1 head for a named consumer, in the names and config keys its loader reads.

- ``vllm``: our export (``export.py``), vLLM's ``model_executor/models/llama_eagle.py``
  (``EagleLlamaForCausalLM``): ``fc`` has no bias there and its loader skips a ``*.bias`` it
  has no parameter for, silently; so an ``fc`` bias is folded into the first layer's
  attention biases (``fold_fc_bias``, exact), or dropped when it is all zeros.
- ``sglang``: ``python/sglang/srt/models/llama_eagle.py`` (``LlamaForCausalLMEagle``, the
  architecture the config must name): ``fc`` always has a bias there, so it is written (zeros
  for a head without one: an unloaded parameter keeps its random init); layer 0 has no input
  norm; embeddings and ``lm_head`` are the target's. ``models/llama.py`` reads
  ``attention_bias`` or ``bias`` as q/k/v/o biases, so ``bias`` is never written.
- ``eagle``: SafeAILab EAGLE-1: ``eagle/model/ea_model.py`` with ``use_eagle3=False``
  (config ``bias`` gives ``fc`` its bias, true when absent; ``pytorch_model.bin``, else
  ``model.safetensors``, loaded ``strict=False``; embeddings read from the target) and
  ``eagle/model/cnets1.py`` (``head_dim = hidden_size // num_attention_heads``; rope from
  ``rope_scaling["type"]``, default, linear or dynamic; ``qkv_bias`` gives q/k/v biases, o_proj
  never has one): ``LlamaForCausalLM``, no ``draft_vocab_size``. vLLM serves this directory
  as it is with ``method: eagle`` (``transformers_utils/configs/eagle.py`` renames the
  architecture to ``EagleLlamaForCausalLM``).

Every other consumer is refused in one line naming the one to use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.drafters.attention.layers import rope_kind
from draftsmith.drafters.eagle1.export import eagle1_config, eagle1_tensors
from draftsmith.drafters.eagle1.head import Eagle1Head
from draftsmith.drafters.headfiles.directory import (
    CARD_MARK,
    HeadError,
    llama_head_fields,
    sglang_serve_command,
    state_tensors,
    vllm_serve_command,
    write_converted,
)
from draftsmith.drafters.headfiles.read import HeadFacts

CONSUMERS = ("vllm", "sglang", "eagle")
NOT_WRITTEN = {  # consumer -> why convert writes no EAGLE-1 head for it
    "vllm-ascend": "vLLM Ascend's EAGLE-1 support is not checked here",
    "trtllm": "its TensorRT-LLM writer follows Eagle3DraftModel, an EAGLE-3 loader",
    "speculators": "vLLM 0.32 reads that format for eagle3, peagle and dflash; the --to vllm "
    "directory already carries the speculators block naming the verifier",
}
ARCHITECTURES = {"sglang": "LlamaForCausalLMEagle", "eagle": "LlamaForCausalLM"}


def limits(head: Eagle1Head, consumer: str, k: int) -> None:
    """Refuse, in one line, a consumer convert does not write EAGLE-1 heads for, or a head
    it would not serve as trained."""
    if consumer in NOT_WRITTEN:
        raise HeadError(
            f"to {consumer}: convert writes EAGLE-1 heads for {', '.join(CONSUMERS)} "
            f"({NOT_WRITTEN[consumer]}); use --to vllm"
        )
    if consumer not in CONSUMERS:
        raise HeadError(f"to: {consumer!r} is not an EAGLE-1 consumer; use one of {CONSUMERS}")
    if k < 1:
        raise HeadError(f"num_speculative_tokens: {k}; give at least 1")
    if consumer != "eagle":
        return
    kw = head.init_kwargs
    found = []
    if head.head_dim != kw["hidden_size"] // kw["num_heads"]:
        found.append(f"head_dim {head.head_dim} (cnets1.py: hidden_size // num_attention_heads)")
    scaling = {n: v for n, v in (kw["rope_scaling"] or {}).items() if n != "rope_type"}
    kind = rope_kind(kw["rope_scaling"])
    if kind not in ("default", "linear") or set(scaling) - {"factor"}:
        found.append(f"{kind} rope {scaling} (convert writes default and linear rope for it)")
    o_biases = [layer.self_attn.o_proj.bias for layer in head.layers]
    if kw["attention_bias"] and any(bool(b.any()) for b in o_biases):
        found.append("o_proj biases (cnets1.py builds q/k/v biases only)")
    if found:
        raise HeadError(
            f"to eagle: the head has {'; '.join(found)}, which SafeAILab's EAGLE-1 does not "
            "build; it would serve another model. Serve it with --to vllm."
        )


def fold_fc_bias(head: Eagle1Head) -> Eagle1Head:
    """The same head without an ``fc`` bias b: ``fc(x) + b`` enters the first layer unnormed
    (it has no input norm), as the attention input and as the residual, so q/k/v gain
    ``W_{q,k,v} b`` (added before rope in both) and o_proj gains b; the value rows' bias
    passes through attention unchanged (its weights sum to 1). Exact up to rounding."""
    out = Eagle1Head(**{**head.init_kwargs, "fc_bias": False, "attention_bias": True})
    state = {name: value.double() for name, value in head.state_dict().items()}
    b = state.pop("fc.bias")  # [H]
    new = {name: torch.zeros_like(v, dtype=torch.float64) for name, v in out.state_dict().items()}
    new.update(state)  # biases the head lacks stay zero
    attn = "layers.0.self_attn."
    for proj in ("q_proj", "k_proj", "v_proj"):
        new[f"{attn}{proj}.bias"] += state[f"{attn}{proj}.weight"] @ b  # [out, H] @ [H]
    new[f"{attn}o_proj.bias"] += b
    out.load_state_dict({name: value.float() for name, value in new.items()})
    out.embed_tokens.copy_(head.embed_tokens)
    out.lm_head.copy_(head.lm_head)
    return out


def vllm_head(head: Eagle1Head) -> tuple[Eagle1Head, list[str]]:
    """``head`` as vLLM's ``EagleLlamaForCausalLM`` builds it (no ``fc`` bias), and a note."""
    if head.fc.bias is None:
        return head, []
    if not bool(head.fc.bias.any()):
        plain = Eagle1Head(**{**head.init_kwargs, "fc_bias": False})
        plain.load_state_dict(
            {n: v for n, v in head.state_dict().items() if n != "fc.bias"}, strict=True
        )
        return plain, ["fc.bias dropped: all zeros (vLLM's fc has no bias)"]
    note = "fc.bias folded into the first layer's attention biases (vLLM's fc has none)"
    return fold_fc_bias(head), [note]


def consumer_files(
    head: Eagle1Head,
    consumer: str,
    target_config: dict[str, Any],
    verifier: str,
    k: int,
    dtype: torch.dtype,
) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[str]]:
    """(config.json, tensors, notes for the card) of ``head`` for ``consumer``."""
    if consumer == "vllm":
        head, notes = vllm_head(head)
        config = eagle1_config(head, target_config, None, k, verifier, dtype)
        return config, eagle1_tensors(head, dtype), notes
    kw = head.init_kwargs
    config, _ = llama_head_fields(head, ARCHITECTURES[consumer], target_config, dtype)
    for key in ("draft_vocab_size", "target_hidden_size"):  # EAGLE-3 keys
        config.pop(key)
    tensors = state_tensors(head, dtype)
    if consumer == "sglang":
        tensors.setdefault("fc.bias", torch.zeros(kw["hidden_size"], dtype=dtype))
        return config, tensors, []
    if not kw["fc_bias"]:
        config["bias"] = False  # absent would mean true (ea_model.py)
    if kw["attention_bias"]:  # q/k/v only (limits checked o_proj's are zero)
        config["attention_bias"], config["qkv_bias"] = False, True
        tensors = {n: v for n, v in tensors.items() if not n.endswith("o_proj.bias")}
    if config.get("rope_scaling"):
        config["rope_scaling"]["type"] = config["rope_scaling"]["rope_type"]  # cnets1's key
    return config, tensors, []


def serve_command(
    consumer: str, out_dir: Path, target: str, k: int, tp: tuple[int, int | None] = (1, None)
) -> str:
    """The command that serves the written head with ``target`` (``tp``: the target's and
    the draft's tensor parallelism, for vLLM)."""
    if consumer == "vllm":
        return vllm_serve_command("eagle", out_dir, target, k, tp)
    if consumer == "sglang":
        return sglang_serve_command("EAGLE", out_dir, target, k)
    # eagle/application/webui.py (commit 1fd3021) builds EaModel with
    # use_eagle3=(not args.no_eagle3): EAGLE-1 needs --no-eagle3
    return (
        f"python -m eagle.application.webui --ea-model-path {out_dir} "
        f"--base-model-path {target} --no-eagle3"
    )


def write_eagle1(
    head: Eagle1Head,
    facts: HeadFacts,
    consumer: str,
    out_dir: Path,
    target_config: dict[str, Any],
    *,
    verifier: str,
    num_speculative_tokens: int = 3,
    dtype: torch.dtype = torch.bfloat16,
    tp: tuple[int, int | None] = (1, None),
) -> Path:
    """Write ``head`` for ``consumer`` to ``out_dir`` (atomically); returns the directory.
    ``target_config`` is the target's, or a stand-in built from the head."""
    k = num_speculative_tokens
    limits(head, consumer, k)
    config, tensors, notes = consumer_files(head, consumer, target_config, verifier, k, dtype)
    command = serve_command(consumer, Path(out_dir).absolute(), verifier, k, tp)
    card = "\n\n".join(
        [
            f"# EAGLE-1 draft head for `{verifier}`, written for {consumer}",
            f"{CARD_MARK} from `{facts.source}` ({facts.layout} layout).",
            "It reads the target's final (post-norm) hidden state: it taps no layers.",
            *facts.notes,
            *notes,
            f"Serve it:\n\n```bash\n{command}\n```",
        ]
    )
    return write_converted(out_dir, tensors, config, card)
