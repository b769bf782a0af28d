"""The DSpark drafter: a DFlash-style block backbone, a low-rank Markov head, a confidence head.

Op for op what vLLM 0.32 loads as ``Qwen3DSparkModel`` (``qwen3_dspark.py``, whose backbone
is ``DFlashQwen3Model`` of ``qwen3_dflash.py``):

- Context: the target's tapped states of every token before the anchor, concatenated in
  ascending layer order [T, n_ctx * Ht], through ``fc`` (-> [T, H]) and ``hidden_norm``; each
  layer projects that normed context to its own keys (``k_norm``, rotary) and values only.
- Query, anchor-as-first (vLLM's ``sample_from_anchor``, its default for ``Qwen3DSparkModel``):
  the block ``[x_a, MASK, ..., MASK]`` of B slots at positions ``a .. a + B - 1``, embedded
  with the target's frozen embeddings (the mask slots by the target's row of
  ``mask_token_id``: vLLM's DSpark drops any ``mask_embedding``), then Qwen3 decoder layers
  (non-causal inside the block) and a final ``norm``. Slot ``i`` predicts the token at
  ``a + i + 1``: B drafts per block (``num_speculative_tokens`` = B).
- Markov head (``markov_head.markov_w1`` [V, r], ``markov_head.markov_w2`` [V, r]): slot i's
  logits are ``lm_head(h_i) + markov_w2(markov_w1(prev_i))`` where ``prev_i`` is the token
  before the one slot i predicts (slot 0: the anchor; then the previous draft, sampled left
  to right by vLLM's ``DSparkSpeculator._sample_sequential``).
- Confidence head (``confidence_head.proj`` [1, H + r] with a bias, float32): ``sigmoid`` of
  ``proj([h_i ; markov_w1(prev_i)])`` estimates the chance slot i's draft is accepted
  (``confidence_head_with_markov: true``).

No ``embed_tokens`` / ``lm_head`` in the state dict: vLLM shares the target's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.drafters.attention.block_layers import BlockLayer
from draftsmith.drafters.attention.layers import RMSNorm, RotaryEmbedding


class MarkovHead(nn.Module):
    """vLLM's ``DSparkMarkovHead``: ``markov_w2(markov_w1[prev])``, a rank-r bigram bias."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as the plain block drafter

    def bias(self, embed: Tensor) -> Tensor:
        """[..., r] -> [..., V]."""
        return self.markov_w2(embed)


class ConfidenceHead(nn.Module):
    """vLLM's ``DSparkConfidenceHead`` with ``with_markov``: a logit over [h ; w1(prev)]."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: Tensor, markov_embed: Tensor) -> Tensor:
        """hidden [..., H], markov_embed [..., r] -> acceptance logit [...] (float32)."""
        x = torch.cat([hidden, markov_embed], dim=-1).float()
        return F.linear(x, self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDrafter(nn.Module):
    """DSpark block drafter (module docstring). Flat arguments, kept in ``init_kwargs`` so that
    export rebuilds the drafter from a checkpoint alone.

    Args:
        target_layer_ids: vLLM's 0-based ids (it taps the state after decoder layer ``i``,
            draftsmith's layer id ``i + 1``), ascending.
        mask_token_id: the id of the mask slots (its target embedding row is their input).
        block_size: B, query slots per block = drafts per block.
        markov_rank: r of the Markov head.
        confidence_head: build the confidence head.
    """

    def __init__(self, *, hidden_size: int, num_heads: int, intermediate_size: int,
                 vocab_size: int, target_layer_ids: list[int], mask_token_id: int,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 target_hidden_size: int | None = None, num_layers: int = 1,
                 block_size: int = 8, markov_rank: int = 256, confidence_head: bool = True,
                 rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0,
                 rope_scaling: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__()
        self.init_kwargs = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.head_dim = head_dim or hidden_size // num_heads
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.target_layer_ids, self.markov_rank = list(target_layer_ids), markov_rank
        fc_in = len(target_layer_ids) * (target_hidden_size or hidden_size)
        self.fc = nn.Linear(fc_in, hidden_size, bias=False)
        self.hidden_norm = RMSNorm(hidden_size, rms_norm_eps)
        attn = dict(num_heads=num_heads, num_kv_heads=num_kv_heads or num_heads)
        self.layers = nn.ModuleList(
            BlockLayer(
                hidden_size, intermediate_size, rms_norm_eps, head_dim=self.head_dim, **attn
            )  # fmt: skip
            for _ in range(num_layers)
        )
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.rotary = RotaryEmbedding(self.head_dim, rope_theta, rope_scaling)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        # Built after the init loop: the Markov head starts at zero bias.
        self.markov_head = MarkovHead(vocab_size, markov_rank)
        self.confidence_head = (
            ConfidenceHead(hidden_size + markov_rank) if confidence_head else None
        )
        # Shared from the target, frozen, never exported: a non-persistent buffer.
        self.register_buffer("embed_tokens", torch.zeros(vocab_size, hidden_size), persistent=False)

    def set_embeddings(self, weight: Tensor) -> None:
        """Copy the target's input embeddings [V, H]."""
        self.embed_tokens.copy_(weight.detach())

    def forward(self, block_ids: Tensor, block_positions: Tensor, target_states: Tensor,
                context_positions: Tensor, mask: Tensor) -> Tensor:  # fmt: skip
        """The parallel pass over every block.

        Args: block_ids [B, Q] (blocks of B slots back to back), block_positions [B, Q];
        target_states [B, T, n_ctx * Ht] and context_positions [B, T] of the row's tokens;
        mask [B, 1, Q, T + Q] bool over (context keys, block keys).
        Returns: final-normed slot states [B, Q, H] (the target's lm_head reads them).
        """
        ctx = self.hidden_norm(self.fc(target_states))  # [B, T, H]
        x, residual = F.embedding(block_ids, self.embed_tokens), None
        for layer in self.layers:
            kv = layer.self_attn.context_kv(ctx, context_positions, self.rotary)
            x, residual = layer(x, residual, block_positions, self.rotary, kv, mask)
        return self.norm(x, residual)[0]

    def markov_embed(self, prev_ids: Tensor) -> Tensor:
        """[...] previous token ids -> [..., r]."""
        return self.markov_head.markov_w1(prev_ids)

    def logits(self, hidden: Tensor, prev_ids: Tensor, lm_head: Tensor) -> Tensor:
        """Slot logits: hidden [..., H], prev_ids [...], lm_head [V, H] -> [..., V]."""
        return hidden @ lm_head.T + self.markov_head.bias(self.markov_embed(prev_ids))

    def confidence_logit(self, hidden: Tensor, prev_ids: Tensor) -> Tensor:
        """[..., H], [...] -> acceptance logit [...] (``sigmoid`` is vLLM's confidence)."""
        return self.confidence_head(hidden, self.markov_embed(prev_ids))


def dspark_from_target(target_config: dict[str, Any], **options: Any) -> DSparkDrafter:
    """A drafter whose attention / rope / norm sizes and vocabulary are the TARGET's
    (``config.json``); ``options`` pass through (``target_layer_ids``, ``mask_token_id``,
    ``num_layers``, ``block_size``, ``markov_rank``, ``confidence_head``)."""
    from draftsmith.core.targets import text_config
    from draftsmith.drafters.attention.llama import target_sizes

    cfg = text_config(target_config)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"only silu MLPs are supported, target uses {cfg['hidden_act']!r}")
    sizes = target_sizes(cfg)
    del sizes["max_position_embeddings"]  # vLLM builds the drafter's rope from its config
    return DSparkDrafter(**sizes, target_hidden_size=cfg["hidden_size"], **options)
