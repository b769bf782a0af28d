"""What a greedy K-draft chain would have had accepted: training's simulated acceptance.

vLLM verifies draft k only if drafts 0..k-1 were accepted, so the expected accepted length
is ``1 + sum_k prod_{j<=k} acc_j`` over conditional per-step accuracies. Training counts, per
TTT step, the streams still "alive" and those whose draft matched the teacher's greedy token;
counts add up across batches and ranks, so validation can sum them before dividing.
"""

from __future__ import annotations

import torch
from torch import Tensor


def step_validity(loss_mask: Tensor, doc_ids: Tensor, step: int) -> Tensor:
    """[B, T] bool: stream t has a target at step ``step`` (label x_{t+step+2} in t's
    document, inside the row, and ``loss_mask`` true there)."""
    b, t = loss_mask.shape
    shift = step + 2
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    if shift < t:
        same = doc_ids[:, shift:] == doc_ids[:, : t - shift]
        valid[:, : t - shift] = same & loss_mask[:, shift:].bool()
    return valid


def chain_counts(correct: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Per-step counts of a greedy K-draft chain: (seen [K], hit [K]) long.

    correct, valid: bool [K, ...] per step and stream. ``seen[k]`` counts streams whose steps
    0..k-1 were all valid and correct ("alive") and whose step k is valid; ``hit[k]`` those of
    them with step k correct. Counts add up across batches and ranks.
    """
    alive = torch.ones_like(valid[0])
    seen, hit = [], []
    for k in range(valid.shape[0]):
        s = alive & valid[k]
        alive = s & correct[k]
        seen.append(s.sum())
        hit.append(alive.sum())
    return torch.stack(seen), torch.stack(hit)


def acceptance_from_counts(seen: Tensor, hit: Tensor) -> Tensor:
    """``1 + sum_k prod_{j<=k} acc_j`` with ``acc_j = hit[j] / seen[j]`` (conditional: draft k
    is only verified if drafts 0..k-1 were accepted). A step with nothing seen ends the sum."""
    total = torch.ones((), dtype=torch.float32, device=seen.device)
    chain = torch.ones((), dtype=torch.float32, device=seen.device)
    for s, h in zip(seen.tolist(), hit.tolist(), strict=True):
        if s == 0:
            break
        chain = chain * (h / s)
        total = total + chain
    return total


def simulated_acceptance_length(correct: Tensor, valid: Tensor) -> Tensor:
    """Expected accepted length of a greedy K-draft chain over these streams (``chain_counts``)."""
    return acceptance_from_counts(*chain_counts(correct, valid))
