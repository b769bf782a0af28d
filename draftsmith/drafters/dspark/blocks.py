"""DSpark training blocks, laid out as vLLM drafts them (anchor-as-first).

vLLM (``v1/worker/gpu/spec_decode/dflash/speculator.py`` with ``sample_from_anchor``): after a
verification step the target has chosen token ``x_a`` at position ``a``; the drafter's context
is the target's states of every token before ``a``; its query is one block of B slots at
positions ``a .. a + B - 1``: slot 0 holds ``x_a``, slots 1..B-1 the mask token. Slot ``i``
predicts the token at ``a + i + 1`` (B drafts).

Inside packed rows (``drafters/protocol/batch.py``):

- Anchors: response tokens with a token of context before them in their document and a
  response token after them (the first draft has a target). Random ``num_anchors`` per row
  in training, every one in validation (``walk.sample_anchors``).
- Mask (``block_mask``): a slot of the block at ``a`` attends to its document's context keys
  strictly before ``a`` and to every slot of its own block (both directions).
- Targets (``slot_targets``): slot ``i`` predicts position ``p = a + i + 1``; it counts when
  ``p`` is in the row, in the anchor's document, a response token, AND every earlier slot of
  its block counts too: only the valid prefix of a block is scored (vLLM never verifies a
  draft past a position with nothing to verify). Its Markov input, teacher-forced, is the
  TRUE token at ``p - 1``; its teacher is the target's distribution from row ``p - 1``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def slot_targets(
    anchors: Tensor, keep: Tensor, input_ids: Tensor, loss_mask: Tensor, doc_ids: Tensor,
    block_size: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(valid [B, A, bs] bool, prev_row [B, A, bs] long, true_ids [B, A, bs] long).

    Slot i of block j predicts row position ``p = a_j + i + 1``; ``valid``: the valid prefix
    (module docstring); ``prev_row = p - 1`` (clamped into the row): the teacher's row and the
    position of the teacher-forced Markov input; ``true_ids``: the token at ``p`` (0 where
    invalid)."""
    t = loss_mask.shape[1]
    offsets = torch.arange(block_size, device=anchors.device)
    target = anchors[:, :, None] + offsets + 1  # [B, A, bs]
    inside = target < t
    target = target.clamp(max=t - 1)
    flat = target.flatten(1)
    same_doc = doc_ids.gather(1, flat).view_as(target) == doc_ids.gather(1, anchors)[:, :, None]
    scored = loss_mask.bool().gather(1, flat).view_as(target)
    valid = (inside & same_doc & scored & keep[:, :, None]).long().cumprod(-1).bool()
    prev_row = (anchors[:, :, None] + offsets).clamp(max=t - 1)
    true_ids = torch.where(valid, input_ids.gather(1, flat).view_as(target), 0)
    return valid, prev_row, true_ids


def position_weights(block_size: int, gamma: float) -> Tensor:
    """[bs] float: slot i weighs ``exp(-i / gamma)`` (slot 0, the first draft, weighs 1)."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / gamma)
