"""An exported DFlash drafter drafting as vLLM serves it (``Drafter.replica``).

vLLM (``v1/spec_decode/dflash.py``): after the target emitted ``x[t+1]`` the drafter's context
is the target's tapped states of tokens ``0..t`` and its query one block ``[x[t+1], MASK x k]``
at positions ``t+1 .. t+k+1`` (``num_speculative_tokens`` = k mask slots, whatever the trained
block size); mask slot ``j + 1`` drafts ``x[t+j+2]`` through the target's lm_head. A block
attends within itself both ways, so its drafts depend on k: the replica drafts per k.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.dflash.export import NOT_IN_SAFETENSORS, read_mask_embedding
from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.headfiles.directory import HeadError


def read_dflash(head_dir: str | Path) -> tuple[DFlashDrafter, tuple[int, Tensor] | None]:
    """(the drafter, its ``mask_embedding.pt`` as (mask_token_id, embedding [H]) or None) of a
    directory ``export_dflash`` (or another DFlash trainer) wrote for vLLM."""
    from draftsmith.drafters.attention.llama import target_sizes
    from draftsmith.drafters.headfiles.read import check_tensors, read_head_files
    from draftsmith.drafters.headfiles.windows import trained_window

    config, tensors = read_head_files(head_dir)
    dflash = config.get("dflash_config") or {}
    if "target_layer_ids" not in dflash or "mask_token_id" not in dflash:
        raise HeadError(
            f"head: {head_dir}/config.json has no dflash_config.target_layer_ids / "
            "mask_token_id; give a directory exported for vLLM's method dflash"
        )
    sizes = target_sizes(config)
    del sizes["max_position_embeddings"]
    mask = read_mask_embedding(Path(head_dir))
    head = DFlashDrafter(
        **sizes,
        target_hidden_size=config.get("target_hidden_size"),
        target_layer_ids=list(dflash["target_layer_ids"]),
        mask_token_id=int(dflash["mask_token_id"]),
        num_layers=int(config.get("num_hidden_layers", 1)),
        block_size=int(dflash.get("block_size", 8)),
        train_mask_embedding=mask is not None,
        tie_k_norm=False,  # each layer's own k_norm, as the files hold them
        sliding_window=trained_window(config),
    )
    state = {n: v for n, v in head.state_dict().items() if n.split(".")[0] not in
             NOT_IN_SAFETENSORS}  # fmt: skip
    check_tensors("vLLM DFlash", state, tensors)
    head.load_state_dict({n: v.float() for n, v in tensors.items()}, strict=False)
    return head, mask


class DFlashReplica:
    """A :class:`~draftsmith.drafters.protocol.Replica` of an exported DFlash drafter."""

    def __init__(self, head_dir: str, target: TargetInfo) -> None:
        from draftsmith.drafters.target.weights import load_target_weights

        self.head, mask = read_dflash(head_dir)
        weights = load_target_weights(target)
        self.head.set_embeddings(weights.embed)
        if mask is not None:  # vLLM substitutes it for the mask token's row
            if mask[0] != self.head.mask_token_id:
                raise HeadError(
                    f"head: {head_dir}/mask_embedding.pt is for token {mask[0]}, the config's "
                    f"mask_token_id is {self.head.mask_token_id}; re-export the head"
                )
            with torch.no_grad():
                self.head.mask_embedding.copy_(mask[1].float())
        self.head.eval()
        self.lm_head = weights.lm_head
        self.layer_ids = [i + 1 for i in sorted(self.head.target_layer_ids)]

    @torch.no_grad()
    def draft_logits(self, tokens: Tensor, states: Tensor, k: int) -> Iterator[Tensor]:
        """See :class:`~draftsmith.drafters.protocol.Replica`."""
        from draftsmith.drafters.attention.block_layout import block_states

        slots = block_states(self.head, tokens, states, k + 1)  # [L, k + 1, H]
        for j in range(k):
            yield slots[:, j + 1] @ self.lm_head.T
