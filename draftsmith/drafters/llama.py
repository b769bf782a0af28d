"""EAGLE-3 and EAGLE-1 draft heads that match vLLM's serving code weight for weight.

The modules mirror ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``)
and ``llama_eagle.py`` (``EagleLlamaForCausalLM``) op for op: the same residual-carrying
decoder layers (fused add + RMSNorm computed in float32), neox-style rotary embeddings with
vLLM's inverse frequencies, and state-dict keys exactly as vLLM's ``load_weights`` reads them.

The layers themselves are in ``layers.py``; attention is pluggable there (``AttendFn``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import text_config
from draftsmith.drafters.layers import (
    ROPE_KEYS,
    AttendFn,
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    rope_kind,
    sdpa_attend,
)


def _init_linears(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class _DraftHead(nn.Module):
    """Shared parts: frozen target embeddings, rotary embedding, per-layer settings."""

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


class Eagle3Head(_DraftHead):
    """``Eagle3LlamaForCausalLM``: fc over the target's aux states, a 2H-input first layer.

    State-dict keys (vLLM's): ``fc.weight`` [H, n_aux * H_target], ``midlayer.*`` (first
    layer), ``layers.{i}.*`` for i >= 1, ``norm.weight``, ``lm_head.weight`` [draft_vocab, H]
    and ``d2t`` [draft_vocab] int64 (only when the draft vocabulary is reduced).

    Optional norms before ``fc``, under vLLM's config keys (``combine_hidden_states``):
    ``norm_before_fc`` one RMSNorm over the whole fused input, ``input_norm.weight``
    [n_aux * H_target]; ``fc_norm`` one RMSNorm per tapped state, ``fc_norm.{i}.weight``
    [H_target]. With both, vLLM applies ``input_norm`` first.

    ``parallel_drafting`` (P-EAGLE, ``peagle.py``) adds ``mask_hidden`` [n_aux * H_target]: the
    fused "target state" of the mask slots, which vLLM feeds through ``combine_hidden_states``
    beside the embedding of ``mask_token_id`` to draft every position in one pass.
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
        _init_linears(self)
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


class Eagle1Head(_DraftHead):
    """``EagleLlamaForCausalLM``: ``fc(cat(embeds, hidden))`` (2H -> H), Llama layers whose first
    has no input norm, no final norm, logits from the target's lm_head.

    State-dict keys: ``fc.weight`` [H, 2H], ``layers.{i}.*`` (``layers.0`` without
    ``input_layernorm``). ``embed_tokens`` and ``lm_head`` are frozen, unsaved target buffers.
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
    ) -> None:
        super().__init__({k: v for k, v in locals().items() if k not in ("self", "__class__")})
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = nn.ModuleList(
            DecoderLayer(i, **self.layer_kwargs, input_norm=i > 0) for i in range(num_layers)
        )
        self.register_buffer("lm_head", torch.zeros(vocab_size, hidden_size), persistent=False)
        _init_linears(self)

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


def from_target_config(
    target_config: dict[str, Any], kind: str = "eagle3", **draft_options: Any
) -> Eagle3Head | Eagle1Head:
    """Build a head whose attention/rope/norm settings come from the TARGET's config.json.

    ``kind`` is ``"eagle3"`` or ``"eagle"`` (EAGLE-1); ``draft_options`` pass through (e.g.
    ``draft_vocab_size``, ``num_layers``, ``norm_before_residual``, ``num_aux_states``).
    """
    cfg = text_config(target_config)
    # The head's MLP is its own (SiLU whatever the target's activation: the exported config
    # says so); only `init_from_target`, which copies a target MLP, needs a SiLU target.
    theta, scaling = target_rope(cfg)
    common: dict[str, Any] = dict(
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
    if kind == "eagle3":
        return Eagle3Head(**{"target_hidden_size": cfg["hidden_size"], **common, **draft_options})
    if kind == "eagle":
        return Eagle1Head(**{**common, **draft_options})
    raise ConfigError(f"model.kind: {kind!r} is not a head built here; use eagle3 or eagle")
