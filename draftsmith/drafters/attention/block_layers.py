"""The layers of a block drafter (DFlash, DSpark): Qwen3 decoder layers whose attention
reads the target's context as keys and values before the block's own.

vLLM serves both kinds on ``DFlashQwen3Model`` (``qwen3_dflash.py``): ``BlockLayer`` is its
``DFlashQwen3DecoderLayer`` and ``BlockAttention`` its attention, op for op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.drafters.attention.layers import MLP, RMSNorm, RotaryEmbedding, repeat_kv


class BlockAttention(nn.Module):
    """Qwen3 attention (``q_norm`` / ``k_norm``) whose keys and values are the context's (from
    ``fc``), then the block's own (vLLM's ``DFlashQwen3Attention`` after its context-KV
    precompute)."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def _heads(self, x: Tensor, n: int, norm: RMSNorm | None = None) -> Tensor:
        """[B, T, n * hd] -> [B, n, T, hd], each head RMS-normed by ``norm`` first."""
        b, t, _ = x.shape
        x = x.view(b, t, n, self.head_dim)
        return (x if norm is None else norm(x)).transpose(1, 2)

    def context_kv(
        self, context: Tensor, positions: Tensor, rope: RotaryEmbedding
    ) -> tuple[Tensor, Tensor]:
        """Normed context [B, T, H], positions [B, T] -> keys, values [B, n_kv, T, hd]."""
        k = self._heads(self.k_proj(context), self.num_kv_heads, self.k_norm)
        return rope(k, positions), self._heads(self.v_proj(context), self.num_kv_heads)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        rope: RotaryEmbedding,
        context_kv: tuple[Tensor, Tensor],
        mask: Tensor,
    ) -> Tensor:
        """x [B, Q, H] (block slots), positions [B, Q], context keys/values [B, n_kv, T, hd],
        mask [B, 1, Q, T + Q] bool (true = may attend) -> [B, Q, H]."""
        b, q_len, _ = x.shape
        q = rope(self._heads(self.q_proj(x), self.num_heads, self.q_norm), positions)
        k = rope(self._heads(self.k_proj(x), self.num_kv_heads, self.k_norm), positions)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        k = torch.cat([context_kv[0], k], dim=2)  # [B, n_kv, T + Q, hd]
        v = torch.cat([context_kv[1], v], dim=2)
        n_rep = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))  # [B, Q, n * hd]


class BlockLayer(nn.Module):
    """vLLM's ``DFlashQwen3DecoderLayer``: residual carried beside, fused add + RMSNorm."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float, **attn: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = BlockAttention(hidden_size, eps=eps, **attn)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        positions: Tensor,
        rope: RotaryEmbedding,
        context_kv: tuple[Tensor, Tensor],
        mask: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """x, residual [B, Q, H] -> (mlp_out, residual) [B, Q, H]."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, context_kv, mask)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
