"""An exported EAGLE-1 head drafting as vLLM serves it (``Drafter.replica``).

vLLM's ``method: eagle`` feeds the head the target's final state after its final norm and the
next token's embedding; each later step feeds the head's own output back, and the target's
lm_head turns every output into logits. Draft ``j`` of the chain at stream ``t`` is step ``j``
of training's teacher-forced unroll (``ttt.ttt_unroll``), as for EAGLE-3.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from draftsmith.core.targets import TargetInfo


class Eagle1Replica:
    """A :class:`~draftsmith.drafters.protocol.Replica` of an exported EAGLE-1 head."""

    def __init__(self, head_dir: str, target: TargetInfo) -> None:
        from draftsmith.drafters.eagle1.layouts import fit_eagle1, read_eagle1
        from draftsmith.drafters.headfiles.read import read_head_files
        from draftsmith.drafters.target.weights import load_target_weights

        self.head, facts = read_eagle1(head_dir, read_head_files(head_dir))
        fit_eagle1(self.head, facts, target)
        weights = load_target_weights(target)
        self.head.set_embeddings(weights.embed)
        self.head.set_lm_head(weights.lm_head)
        self.head.eval()
        self.norm, self.eps = weights.norm.float(), weights.norm_eps
        self.layer_ids = [target.num_hidden_layers]  # the last layer's output, normed here

    @torch.no_grad()
    def draft_logits(self, tokens: Tensor, states: Tensor, k: int) -> Iterator[Tensor]:
        """See :class:`~draftsmith.drafters.protocol.Replica`."""
        from draftsmith.drafters.attention.ttt import ttt_unroll

        x = states[:, 0].float()  # [L, H]
        final = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        positions = torch.arange(tokens.numel())[None]
        steps = ttt_unroll(self.head, tokens[None], final[None], positions,
                           torch.zeros_like(positions), k)  # fmt: skip
        for s in steps:
            yield s[0] @ self.head.logits_weight.T
