"""DFlash training blocks: anchors, the block attention mask, slot targets, the loss.

How vLLM drafts (``v1/spec_decode/dflash.py``): after a verification step the target has
chosen token ``x_a`` (the "bonus" token) at position ``a``; the drafter's context is the
target's states of every token before ``a``, and its query is one block of B slots at
positions ``a .. a + B - 1``: slot 0 holds ``x_a``, slots 1..B-1 the mask token. Slot ``i``'s
output through the target's lm_head is the draft for the token at position ``a + i``;
``num_speculative_tokens`` = B - 1 drafts, verified greedily left to right.

Training builds the same blocks inside packed rows (batch keys: ``drafters/protocol/batch.py``):

- Anchors: positions ``a`` whose token is a response token (``loss_mask``), with at least one
  token of context before it in its document and a response token after it. At most
  ``num_anchors`` per row, drawn at random without replacement (``sample_anchors``).
- Mask (``block_mask``): a slot of the block at anchor ``a`` attends to the context keys of its
  own document strictly before ``a`` and to every slot of its own block (both directions);
  never to another block. A plain boolean [B, 1, Q, T + Q] mask for SDPA (true = attend).
- Targets: slot ``i`` >= 1 predicts the token at ``a + i`` when that position is in the row,
  in the anchor's document and a response token. Its teacher is the target's own next-token
  distribution there, ``softmax(lm_head(final_norm(h_N[a + i - 1])))``, as for EAGLE heads.
- Loss: soft cross-entropy against the teacher, slot ``i`` weighted
  ``w_i = exp(-(i - 1) / gamma)`` (slot 1 weighs 1; a later slot only counts when all before
  it were accepted, so it matters less), normalised over the valid slots of the batch:
  ``loss = sum_s w_i(s) * CE_s / sum_s w_i(s)`` (``slot_weights``).
- Simulated acceptance: a block's drafts are accepted up to the first slot whose argmax
  differs from the teacher's (full vocabulary, the same lm_head); counted with
  ``acceptance.chain_counts`` like the EAGLE heads' validation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.drafters.losses.acceptance import chain_counts
from draftsmith.drafters.losses.fused_loss import FusedMode
from draftsmith.drafters.losses.loss import TTTLoss, draft_loss, loss_record


def default_gamma(block_size: int) -> float:
    """The decay the DFlash paper pairs with a block size: 7 for 16, 5 for 10, 4 for 8."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


def slot_weights(block_size: int, gamma: float) -> Tensor:
    """[B] float: 0 for slot 0 (the anchor, given), ``exp(-(i - 1) / gamma)`` for slot i."""
    i = torch.arange(block_size, dtype=torch.float32)
    return torch.where(i > 0, torch.exp(-(i - 1) / gamma), torch.zeros(()))


def slot_validity(
    anchors: Tensor, keep: Tensor, loss_mask: Tensor, doc_ids: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """(valid [B, A, bs] bool, target [B, A, bs] long): slot i of block j has a target at row
    position ``target = a_j + i`` (clamped into the row) when ``valid``; slot 0 never does."""
    t = loss_mask.shape[1]
    target = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # [B, A, bs]
    inside = target < t
    target = target.clamp(max=t - 1)
    flat = target.flatten(1)
    same_doc = doc_ids.gather(1, flat).view_as(target) == doc_ids.gather(1, anchors)[:, :, None]
    scored = loss_mask.bool().gather(1, flat).view_as(target)
    valid = inside & same_doc & scored & keep[:, :, None]
    valid[:, :, 0] = False
    return valid, target


def block_loss(
    drafts: Tensor,
    lm_head: Tensor,
    teacher_states: Tensor,
    valid: Tensor,
    target: Tensor,
    gamma: float,
    chunk_size: int = 1024,
    teacher_cache: int = 2**28,
    fused: FusedMode = "auto",
) -> tuple[TTTLoss, Tensor]:
    """Weighted soft cross-entropy, per-slot metrics and simulated acceptance of the blocks.

    Args:
        drafts: [B, A * bs, H] the drafter's final-normed slot states.
        lm_head: [V, H] the target's (frozen) lm_head, shared by draft and teacher.
        teacher_states: [B, T, H] final-normed target states; row p predicts x_{p+1}.
        valid, target: from ``slot_validity`` ([B, A, bs]).
        gamma: the decay of ``slot_weights``.
        fused: ``model.fused_loss`` (``loss.draft_loss``).
    Returns: (a ``TTTLoss`` whose "steps" are the slots 1..bs-1, ``correct`` [B, A, bs - 1]
    bool: slot i + 1's draft is valid and equals the teacher's argmax).
    """
    b, a, bs = valid.shape
    t = teacher_states.shape[1]
    rows = torch.arange(b, device=valid.device)[:, None, None] * t + target - 1  # teacher row
    slots = torch.arange(b * a * bs, device=valid.device).view(b, a, bs)
    flat_states = drafts.reshape(b * a * bs, -1)
    teacher, loss_fn = draft_loss(
        fused, drafts, teacher_states.reshape(b * t, -1), lm_head, rows[valid].unique(),
        chunk_size, teacher_cache,
    )  # fmt: skip
    weights = slot_weights(bs, gamma).to(drafts.device)
    counts = valid.sum((0, 1))  # [bs]
    norm = max(float((counts * weights).sum()), 1e-12)
    need_grad = (torch.is_grad_enabled() and drafts.requires_grad, False)
    total = drafts.new_zeros((), dtype=torch.float32)
    losses, accs, corrects = [], [], []
    for i in range(1, bs):
        v = valid[:, :, i]
        n = max(int(counts[i]), 1)
        w = torch.full((int(counts[i]),), 1.0 / n, device=drafts.device)
        loss_i, draft_top1, teacher_top1 = loss_fn.apply(
            flat_states, lm_head, teacher, slots[:, :, i][v], rows[:, :, i][v], w,
            chunk_size, need_grad,
        )  # fmt: skip
        correct = torch.zeros_like(v)
        correct[v] = draft_top1 == teacher_top1
        total = total + float(counts[i] * weights[i]) / norm * loss_i
        losses.append(loss_i.detach())
        accs.append(correct.sum() / n)
        corrects.append(correct.flatten())
    step_valid = valid[:, :, 1:].permute(2, 0, 1).flatten(1)  # [bs - 1, B * A]
    correct = torch.stack(corrects)  # [bs - 1, B * A]
    seen, hit = chain_counts(correct, step_valid)
    out = loss_record(total, losses, accs, counts[1:], seen, hit)
    return out, correct.T.reshape(b, a, bs - 1)
