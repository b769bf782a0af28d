"""The EAGLE-3 head, weight for weight vLLM's ``Eagle3LlamaForCausalLM``
(``vllm/model_executor/models/llama_eagle3.py``): the same residual-carrying decoder layers
(fused add + RMSNorm in float32), neox rotary embeddings with vLLM's inverse frequencies, and
state-dict keys exactly as vLLM's ``load_weights`` reads them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.attention.layers import AttendFn, DecoderLayer, RMSNorm, sdpa_attend
from draftsmith.drafters.attention.llama import LlamaDraftHead, init_linears, target_sizes


class Eagle3Head(LlamaDraftHead):
    """``Eagle3LlamaForCausalLM``: fc over the target's aux states, a 2H-input first layer.

    State-dict keys (vLLM's): ``fc.weight`` [H, n_aux * H_target], ``midlayer.*`` (first
    layer), ``layers.{i}.*`` for i >= 1, ``norm.weight``, ``lm_head.weight`` [draft_vocab, H]
    and ``d2t`` [draft_vocab] int64 (only when the draft vocabulary is reduced).

    Optional norms before ``fc``, under vLLM's config keys (``combine_hidden_states``):
    ``norm_before_fc`` one RMSNorm over the whole fused input, ``input_norm.weight``
    [n_aux * H_target]; ``fc_norm`` one RMSNorm per tapped state, ``fc_norm.{i}.weight``
    [H_target]. With both, vLLM applies ``input_norm`` first.

    ``parallel_drafting`` (P-EAGLE, ``parallel.py``) adds ``mask_hidden`` [n_aux * H_target]: the
    fused "target state" of the mask slots, which vLLM feeds through ``combine_hidden_states``
    beside the embedding of ``mask_token_id`` to draft every position in one pass.

    ``qk_norm`` makes it vLLM's ``Eagle3Qwen3ForCausalLM`` (``qwen3_eagle3.py``): Qwen3
    attention, ``{midlayer,layers.i}.self_attn.{q,k}_norm.weight`` [head_dim]; that draft
    applies ``sliding_window`` (tokens; None: full attention), the Llama one does not.
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
        draft_vocab_size: int | None = None,
        target_hidden_size: int | None = None,
        num_aux_states: int = 3,
        num_layers: int = 1,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        max_position_embeddings: int = 2048,
        norm_before_residual: bool = False,
        norm_output: bool = False,
        attention_bias: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        parallel_drafting: bool = False,
        mask_token_id: int | None = None,
        qk_norm: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__({k: v for k, v in locals().items() if k not in ("self", "__class__")})
        draft_vocab_size = draft_vocab_size or vocab_size
        self.draft_vocab_size, self.norm_output = draft_vocab_size, norm_output
        target_hidden = target_hidden_size or hidden_size
        fc_in = num_aux_states * target_hidden
        self.input_norm = RMSNorm(fc_in, rms_norm_eps) if norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(target_hidden, rms_norm_eps) for _ in range(num_aux_states))
            if fc_norm
            else None
        )
        self.fc = nn.Linear(fc_in, hidden_size, bias=False)
        self.midlayer = DecoderLayer(
            0, **self.layer_kwargs, eagle3_first=True, norm_before_residual=norm_before_residual
        )
        # vLLM names later layers `layers.{i}` (its mapper only renames `midlayer.` -> `layers.0.`).
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(i, **self.layer_kwargs) for i in range(1, num_layers)}
        )
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        reduced = draft_vocab_size != vocab_size  # a full-vocab head must ship no d2t
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long), reduced)
        self.register_buffer("t2d", torch.ones(vocab_size, dtype=torch.bool), persistent=False)
        if parallel_drafting and mask_token_id is None:
            raise ConfigError("parallel drafting needs the mask slots' token: give mask_token_id")
        self.mask_token_id = mask_token_id
        self.mask_hidden = nn.Parameter(torch.zeros(fc_in)) if parallel_drafting else None
        init_linears(self)
        if self.mask_hidden is not None:
            nn.init.normal_(self.mask_hidden, std=0.02)

    @property
    def logits_weight(self) -> Tensor:
        """The draft lm_head [draft_vocab, H]."""
        return self.lm_head.weight

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Use target ids ``target_ids`` [draft_vocab] (draft id i -> target_ids[i])."""
        ids = target_ids.to(self.d2t.device, torch.long)
        if ids.shape != self.d2t.shape or ids.unique().numel() != ids.numel():
            raise ValueError(f"need {self.draft_vocab_size} distinct target ids, got {ids.shape}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft ids (any shape) -> target ids: ``id + d2t[id]`` as vLLM's compute_logits."""
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft_index(self) -> Tensor:
        """[vocab] long: the draft id of each target id, -1 where it is not in the draft vocab."""
        index = torch.full((self.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        draft = torch.arange(self.draft_vocab_size, device=self.d2t.device)
        index[self.draft_to_target(draft)] = draft
        return index

    def combine_hidden_states(self, aux_states: Tensor) -> Tensor:
        """[B, T, n_aux * H_target] fused target states -> [B, T, H]: the optional norms,
        then ``fc`` (vLLM's ``Eagle3LlamaForCausalLM.combine_hidden_states``)."""
        if self.input_norm is not None:
            aux_states = self.input_norm(aux_states)
        if self.fc_norm is not None:
            chunks = aux_states.chunk(len(self.fc_norm), dim=-1)  # n_aux x [B, T, H_target]
            aux_states = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks, strict=True)], -1)
        return self.fc(aux_states)

    def forward(
        self,
        input_ids: Tensor,
        hidden_states: Tensor,
        positions: Tensor,
        attend: AttendFn | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One draft step, as ``llama_eagle3.LlamaModel.forward``.

        Args: input_ids [B, T]; hidden_states [B, T, H] (post-fc target states, or the
        previous step's feedback); positions [B, T].
        Returns: (normed [B, T, H] for ``lm_head``, feedback [B, T, H] for the next step:
        the pre-norm sum ``mlp_out + residual``, or the normed state if ``norm_output``).
        """
        attend = attend or sdpa_attend()
        embeds = self.embed(input_ids)
        x, residual = self.midlayer(hidden_states, None, positions, self.rotary, attend, embeds)
        for layer in self.layers.values():
            x, residual = layer(x, residual, positions, self.rotary, attend)
        normed, prenorm = self.norm(x, residual)
        return normed, normed if self.norm_output else prenorm

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers in order, ``midlayer`` first."""
        return [self.midlayer, *self.layers.values()]


def eagle3_from_target(target_config: dict[str, Any], **options: Any) -> Eagle3Head:
    """An EAGLE-3 head whose attention, rope and norms are the TARGET's (``config.json``);
    ``options`` pass through (``draft_vocab_size``, ``num_layers``, ``num_aux_states`` ...).
    The head's MLP is its own (SiLU whatever the target's: the exported config says so)."""
    sizes = target_sizes(target_config)
    return Eagle3Head(**{"target_hidden_size": sizes["hidden_size"], **sizes, **options})
