"""An exported EAGLE-3 or P-EAGLE head drafting as vLLM serves it (``Drafter.replica``).

- ``method: eagle3``: draft ``j`` of the chain at stream ``t`` is step ``j`` of training's
  teacher-forced unroll (``ttt.ttt_unroll``): vLLM's draft whenever drafts ``0..j-1`` were
  accepted (its drafter's cache then holds the same real slots).
- ``method: peagle`` (vLLM's ``parallel_drafting``): one pass over the real slots and a block
  of ``k - 1`` mask slots after each stream (``parallel.parallel_forward``), as vLLM drafts.

Logits are the head's draft vocabulary scattered into the target's (-inf elsewhere), as
vLLM's ``Eagle3LlamaForCausalLM.compute_logits`` returns them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from draftsmith.core.targets import TargetInfo

ANCHORS = 128  # P-EAGLE blocks per pass (its mask grows with the square of the slots)


class Eagle3Replica:
    """A :class:`~draftsmith.drafters.protocol.Replica` of an exported EAGLE-3 head."""

    def __init__(self, head_dir: str, method: str, target: TargetInfo) -> None:
        from draftsmith.drafters.eagle3.layouts import fit_to_target, read_head
        from draftsmith.drafters.target.weights import load_target_weights

        self.head, facts = read_head(head_dir, target.config)
        fit_to_target(self.head, facts, target)
        self.head.set_embeddings(load_target_weights(target).embed)
        self.head.eval()
        self.parallel = method == "peagle"
        if self.parallel and self.head.mask_hidden is None:
            raise ValueError(f"{head_dir} has no mask_hidden: not a P-EAGLE head")
        self.layer_ids = sorted(set(facts.layer_ids))  # vLLM feeds them in ascending order
        self.vocab = target.vocab_size

    def to_target(self, states: Tensor) -> Tensor:
        """[L, H] final-normed states -> [L, V_target] logits, -inf outside the draft vocab."""
        logits = states @ self.head.logits_weight.T  # [L, V_draft]
        if logits.shape[-1] == self.vocab:
            return logits
        out = logits.new_full((logits.shape[0], self.vocab), float("-inf"))
        ids = self.head.draft_to_target(torch.arange(logits.shape[-1]))
        out[:, ids] = logits
        return out

    @torch.no_grad()
    def draft_logits(self, tokens: Tensor, states: Tensor, k: int) -> Iterator[Tensor]:
        """See :class:`~draftsmith.drafters.protocol.Replica`."""
        from draftsmith.drafters.attention.ttt import ttt_unroll

        n = tokens.numel()
        aux = states.reshape(1, n, -1)  # [1, L, n_aux * H_target], ascending ids
        positions = torch.arange(n)[None]
        if not self.parallel or k == 1:  # P-EAGLE's first draft is the serial head's
            steps = ttt_unroll(self.head, tokens[None], aux, positions, torch.zeros_like(positions),
                               k, window=self.head.sliding_window)  # fmt: skip
            for s in steps:
                yield self.to_target(s[0])
            return
        drafts = self.parallel_states(tokens, aux, k)  # [L, k, H]
        for j in range(k):
            yield self.to_target(drafts[:, j])

    def parallel_states(self, tokens: Tensor, aux: Tensor, k: int) -> Tensor:
        """[L, k, H]: the real slot of each stream (draft 0), then its block's mask slots."""
        from draftsmith.drafters.eagle3.parallel import parallel_forward

        n = tokens.numel()
        batch = {
            "input_ids": tokens[None],
            "position_ids": torch.arange(n)[None],
            "doc_ids": torch.zeros(1, n, dtype=torch.long),
            "aux_states": aux,
        }
        out = torch.empty(n, k, self.head.init_kwargs["hidden_size"])
        for lo in range(0, n, ANCHORS):
            anchors = torch.arange(lo, min(lo + ANCHORS, n))[None]  # the streams t
            states = parallel_forward(self.head, batch, anchors, torch.ones_like(anchors,
                                      dtype=torch.bool), k)[0]  # fmt: skip
            out[:, 0] = states[:n]  # real slot t drafts x[t+2]
            blocks = states[n:].view(anchors.shape[1], k - 1, -1)
            out[anchors[0], 1:] = blocks  # mask slot i of the block at t drafts x[t+2+i]
        return out
