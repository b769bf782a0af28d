"""One MTP layer, op for op as vLLM 0.32 serves it (``families.py`` says per family how).

Step input: the token embedding e [B, T, H] (zeroed at rope position 0 where the family
does), the state s [B, T, H] (the target's at step 0, the layer's own feedback after), then::

    x = proj(cat(enorm(e), hnorm(s)))          # or cat(hnorm(s), enorm(e)): MiMo
    y = block(x) + residual                     # one decoder layer, residual carried
    logits = lm_head(final_norm(y) or y)        # the target's lm_head, shared at serving
    feedback = final_norm(y) or y

The block is vLLM's Qwen2 layer (MiMo: q/k/v biases), Llama layer (ERNIE 4.5's MTP block),
GLM-4 MoE layer (sigmoid router with a score-correction bias, shared experts) or Qwen3-Next's
full-attention layer (``qwen3_next.py``: gated attention, ``(1 + w)`` norms, which the
Qwen3-Next layer's enorm / hnorm / final_norm are too). Attention is pluggable
(``layers.AttendFn``): the recursive objective passes ``ttt.TTTAttention``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.core.targets import text_config
from draftsmith.drafters.attention.layers import (
    MLP,
    AttendFn,
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    mix_experts,
)
from draftsmith.drafters.attention.llama import target_sizes
from draftsmith.drafters.mtp.families import Family
from draftsmith.drafters.mtp.qwen3_next import OffsetRMSNorm, Qwen3NextBlock, block_options


class MoE(nn.Module):
    """vLLM's ``Glm4MoE``: sigmoid scores, top-k chosen on score + ``e_score_correction_bias``
    within the best ``topk_group`` of ``n_group`` groups, weights renormalised
    (``norm_topk_prob``) and scaled by ``routed_scaling_factor``, plus the shared experts."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, n_routed_experts: int,
                 num_experts_per_tok: int, n_shared_experts: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float) -> None:  # fmt: skip
        super().__init__()
        self.top_k, self.n_group, self.topk_group = num_experts_per_tok, n_group, topk_group
        self.norm_topk_prob, self.scale = norm_topk_prob, routed_scaling_factor
        self.gate = nn.Linear(hidden_size, n_routed_experts, bias=False)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(n_routed_experts))
        self.experts = nn.ModuleList(
            MLP(hidden_size, moe_intermediate_size) for _ in range(n_routed_experts)
        )
        self.shared_experts = (
            MLP(hidden_size, moe_intermediate_size * n_shared_experts) if n_shared_experts else None
        )

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H] -> (weights [N, k] float32, expert ids [N, k])."""
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.gate.e_score_correction_bias.float()
        if self.n_group > 1:
            groups = choice.view(x.shape[0], self.n_group, -1)  # [N, G, E / G]
            group_score = groups.topk(2, dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(group_score).scatter_(
                1, group_score.topk(self.topk_group, dim=-1).indices, 1.0
            )
            choice = choice.masked_fill(~keep.bool().repeat_interleave(groups.shape[-1], 1), 0.0)
        ids = choice.topk(self.top_k, dim=-1).indices  # [N, k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.scale, ids

    def forward(self, x: Tensor) -> Tensor:
        """[B, T, H] -> [B, T, H]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        out = mix_experts(self.experts, flat, *self.route(flat))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)


class MTPLayer(nn.Module):
    """One target MTP layer (module docstring). Flat constructor arguments (``init_kwargs``)
    so ``draftsmith export`` rebuilds it from a checkpoint."""

    def __init__(self, *, family: str, block: str, hidden_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate_size: int, vocab_size: int,
                 rms_norm_eps: float, rope_theta: float, rope_scaling: dict | None,
                 max_position_embeddings: int, embed_first: bool, logits_norm: bool,
                 feedback_norm: bool, mask_position_zero: bool, attention_bias: bool = False,
                 num_hidden_layers: int = 0, moe: dict[str, Any] | None = None,
                 output_gate: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.init_kwargs = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        h = hidden_size
        self.family, self.embed_first = family, embed_first
        self.logits_norm, self.feedback_norm = logits_norm, feedback_norm
        self.mask_position_zero, self.num_hidden_layers = mask_position_zero, num_hidden_layers
        norm = OffsetRMSNorm if block == "qwen3_next" else RMSNorm
        self.enorm, self.hnorm = norm(h, rms_norm_eps), norm(h, rms_norm_eps)
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.block: nn.Module
        if block == "qwen3_next":
            self.block = Qwen3NextBlock(h, num_heads, num_kv_heads, head_dim, intermediate_size,
                                        rms_norm_eps, attention_bias, output_gate, moe)  # fmt: skip
        else:
            bias = block == "qwen2" or attention_bias
            self.block = DecoderLayer(0, h, num_heads, num_kv_heads, head_dim, intermediate_size,
                                      rms_norm_eps, attention_bias=bias)  # fmt: skip
        if block in ("qwen2", "glm4_moe"):  # biases on q/k/v only (or none), never on o_proj
            self.block.self_attn.o_proj = nn.Linear(num_heads * head_dim, h, bias=False)
        if block == "glm4_moe":
            self.block.mlp = MoE(h, **(moe or {}))
        self.final_norm = norm(h, rms_norm_eps) if logits_norm or feedback_norm else None
        self.rotary = RotaryEmbedding(head_dim, rope_theta, rope_scaling, max_position_embeddings)
        # The target's input embeddings: shared at serving, frozen, never exported.
        self.register_buffer("embed_tokens", torch.zeros(vocab_size, h), persistent=False)

    def set_embeddings(self, weight: Tensor) -> None:
        """Copy the target's input embedding matrix [vocab, hidden] into the layer."""
        self.embed_tokens.copy_(weight.detach())

    def forward(self, input_ids: Tensor, states: Tensor, positions: Tensor,
                attend: AttendFn) -> tuple[Tensor, Tensor]:  # fmt: skip
        """input_ids [B, T], states [B, T, H], positions [B, T] -> (logits input [B, T, H],
        feedback state [B, T, H]): ``logits = logits_input @ lm_head.T``."""
        e = F.embedding(input_ids, self.embed_tokens)  # [B, T, H]
        if self.mask_position_zero:
            e = torch.where(positions[..., None] == 0, torch.zeros_like(e), e)
        e, s = self.enorm(e), self.hnorm(states.to(e.dtype))
        x = self.proj(torch.cat([e, s] if self.embed_first else [s, e], dim=-1))  # [B, T, H]
        out, residual = self.block(x, None, positions, self.rotary, attend)
        y = out + residual
        normed = self.final_norm(y) if self.final_norm is not None else y
        return (normed if self.logits_norm else y), (normed if self.feedback_norm else y)


def mtp_from_target(target_config: dict[str, Any], family: Family) -> MTPLayer:
    """The MTP layer of a target of ``family`` (sizes, rope, MoE from its ``config.json``),
    with default weights: load the target's own with ``load_state_dict``."""
    cfg = text_config(target_config)
    sizes = target_sizes(cfg)
    moe = None
    if family.block == "glm4_moe":
        # vLLM builds GLM-4 MoE attention with a partial rotary factor of 0.5 unless the config
        # says otherwise (glm4_moe.py:280).
        scaling = dict(sizes["rope_scaling"] or {"rope_type": "default"})
        if "partial_rotary_factor" not in (cfg.get("rope_parameters") or {}):
            scaling["partial_rotary_factor"] = float(cfg.get("partial_rotary_factor", 0.5))
        sizes["rope_scaling"] = scaling
        keys = ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                "n_shared_experts", "n_group", "topk_group", "norm_topk_prob",
                "routed_scaling_factor")  # fmt: skip
        moe = {k: cfg[k] for k in keys}
    if family.block == "qwen3_next":
        return MTPLayer(family=family.name, block=family.block, **sizes,
                        embed_first=family.embed_first, logits_norm=family.logits_norm,
                        feedback_norm=family.feedback_norm,
                        mask_position_zero=family.mask_position_zero,
                        num_hidden_layers=cfg["num_hidden_layers"],
                        **block_options(cfg))  # fmt: skip
    if family.block == "llama":  # vLLM's LlamaDecoderLayer reads attention_bias (or bias)
        bias = bool(cfg.get("attention_bias") or cfg.get("bias"))
    else:
        bias = bool(cfg.get("attention_bias", False))
    return MTPLayer(family=family.name, block=family.block, **sizes,
                    embed_first=family.embed_first, logits_norm=family.logits_norm,
                    feedback_norm=family.feedback_norm,
                    mask_position_zero=family.mask_position_zero, attention_bias=bias,
                    num_hidden_layers=cfg["num_hidden_layers"], moe=moe)  # fmt: skip
