"""What the Llama-style draft heads (EAGLE-3, EAGLE-1) share: the base module holding the
target's frozen embeddings and the rotary embedding; and the sizes and rope any draft
(DFlash's too) takes from the target's ``config.json`` (``target_sizes``, ``target_rope``).

The layers themselves are in ``layers.py``; attention is pluggable there (``AttendFn``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.core.targets import text_config
from draftsmith.drafters.attention.layers import ROPE_KEYS, RotaryEmbedding, rope_kind


def init_linears(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class LlamaDraftHead(nn.Module):
    """What EAGLE-style heads share: frozen target embeddings, rotary embedding, per-layer
    settings, the attention's ``sliding_window`` (None: full). Subclasses add ``fc``, their
    layers and ``decoder_layers()``."""

    def __init__(self, init_kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.init_kwargs = init_kwargs  # flat constructor arguments, for exporters
        k = init_kwargs
        self.hidden_size, self.vocab_size = k["hidden_size"], k["vocab_size"]
        self.head_dim = k["head_dim"] or k["hidden_size"] // k["num_heads"]
        self.layer_kwargs = dict(
            hidden_size=k["hidden_size"],
            num_heads=k["num_heads"],
            num_kv_heads=k["num_kv_heads"] or k["num_heads"],
            head_dim=self.head_dim,
            intermediate_size=k["intermediate_size"],
            eps=k["rms_norm_eps"],
            attention_bias=k["attention_bias"],
        )
        if k.get("qk_norm"):  # Qwen3's attention (the kwarg only when on: old heads unchanged)
            self.layer_kwargs["qk_norm"] = True
        self.sliding_window: int | None = k.get("sliding_window")  # tokens; None: full
        self.rotary = RotaryEmbedding(
            self.head_dim, k["rope_theta"], k["rope_scaling"], k["max_position_embeddings"]
        )
        # Shared from the target, frozen, never exported: a non-persistent buffer.
        self.register_buffer(
            "embed_tokens", torch.zeros(k["vocab_size"], k["hidden_size"]), persistent=False
        )

    def set_embeddings(self, weight: Tensor) -> None:
        """Copy the target's input embedding matrix [vocab, hidden] into the head."""
        self.embed_tokens.copy_(weight.detach())

    def embed(self, input_ids: Tensor) -> Tensor:
        """[B, T] token ids -> [B, T, H]."""
        return F.embedding(input_ids, self.embed_tokens)


def target_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope parameters or None) of a target's transformers 4 or 5 ``config.json``.

    The parameters keep what vLLM's ``get_rope`` reads for the kind (``layers.ROPE_KEYS``) plus
    ``partial_rotary_factor`` (also under its older names ``rotary_pct``/``rotary_emb_fraction``),
    with ``original_max_position_embeddings`` resolved as transformers does (a top-level field
    wins, then the rope dict's, then ``max_position_embeddings``). Per-layer-type rope dicts
    give the full-attention one; M-RoPE sections are dropped (the draft's positions are 1-D).
    None means plain rope over the whole head.
    """
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    kind = rope_kind(params)
    scaling: dict[str, Any] = {"rope_type": kind}
    dropped = ("rope_theta", "type", "mrope_section", "mrope_interleaved")
    keys = ROPE_KEYS.get(kind, [k for k in params if k not in dropped])  # unknown: all, to refuse
    scaling |= {k: params[k] for k in keys if k in params}
    names = ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction")
    partial = next((src[n] for src in (params, config) for n in names if src.get(n)), 1.0)
    if float(partial) != 1.0:
        scaling["partial_rotary_factor"] = float(partial)
    if "original_max_position_embeddings" in ROPE_KEYS.get(kind, ()):
        orig = config.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings", config.get("max_position_embeddings")
        )
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
    return theta, None if scaling == {"rope_type": "default"} else scaling


def target_sizes(target_config: dict[str, Any]) -> dict[str, Any]:
    """The draft's attention, MLP, norm and rope sizes taken from the TARGET's config.json:
    the keyword arguments every Llama-style draft head starts from."""
    cfg = text_config(target_config)
    theta, scaling = target_rope(cfg)
    return dict(
        hidden_size=cfg["hidden_size"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings") or 2048,
    )
