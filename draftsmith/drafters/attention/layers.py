"""The pieces of a draft decoder layer, op for op as vLLM computes them.

RMSNorm with vLLM's fused add (statistics in float32), neox-style rotary embeddings equal to
vLLM's for every rope kind its Llama draft builds (default, linear, dynamic, llama3, yarn,
longrope; partial rotary), attention with a pluggable
``AttendFn`` (``(layer_idx, q, k, v) -> out``: SDPA by default; the training-time-test
unroll in ``ttt.py`` passes one that keeps each layer's per-step KV), the gated MLP, and
the residual-carrying decoder layer of vLLM's EAGLE models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.core.errors import ConfigError

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


# The rope kinds a draft head supports, and the keys of each that vLLM's ``get_rope`` reads
# (vllm/model_executor/layers/rotary_embedding/__init__.py: ``get_rope``). Every kind also
# reads ``rope_theta`` and ``partial_rotary_factor``; the exported config writes these keys only.
ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
    "longrope": (
        "short_factor",
        "long_factor",
        "original_max_position_embeddings",
        "short_mscale",
        "long_mscale",
    ),
}


def rope_kind(scaling: dict[str, Any] | None) -> str:
    """The rope type of a scaling dict (legacy ``type`` and ``su`` as vLLM patches them)."""
    s = scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    return "longrope" if kind == "su" else kind


@dataclass(frozen=True)
class RopeTables:
    """What vLLM's rotary embedding for the draft computes, as a function of the position.

    ``cos/sin(position / position_scale * inv_freq) * attention_scale`` over the first
    ``rotary_dim`` features of each head (neox halves); the rest pass through.
    """

    inv_freq: Tensor  # [rotary_dim // 2]
    rotary_dim: int
    attention_scale: float = 1.0  # YaRN's mscale, LongRoPE's scaling factor
    position_scale: float = 1.0  # linear scaling divides positions by its factor


def rope_tables(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int = 2048
) -> RopeTables:
    """The rotary embedding vLLM builds for a draft config with these rope fields.

    ``scaling`` is the rope parameters without ``rope_theta`` (keys of ``ROPE_KEYS`` plus
    ``partial_rotary_factor``), ``max_position`` the config's ``max_position_embeddings``.
    Inverse frequencies and attention factors come from transformers' own rope functions
    (``ROPE_INIT_FUNCTIONS``), with vLLM's choices where the two differ:

    - ``linear`` divides positions by ``factor`` (vLLM's cache) instead of the frequencies.
    - ``dynamic`` is static in vLLM: the NTK base is computed once at ``max_position``,
      where it equals plain rope (transformers re-scales at run time past that length).
    - ``longrope`` uses the long factors for every position when ``max_position`` exceeds
      ``original_max_position_embeddings`` (vLLM decides by the engine's ``max_model_len``,
      which defaults to the target's ``max_position_embeddings``), else the short ones;
      its attention factor is ``long_mscale``/``short_mscale`` or vLLM's default from the
      two lengths (vLLM ignores ``factor`` and ``attention_factor`` here).
    """
    params = {k: v for k, v in (scaling or {}).items() if k not in ("type", "rope_type")}
    kind = rope_kind(scaling)
    if kind not in ROPE_KEYS:
        raise ConfigError(
            f"rope_type: {kind!r} (the target's rope_parameters) has no draft-head rotary "
            f"embedding; supported: {', '.join(ROPE_KEYS)}."
        )
    if kind == "dynamic" and not {"alpha", "max_trained_positions"}.isdisjoint(params):
        raise ConfigError(
            "rope_parameters: dynamic rope with 'alpha' or 'max_trained_positions' has no "
            "draft-head rotary embedding; only dynamic rope with 'factor' is supported."
        )
    partial = float(params.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    default = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    if kind == "default":
        return RopeTables(default, rotary_dim)
    if kind == "linear":
        return RopeTables(default, rotary_dim, position_scale=float(params["factor"]))
    import transformers
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if int(transformers.__version__.split(".")[0]) < 5:
        raise ConfigError(
            f"rope_type: {kind!r} needs transformers >= 5 (rope_parameters), found "
            f"{transformers.__version__}; upgrade transformers."
        )
    hf = {k: params[k] for k in ROPE_KEYS[kind] if k in params}
    hf |= {"rope_type": kind, "rope_theta": theta, "partial_rotary_factor": partial}
    seq_len = None
    if kind == "longrope":
        orig = int(hf.get("original_max_position_embeddings", max_position))
        seq_len = max_position if max_position > orig else None  # long factors, or short
        mscale = hf.pop("long_mscale" if seq_len else "short_mscale", None)
        hf.pop("long_mscale" if not seq_len else "short_mscale", None)
        if mscale is not None:
            hf["attention_factor"] = float(mscale)
    config = LlamaConfig(
        hidden_size=head_dim,
        num_attention_heads=1,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        rope_parameters=hf,
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len)
    return RopeTables(inv_freq.float(), rotary_dim, attention_scale=float(attention_factor))


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int = 2048
) -> Tensor:
    """Inverse frequencies [rotary_dim // 2] as vLLM's ``get_rope`` computes them."""
    return rope_tables(head_dim, theta, scaling, max_position).inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding equal to vLLM's for the exported config (``rope_tables``),
    positions given per token; partial rotary turns only the first ``rotary_dim`` features."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_position: int | None = None,
    ) -> None:
        super().__init__()
        tables = rope_tables(head_dim, theta, scaling, max_position or 2048)
        self.rotary_dim = tables.rotary_dim
        self.attention_scale, self.position_scale = tables.attention_scale, tables.position_scale
        self.register_buffer("inv_freq", tables.inv_freq, persistent=False)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [...] -> (cos, sin) [..., rotary_dim // 2] in float32, as vLLM's cache."""
        t = positions.float()
        if self.position_scale != 1.0:
            t = t / self.position_scale
        freqs = t[..., None] * self.inv_freq.float()
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scale != 1.0:
            cos, sin = cos * self.attention_scale, sin * self.attention_scale
        return cos, sin

    def tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> (cos, sin) [B, 1, T, rotary_dim // 2] in ``dtype``: computed in
        float32, cast once (vLLM casts its cache to the query's dtype), shared by q and k."""
        cos, sin = self.cos_sin(positions)
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [B, n, T, hd], positions [B, T] -> rotated x [B, n, T, hd]."""
        return self.rotate(x, *self.tables(positions, x.dtype))

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, n, T, hd] turned by ``tables`` [B, 1, T, rotary_dim // 2] -> [B, n, T, hd]."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class Attention(nn.Module):
    """Llama attention with separate q/k/v projections (vLLM stacks them into qkv_proj);
    ``qk_norm``: Qwen3's, each head of q and k RMS-normed before rope (``q_norm`` /
    ``k_norm`` [head_dim], vLLM's ``Qwen3Attention``)."""

    def __init__(
        self,
        layer_idx: int,
        input_size: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        qk_norm: bool = False,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.layer_idx, self.num_heads, self.num_kv_heads = layer_idx, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(input_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)

    def forward(
        self, x: Tensor, positions: Tensor, rope: RotaryEmbedding, attend: AttendFn
    ) -> Tensor:
        """x [B, T, input_size], positions [B, T] -> [B, T, hidden_size]."""
        b, t, _ = x.shape
        # [B, T, n * hd] -> [B, T, n, hd] -> [B, n, T, hd]
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):  # Qwen3: per head, before rope
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope.tables(positions, q.dtype)  # once for q and k: no second cast
        out = attend(self.layer_idx, rope.rotate(q, cos, sin), rope.rotate(k, cos, sin), v)
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
    EAGLE-1 first layer, whose input norm vLLM replaces by the identity. ``qk_norm``: Qwen3's
    attention (vLLM's ``Qwen3Eagle3DecoderLayer``).
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
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.eagle3_first, self.norm_before_residual = eagle3_first, norm_before_residual
        in_size = 2 * hidden_size if eagle3_first else hidden_size
        self.input_layernorm = RMSNorm(hidden_size, eps) if input_norm else None
        if eagle3_first:
            self.hidden_norm = RMSNorm(hidden_size, eps)
        self.self_attn = Attention(layer_idx, in_size, hidden_size, num_heads, num_kv_heads,
                                   head_dim, attention_bias, qk_norm, eps)  # fmt: skip
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
            # The embeddings (float32) are normed in their dtype and cast once to the hidden
            # state's, the dtype q/k/v read under autocast: the same values as a float32 cat
            # (which would upcast x here and cast it back in each projection), fewer casts.
            x = torch.cat([self.input_layernorm(embeds).to(x.dtype), x], dim=-1)  # [B, T, 2H]
        elif residual is None:
            residual = x
            x = x if self.input_layernorm is None else self.input_layernorm(x)
        else:
            assert self.input_layernorm is not None
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, attend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def mix_experts(experts: nn.ModuleList, flat: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """The routed experts' weighted sum: flat [N, H], weights / ids [N, top_k] -> [N, H]
    (accumulated in float32, returned in ``flat``'s dtype)."""
    out = torch.zeros_like(flat, dtype=torch.float32)
    for e, expert in enumerate(experts):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            out.index_add_(0, rows, expert(flat[rows]).float() * weights[rows, slot, None])
    return out.to(flat.dtype)
