"""DFlash2's low-rank candidate selector (vLLM 0.32's ``CandidateSelector``).

A slot's candidates are the top-K ids of its unary logits ``lm_head(h)`` (the target's
lm_head, vLLM's ``compute_candidates``; K = ``selector_top_k``). A transition from a
predecessor token ``p`` to a candidate ``c`` at a slot with final-normed state ``h`` scores::

    S(p, c) = unary(c) + < A[p] * (W h), B[c] >

with ``A = predecessor_codebook`` [V, r], ``B = successor_codebook`` [V, r] and
``W = hidden_projection`` [r, H] (r = ``selector_rank``). vLLM walks it from the anchor:
slot 1's predecessor is the anchor (the verified token), slot i's the candidate chosen at
slot i - 1 (``_score_edges`` and ``_selector_walk_kernel`` in
``v1/worker/gpu/spec_decode/dflash2/speculator.py``).

Start: both codebooks and ``W`` normal(0, 0.02), as speculators #1006 starts them, so the
transition term starts near zero and the walk near DFlash's per-slot argmax.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class CandidateSelector(nn.Module):
    """``S(p, c)`` over each slot's K candidates (module docstring)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        for weight in (self.predecessor_codebook, self.successor_codebook,
                       self.hidden_projection.weight):  # fmt: skip
            nn.init.normal_(weight, std=0.02)

    def forward(self, unary: Tensor, hidden: Tensor, predecessors: Tensor,
                candidates: Tensor) -> Tensor:  # fmt: skip
        """Transition scores of each predecessor to each candidate.

        Args: unary [..., K] (the candidates' logits), hidden [..., H] (the slot's state),
        predecessors [..., P] long, candidates [..., K] long.
        Returns: S [..., P, K].
        """
        context = (
            self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)[..., None, :]
        )  # [..., P, r]
        successors = self.successor_codebook[candidates]  # [..., K, r]
        return unary[..., None, :] + context @ successors.transpose(-1, -2)


def top_candidates(hidden: Tensor, lm_head: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(candidates [..., K] long, unary [..., K]): the top-K ids of ``hidden @ lm_head.T``
    (hidden [..., H], lm_head [V, H]), highest first, and their logits."""
    logits = hidden @ lm_head.T
    unary, ids = logits.topk(k, dim=-1)
    return ids, unary


def with_gold(candidates: Tensor, gold: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The training candidate set: (candidates [..., K], label [...] long: the gold token's
    place in them, contains [...] bool: gold was among the served top-K).

    Where ``gold`` [...] is missing it replaces the weakest (last) candidate, as speculators'
    ``selector_training_candidates`` and SpecForge #772 do, so every slot has a K-way label."""
    hits = candidates == gold[..., None]
    contains = hits.any(-1)
    k = candidates.shape[-1]
    label = torch.where(contains, hits.long().argmax(-1), torch.full_like(gold, k - 1))
    out = candidates.clone()
    out[..., -1] = torch.where(contains, candidates[..., -1], gold)
    return out, label, contains
