"""Walking a response as vLLM drafts it, and the anchors that walk needs.

Every drafter kind validates the same way: it computes, for each position a draft could
start at, how many drafts vLLM would accept there (``accepted_lengths`` of its per-draft
matches), then ``served_walk`` follows one response the way vLLM does: a chain of drafts, then
the next chain after the accepted ones and the target's own token. Its counts give the
acceptance length vLLM reports (``acceptance.acceptance_from_counts``).

Kinds that draft a block per anchor (DFlash, DSpark, P-EAGLE) train on random anchors per
row (``sample_anchors``) and validate with a block at every position. DFlash and DSpark also
walk at temperature 1 (``rejection_step``, logged by ``log_sampled``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from draftsmith.drafters.losses.acceptance import acceptance_from_counts


def sample_anchors(
    candidates: Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Up to ``num_anchors`` candidate positions per row, at random, ascending.

    candidates [B, T] bool -> (anchors [B, A] long, keep [B, A] bool), A = the most any row
    got; a row with fewer fills its tail with position 0 and ``keep`` false.
    """
    b, t = candidates.shape
    scores = torch.rand(b, t, generator=generator, device="cpu").to(candidates.device)
    scores = torch.where(candidates, scores, torch.full_like(scores, -1.0))
    a = max(1, min(num_anchors, int(candidates.sum(1).max())))
    top = scores.topk(a, dim=1)
    keep = top.values >= 0
    anchors = torch.where(keep, top.indices, torch.full_like(top.indices, t))
    anchors, order = anchors.sort(dim=1)  # ascending; the unused (t) last
    keep = keep.gather(1, order)
    return torch.where(keep, anchors, torch.zeros_like(anchors)), keep


def accepted_lengths(correct: Tensor) -> Tensor:
    """[..., K] bool per draft -> [...] long: drafts accepted, left to right (greedy)."""
    return correct.long().cumprod(-1).sum(-1)


def served_walk(
    accepted: Tensor, loss_mask: Tensor, doc_ids: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    """Walk each response the way vLLM drafts it; (seen [k], hit [k]) for
    ``acceptance_from_counts`` (exact: ``1 + sum_j hit[j] / seen[0]``).

    The first block is anchored at the response's first token (the target's first choice
    after the prompt); a block at ``a`` that has ``m`` drafts accepted is followed by one at
    ``a + m + 1`` (the target's own token after the accepted ones), until the response ends.
    accepted [B, T] long: the accepted length of a block anchored at each position (needed
    wherever the walk lands: every response token with a response token after it).
    """
    hit = [0] * k
    drafts = 0
    mask, docs, acc = loss_mask.bool().tolist(), doc_ids.tolist(), accepted.tolist()
    for row_mask, row_doc, row_acc in zip(mask, docs, acc, strict=True):
        t = len(row_mask)
        for start in range(t):
            first = row_mask[start] and (
                start == 0 or not row_mask[start - 1] or row_doc[start - 1] != row_doc[start]
            )
            a = start if first else t
            while a + 1 < t and row_mask[a + 1] and row_doc[a + 1] == row_doc[a]:
                m = row_acc[a]
                drafts += 1
                for j in range(m):
                    hit[j] += 1
                a += m + 1
    hits = torch.tensor(hit, dtype=torch.long)
    seen = torch.cat([torch.tensor([drafts]), hits[:-1]])
    return seen, hits


def rejection_step(
    logits: Tensor, t_logits: Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """One draft position as vLLM verifies it: (draft [...] long, accepted [...] bool).

    logits, t_logits [..., V] (the drafter's and the target's). Temperature 0: the draft is
    the argmax, accepted when it is the target's argmax. Otherwise the draft is sampled from
    q = softmax(logits / T) and accepted with probability ``min(1, p / q)`` (rejection
    sampling, one draw of ``generator`` each).
    """
    if temperature == 0:
        draft = logits.argmax(-1)
        return draft, draft == t_logits.argmax(-1)
    q = (logits.float() / temperature).softmax(-1)
    p = (t_logits.float() / temperature).softmax(-1)
    flat = q.reshape(-1, q.shape[-1])
    draft = torch.multinomial(flat, 1, generator=generator).view(q.shape[:-1])
    ratio = (p.gather(-1, draft[..., None]) / q.gather(-1, draft[..., None])).squeeze(-1)
    device = generator.device if generator is not None else q.device
    u = torch.rand(ratio.shape, generator=generator, device=device).to(ratio.device)
    return draft, u < ratio.clamp(max=1.0)


SAMPLED_METRIC = "val/acceptance_length_t1"


class WalkAcceptance(Metric):
    """Served-walk counts summed over an epoch (and ranks) -> vLLM's acceptance length."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.add_state("seen", torch.zeros(k, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("hit", torch.zeros(k, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, seen: Tensor, hit: Tensor) -> None:
        self.seen += seen.to(self.seen.device)
        self.hit += hit.to(self.hit.device)

    def compute(self) -> Tensor:
        return acceptance_from_counts(self.seen, self.hit)


def log_sampled(trainee: Any, seen: Tensor, hit: Tensor) -> None:
    """Log the temperature-1 walk's acceptance length as ``SAMPLED_METRIC`` (summed counts
    over the epoch, like the loop's greedy ``val/acceptance_length``); a trainee that cannot
    log (a bare test object) is skipped. The metric module is added on first use, so a kind
    without a sampled walk logs nothing."""
    if not hasattr(trainee, "log"):
        return
    if not hasattr(trainee, "walk_t1"):
        trainee.add_module("walk_t1", WalkAcceptance(len(seen)).to(trainee.device))
    trainee.walk_t1.update(seen, hit)
    trainee.log(SAMPLED_METRIC, trainee.walk_t1, on_step=False, on_epoch=True,
                metric_attribute="walk_t1")  # fmt: skip
