"""The DFlash2 drafter: DFlash's drafter with convolution-wrapped layers and a selector.

What vLLM 0.32 loads as ``DFlash2DraftModel`` (``qwen3_dflash2.py``: ``DFlash2Qwen3Model``
subclasses ``DFlashQwen3Model``) is DFlash's drafter plus two parts, so this drafter is
literally ``drafters/dflash``'s ``DFlashDrafter`` (context, mask slots, embeddings, the
one-pass block) with

- each decoder layer a ``conv.ConvBlockLayer`` (a convolution pair around attention and
  around the MLP), and
- ``candidate_selector`` (``selector.CandidateSelector``), read after the final norm.

State-dict keys are vLLM's: DFlash's, plus ``layers.{i}.{attention,mlp}_conv.base_kernel``
[2, kernel, H], ``layers.{i}.{attention,mlp}_conv.kernel_projection.weight``
[2 * kernel * G, H] and ``candidate_selector.{predecessor,successor}_codebook`` [V, r],
``candidate_selector.hidden_projection.weight`` [r, H].

vLLM serves DFlash2 only in its GPU (V2) model runner, whose context-key norm applies each
layer's own ``k_norm``: every layer keeps its own (``tie_k_norm`` false by default; DFlash ties
them for vLLM-CPU's kernel, which never runs a DFlash2 drafter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.drafters.dflash.export import NOT_IN_SAFETENSORS, read_mask_embedding
from draftsmith.drafters.dflash.model import DFlashDrafter, dflash_from_target
from draftsmith.drafters.dflash2.conv import ConvBlockLayer
from draftsmith.drafters.dflash2.selector import CandidateSelector
from draftsmith.drafters.headfiles.directory import HeadError
from draftsmith.drafters.headfiles.read import check_tensors, read_head_files


class DFlash2Drafter(DFlashDrafter):
    """DFlash2 block drafter (module docstring); ``DFlashDrafter``'s arguments plus:

    Args:
        conv_kernel_size: taps per convolution (``dflash_config.conv_kernel_size``).
        conv_group_size: channels sharing one dynamic coefficient (must divide H).
        selector_rank: r of the selector's codebooks.
        selector_top_k: K, candidates per slot.
    """

    def __init__(self, *, conv_kernel_size: int = 2, conv_group_size: int = 16,
                 selector_rank: int = 256, selector_top_k: int = 16,
                 tie_k_norm: bool = False, **dflash: Any) -> None:  # fmt: skip
        # Plain ints before Module.__init__: DFlashDrafter's __init__ builds the layers
        # through ``decoder_layer``, which reads them.
        self.conv_kernel_size, self.conv_group_size = conv_kernel_size, conv_group_size
        super().__init__(tie_k_norm=tie_k_norm, **dflash)
        if not 1 <= selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k {selector_top_k} must lie in 1..{self.vocab_size}")
        self.init_kwargs.update(
            conv_kernel_size=conv_kernel_size,
            conv_group_size=conv_group_size,
            selector_rank=selector_rank,
            selector_top_k=selector_top_k,
        )
        for layer in self.layers:  # DFlashDrafter's init drew every Linear: back to identity
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        self.candidate_selector = CandidateSelector(
            self.vocab_size, self.hidden_size, selector_rank, selector_top_k
        )

    def decoder_layer(self, hidden_size: int, intermediate_size: int, eps: float,
                      **attn: int) -> nn.Module:  # fmt: skip
        return ConvBlockLayer(hidden_size, intermediate_size, eps, block_size=self.block_size,
                              conv_kernel_size=self.conv_kernel_size,
                              conv_group_size=self.conv_group_size, **attn)  # fmt: skip

    @property
    def top_k(self) -> int:
        return self.candidate_selector.top_k


def dflash2_from_target(target_config: dict[str, Any], **options: Any) -> DFlash2Drafter:
    """A DFlash2 drafter sized from the TARGET's ``config.json`` (``dflash_from_target``);
    ``options`` pass through."""
    return dflash_from_target(target_config, DFlash2Drafter, **options)


def is_dflash_part(name: str) -> bool:
    """Whether a DFlash2 state-dict key is one a DFlash drafter has too."""
    return "_conv." not in name and not name.startswith("candidate_selector.")


def warm_start(head: DFlash2Drafter, head_dir: str) -> int:
    """Load an exported DFlash head directory (``draftsmith export`` of a ``model.kind
    dflash`` checkpoint: ``model.safetensors``, ``mask_embedding.pt``) into ``head``'s DFlash
    parts; the convolutions stay the identity and the selector as drawn, so the drafter starts
    as that DFlash drafter. Returns the tensors loaded; refuses a head that does not fit."""
    config, tensors = read_head_files(head_dir)
    where = f"model.init_from_dflash: {head_dir}"
    arch = (config.get("architectures") or ["?"])[0]
    dflash = config.get("dflash_config") or {}
    if arch != "DFlashDraftModel":
        raise HeadError(f"{where} is a {arch}; give a DFlash head (DFlashDraftModel) directory")
    if dflash.get("target_layer_ids") != head.target_layer_ids:
        raise HeadError(
            f"{where} reads target layers {dflash.get('target_layer_ids')}, this drafter "
            f"{head.target_layer_ids}; train both on the same data.aux_layers"
        )
    state = head.state_dict()
    expected = {n: v for n, v in state.items() if is_dflash_part(n) and n not in NOT_IN_SAFETENSORS}
    check_tensors("DFlash", expected, tensors)
    mask = read_mask_embedding(Path(head_dir))
    if mask is not None and head.mask_embedding is None:
        raise HeadError(f"{where} ships a trained mask embedding; set model.train_mask_embedding "
                        "true")  # fmt: skip
    if dflash.get("mask_token_id") != head.mask_token_id:
        raise HeadError(
            f"{where} was trained with mask token {dflash.get('mask_token_id')}, this drafter "
            f"uses {head.mask_token_id}; set model.mask_token_id {dflash.get('mask_token_id')}"
        )
    with torch.no_grad():
        for name, value in tensors.items():
            state[name].copy_(value)
        if mask is not None:
            head.mask_embedding.copy_(mask[1])
    return len(tensors) + (mask is not None)
