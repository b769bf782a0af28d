"""Qwen3-Next's MTP decoder layer (also Qwen3.5's), op for op as vLLM 0.32 serves it.

vLLM builds the MTP layer as a full-attention ``Qwen3NextDecoderLayer``
(``models/qwen3_next_mtp.py``; Qwen3.5: ``Qwen3_5DecoderLayer``, the same block):

- every RMSNorm scales by ``(1 + w)`` with zero-initialised ``w`` (vLLM's ``GemmaRMSNorm``);
- gated attention (``Qwen3NextAttention``): ``q_proj`` emits, per head, the query and an
  output gate of ``head_dim`` each; q and k get a per-head ``(1 + w)`` RMSNorm before a
  (partial, neox) rotary embedding; the attention output is multiplied by ``sigmoid(gate)``
  before ``o_proj``;
- the MLP is the sparse MoE block (``Qwen3NextSparseMoeBlock``: softmax router over the
  experts, top-k, renormalised when ``norm_topk_prob``; plus a shared expert scaled by
  ``sigmoid(shared_expert_gate(x))``), or the dense SwiGLU where the config has no experts
  (Qwen3.5 dense).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.attention.layers import (
    MLP,
    AttendFn,
    RMSNorm,
    RotaryEmbedding,
    mix_experts,
)


class OffsetRMSNorm(RMSNorm):
    """vLLM's ``GemmaRMSNorm``: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float32, w = 0 at
    init (the checkpoint stores ``w``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def _normalize(self, x32: Tensor, dtype: torch.dtype) -> Tensor:
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.to(x32.dtype))).to(dtype)


class GatedAttention(nn.Module):
    """``Qwen3NextAttention``: q/k RMSNorm per head, partial rotary, sigmoid output gate."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, bias: bool = False, output_gate: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * (1 + output_gate), bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm, self.k_norm = OffsetRMSNorm(head_dim, eps), OffsetRMSNorm(head_dim, eps)

    def forward(self, x: Tensor, positions: Tensor, rope: RotaryEmbedding,
                attend: AttendFn) -> Tensor:  # fmt: skip
        """x [B, T, H], positions [B, T] -> [B, T, H]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, -1)  # [B, T, n, hd * (1 + gate)]
        gate = None
        if self.output_gate:  # per head: [query | gate], hd each
            q, gate = q.chunk(2, dim=-1)  # [B, T, n, hd] each
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = rope(self.q_norm(q).transpose(1, 2), positions)  # [B, n, T, hd]
        k = rope(self.k_norm(k).transpose(1, 2), positions)  # [B, n_kv, T, hd]
        out = attend(0, q, k, v).transpose(1, 2)  # [B, T, n, hd]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(b, t, -1))


class SparseMoE(nn.Module):
    """``Qwen3NextSparseMoeBlock``: softmax router, top-k experts (weights renormalised when
    ``norm_topk_prob``), plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int,
                 num_experts_per_tok: int, norm_topk_prob: bool,
                 shared_expert_intermediate_size: int) -> None:  # fmt: skip
        super().__init__()
        self.top_k, self.norm_topk_prob = num_experts_per_tok, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(hidden_size, moe_intermediate_size) for _ in range(num_experts)
        )
        shared = shared_expert_intermediate_size
        self.shared_expert = MLP(hidden_size, shared) if shared > 0 else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H] -> (weights [N, k] float32, expert ids [N, k])."""
        probs = F.linear(x.float(), self.gate.weight.float()).softmax(-1)  # [N, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids

    def forward(self, x: Tensor) -> Tensor:
        """[B, T, H] -> [B, T, H]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        out = mix_experts(self.experts, flat, *self.route(flat))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)


class Qwen3NextBlock(nn.Module):
    """The full-attention ``Qwen3NextDecoderLayer``, carrying the residual like vLLM's."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, eps: float, attention_bias: bool = False,
                 output_gate: bool = True, moe: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(hidden_size, eps)
        self.self_attn = GatedAttention(hidden_size, num_heads, num_kv_heads, head_dim, eps,
                                        attention_bias, output_gate)  # fmt: skip
        self.post_attention_layernorm = OffsetRMSNorm(hidden_size, eps)
        self.mlp: nn.Module = (
            SparseMoE(hidden_size, **moe) if moe else MLP(hidden_size, intermediate_size)
        )

    def forward(self, x: Tensor, residual: Tensor | None, positions: Tensor,
                rope: RotaryEmbedding, attend: AttendFn) -> tuple[Tensor, Tensor]:  # fmt: skip
        """x, residual [B, T, H]; positions [B, T] -> (mlp_out, residual) [B, T, H]."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, attend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


MOE_KEYS = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
            "shared_expert_intermediate_size")  # fmt: skip


def block_options(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MTP block's options from the target's text config: ``output_gate``, ``moe`` (None:
    the dense MLP), ``attention_bias``; as vLLM decides them for the MTP layer (index 0)."""
    if cfg.get("layer_scale"):
        raise ConfigError(
            "model.kind mtp: the target's config sets layer_scale, which this kind's "
            "Qwen3-Next MTP block does not build; use model.kind eagle3 for this target"
        )
    if cfg.get("model_type", "").startswith("qwen3_5"):  # qwen3_5.py: MoE iff the MoE model
        sparse = cfg["model_type"] == "qwen3_5_moe_text"
    else:  # qwen3_next.py Qwen3NextDecoderLayer, layer index 0
        sparse = (0 not in (cfg.get("mlp_only_layers") or [])
                  and int(cfg.get("num_experts") or 0) > 0
                  and 1 % int(cfg.get("decoder_sparse_step") or 1) == 0)  # fmt: skip
    moe = None
    if sparse:
        moe = {k: cfg[k] for k in MOE_KEYS if k in cfg}
        moe.setdefault("norm_topk_prob", True)
        moe.setdefault("shared_expert_intermediate_size", 0)
    return {
        "output_gate": bool(cfg.get("attn_output_gate", True)),
        "attention_bias": bool(cfg.get("qkv_bias", False)),
        "moe": moe,
    }
