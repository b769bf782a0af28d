"""An exported DFlash2 drafter drafting as vLLM serves it (``Drafter.replica``).

vLLM 0.32 (``v1/worker/gpu/spec_decode/dflash2/speculator.py``): the block is DFlash's,
``[x[t+1], MASK x k]`` after the target emitted ``x[t+1]``, its context the target's tapped
states of tokens ``0..t``. Mask slot ``j + 1`` proposes ``x[t+j+2]`` among its top-K candidates
of ``lm_head(h)``, scored by the selector given the token chosen before it: the anchor for slot
1, then the previous draft. While drafts ``0..j-1`` were accepted they are the served tokens, so
the predecessor is ``x[t+j+1]``, and the draft logits are the selector's scores at the K
candidates, -inf elsewhere (``objective.draft_logits``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.dflash2.export import read_vllm
from draftsmith.drafters.dflash2.objective import draft_logits


class DFlash2Replica:
    """A :class:`~draftsmith.drafters.protocol.Replica` of an exported DFlash2 drafter."""

    def __init__(self, head_dir: str, target: TargetInfo) -> None:
        from draftsmith.drafters.target.weights import load_target_weights

        self.head = read_vllm(head_dir).float().eval()
        weights = load_target_weights(target)
        self.head.set_embeddings(weights.embed)
        self.lm_head = weights.lm_head
        self.layer_ids = [i + 1 for i in sorted(self.head.target_layer_ids)]

    @torch.no_grad()
    def draft_logits(self, tokens: Tensor, states: Tensor, k: int) -> Iterator[Tensor]:
        """See :class:`~draftsmith.drafters.protocol.Replica`."""
        from draftsmith.drafters.attention.block_layout import block_states

        slots = block_states(self.head, tokens, states, k + 1)  # [L, k + 1, H]
        n = tokens.numel()
        for j in range(k):
            prev = tokens[(torch.arange(n) + j + 1).clamp(max=n - 1)]  # x[t+j+1]
            yield draft_logits(self.head, self.lm_head, slots[:, j + 1], prev)
