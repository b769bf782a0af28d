"""The pieces of a draft decoder layer, op for op as vLLM computes them.

RMSNorm with vLLM's fused add (statistics in float32), neox-style rotary embeddings with
vLLM's inverse frequencies (default, linear and llama3 scaling), attention with a pluggable
``AttendFn`` (``(layer_idx, q, k, v) -> out``: SDPA by default; the training-time-test
unroll in ``ttt.py`` passes one that keeps each layer's per-step KV), the gated MLP, and
the residual-carrying decoder layer of vLLM's EAGLE models.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# (layer_idx, q [B, n_heads, T, hd], k [B, n_kv, T, hd], v [B, n_kv, T, hd]) -> [B, n_heads, T, hd]
AttendFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, n_kv, T, hd] -> [B, n_kv * n_rep, T, hd]; query head h reads kv head h // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def sdpa_attend(mask: Tensor | None = None) -> AttendFn:
    """Plain attention: causal if ``mask`` is None, else the boolean ``mask`` [B, 1, T, S]."""

    def attend(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)

    return attend


class RMSNorm(nn.Module):
    """vLLM's ``rms_norm`` / ``fused_add_rms_norm``: statistics in float32, weight last."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _normalize(self, x32: Tensor, dtype: torch.dtype) -> Tensor:
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32.to(self.weight.dtype) * self.weight).to(dtype)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Any:
        """x [..., dim] -> normed [..., dim]; with ``residual`` returns (norm(x + r), x + r)."""
        wide = torch.promote_types(x.dtype, torch.float32)  # float32 (float64 stays float64)
        if residual is None:
            return self._normalize(x.to(wide), x.dtype)
        summed = x.to(wide) + residual.to(wide)  # the add happens in float32, like vLLM
        return self._normalize(summed, x.dtype), summed.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Tensor:
    """Inverse frequencies [head_dim // 2] as vLLM's ``get_rope`` computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", "linear"):  # linear scales positions instead (see RotaryEmbedding)
        return inv_freq
    if kind == "llama3":  # vllm/.../rotary_embedding/llama3_rope.py
        assert scaling is not None
        factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
        orig = scaling["original_max_position_embeddings"]
        wave_len = 2 * math.pi / inv_freq
        smooth = (orig / wave_len - low) / (high - low) if low != high else 0
        return torch.where(
            wave_len < orig / high,
            inv_freq,
            torch.where(
                wave_len > orig / low,
                inv_freq / factor,
                (1 - smooth) * inv_freq / factor + smooth * inv_freq,
            ),
        )
    raise NotImplementedError(f"rope_type {kind!r} is not supported by the draft heads")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (vLLM's default for Llama/Qwen), positions given per token."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        scaling = dict(scaling) if scaling else None
        if scaling and scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("partial rotary embeddings are not supported")
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        self.position_scale = float(scaling["factor"]) if kind == "linear" and scaling else 1.0
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [B, n, T, hd], positions [B, T] -> rotated x [B, n, T, hd]."""
        t = positions.float()
        if self.position_scale != 1.0:
            t = t / self.position_scale
        freqs = t[..., None] * self.inv_freq  # [B, T, hd/2]
        cos = freqs.cos().to(x.dtype)[:, None]  # [B, 1, T, hd/2]
        sin = freqs.sin().to(x.dtype)[:, None]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Llama attention with separate q/k/v projections (vLLM stacks them into qkv_proj)."""

    def __init__(
        self,
        layer_idx: int,
        input_size: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
    ) -> None:
        super().__init__()
        self.layer_idx, self.num_heads, self.num_kv_heads = layer_idx, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(input_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    def forward(
        self, x: Tensor, positions: Tensor, rope: RotaryEmbedding, attend: AttendFn
    ) -> Tensor:
        """x [B, T, input_size], positions [B, T] -> [B, T, hidden_size]."""
        b, t, _ = x.shape
        # [B, T, n * hd] -> [B, T, n, hd] -> [B, n, T, hd]
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = attend(self.layer_idx, rope(q, positions), rope(k, positions), v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # [B, T, n * hd]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """[B, T, hidden] -> [B, T, hidden]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """vLLM's Llama decoder layer, which carries the residual stream separately.

    ``eagle3_first`` builds the EAGLE-3 first layer: q/k/v read ``2 * hidden`` features
    (``cat(input_layernorm(embeds), hidden_norm(hidden))``). ``input_norm=False`` builds the
    EAGLE-1 first layer, whose input norm vLLM replaces by the identity.
    """

    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        eps: float,
        attention_bias: bool = False,
        eagle3_first: bool = False,
        input_norm: bool = True,
        norm_before_residual: bool = False,
    ) -> None:
        super().__init__()
        self.eagle3_first, self.norm_before_residual = eagle3_first, norm_before_residual
        in_size = 2 * hidden_size if eagle3_first else hidden_size
        self.input_layernorm = RMSNorm(hidden_size, eps) if input_norm else None
        if eagle3_first:
            self.hidden_norm = RMSNorm(hidden_size, eps)
        self.self_attn = Attention(
            layer_idx, in_size, hidden_size, num_heads, num_kv_heads, head_dim, attention_bias
        )
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        positions: Tensor,
        rope: RotaryEmbedding,
        attend: AttendFn,
        embeds: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """x, residual, embeds [B, T, H]; positions [B, T] -> (mlp_out, residual) [B, T, H]."""
        if self.eagle3_first:  # llama_eagle3.LlamaDecoderLayer.forward, layer_idx == 0
            assert embeds is not None and self.input_layernorm is not None
            if self.norm_before_residual:
                x = residual = self.hidden_norm(x)
            else:
                residual, x = x, self.hidden_norm(x)
            x = torch.cat([self.input_layernorm(embeds), x], dim=-1)  # [B, T, 2H]
        elif residual is None:
            residual = x
            x = x if self.input_layernorm is None else self.input_layernorm(x)
        else:
            assert self.input_layernorm is not None
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, attend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
