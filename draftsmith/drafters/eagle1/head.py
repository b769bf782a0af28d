"""The EAGLE-1 head, weight for weight vLLM's ``EagleLlamaForCausalLM``
(``vllm/model_executor/models/llama_eagle.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.drafters.attention.layers import AttendFn, DecoderLayer, sdpa_attend
from draftsmith.drafters.attention.llama import LlamaDraftHead, init_linears, target_sizes


class Eagle1Head(LlamaDraftHead):
    """``EagleLlamaForCausalLM``: ``fc(cat(embeds, hidden))`` (2H -> H), Llama layers whose first
    has no input norm, no final norm, logits from the target's lm_head.

    State-dict keys: ``fc.weight`` [H, 2H], ``layers.{i}.*`` (``layers.0`` without
    ``input_layernorm``). ``embed_tokens`` and ``lm_head`` are frozen, unsaved target buffers.

    ``fc_bias`` is for published heads only: SafeAILab's EAGLE-1 ``fc`` has a bias
    (``eagle/model/cnets1.py``, config ``bias``, true when absent); vLLM's has none, and
    ``convert --to vllm`` folds it into the first layer's attention biases (``layouts_write``).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        intermediate_size: int,
        vocab_size: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        num_layers: int = 1,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        max_position_embeddings: int = 2048,
        attention_bias: bool = False,
        fc_bias: bool = False,
    ) -> None:
        super().__init__({k: v for k, v in locals().items() if k not in ("self", "__class__")})
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(
            DecoderLayer(i, **self.layer_kwargs, input_norm=i > 0) for i in range(num_layers)
        )
        self.register_buffer("lm_head", torch.zeros(vocab_size, hidden_size), persistent=False)
        init_linears(self)

    @property
    def logits_weight(self) -> Tensor:
        """The target's lm_head [vocab, H]."""
        return self.lm_head

    def set_lm_head(self, weight: Tensor) -> None:
        """Copy the target's lm_head [vocab, hidden] into the head."""
        self.lm_head.copy_(weight.detach())

    def combine_hidden_states(self, target_states: Tensor) -> Tensor:
        """Identity: EAGLE-1 reads the target's final (post-norm) state [B, T, H]."""
        return target_states

    def forward(
        self,
        input_ids: Tensor,
        hidden_states: Tensor,
        positions: Tensor,
        attend: AttendFn | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One draft step, as ``llama_eagle.LlamaModel.forward``.

        Args: input_ids [B, T]; hidden_states [B, T, H]; positions [B, T].
        Returns: (out, out), out [B, T, H] = last ``mlp_out + residual`` (no final norm).
        """
        attend = attend or sdpa_attend()
        x = self.fc(torch.cat([self.embed(input_ids), hidden_states], dim=-1))  # [B, T, 2H] -> H
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, attend)
        assert residual is not None
        out = x + residual
        return out, out

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers in order."""
        return list(self.layers)


def eagle1_from_target(target_config: dict[str, Any], **options: Any) -> Eagle1Head:
    """An EAGLE-1 head whose attention, rope and norms are the TARGET's (``config.json``);
    ``options`` pass through (``num_layers`` ...)."""
    return Eagle1Head(**{**target_sizes(target_config), **options})
