"""P-EAGLE: an EAGLE-3 head that drafts all k tokens in one pass (``model.parallel_drafting``).

How vLLM 0.32 drafts with it (``speculative_config.parallel_drafting``; ``llm_base_proposer``
and ``copy_and_expand_eagle_inputs_kernel``): after a verification step whose last processed
token is at position ``a`` and whose bonus token is ``x_{a+1}``, one draft pass runs over

- the usual EAGLE-3 slots: slot ``a`` holds ``(fc(h_a), embed(x_{a+1}))`` at position ``a``
  and drafts ``x_{a+2}`` (the first draft, as in autoregressive EAGLE-3);
- ``k - 1`` mask slots at positions ``a + 1 .. a + k - 1``, each holding
  ``(fc(mask_hidden), embed(mask_token_id))``; mask slot ``i`` drafts ``x_{a+2+i}``.

Attention is causal: a mask slot sees the real slots up to ``a`` and the mask slots before
it. All k drafts come from that one pass, so drafting costs one forward instead of k.

Training builds the same thing inside packed rows (batch keys: ``drafters/protocol/batch.py``):
every real slot of the row (draft 0 at every position, exactly EAGLE-3's first TTT step) plus,
for up to ``num_anchors`` random anchors per row, a block of ``k - 1`` mask slots appended after the
row. ``parallel_mask`` lets a block see its anchor's document up to the anchor and its own
earlier slots, nothing else. Draft ``i``'s loss weighs ``loss_decay ** i``, as TTT's steps.

Validation drafts a block at every position and walks each response the way vLLM does
(``walk.served_walk``: the next block starts after the accepted drafts and the
target's own token), so its acceptance is the served one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.drafters.attention.blockwise import prefix_attention
from draftsmith.drafters.attention.layers import sdpa_attend
from draftsmith.drafters.attention.ttt import LONG_ROW, document_causal_mask, shift_tokens
from draftsmith.drafters.eagle3.head import Eagle3Head
from draftsmith.drafters.eagle3.options import Eagle3Options
from draftsmith.drafters.eagle3.parallel_mask import ParallelMask
from draftsmith.drafters.losses.acceptance import chain_counts, step_validity
from draftsmith.drafters.losses.loss import (
    TTTLoss,
    draft_loss,
    loss_record,
    merge_records,
    teacher_argmax,
)
from draftsmith.drafters.losses.walk import accepted_lengths, sample_anchors, served_walk
from draftsmith.drafters.protocol import Trainee
from draftsmith.drafters.protocol.batch import Batch


def parallel_mask(
    anchors: Tensor, keep: Tensor, doc_ids: Tensor, num_masks: int, window: int | None = None
) -> Tensor:
    """[B, 1, T + Q, T + Q] bool (true = attend), Q = A * num_masks.

    Real slots: causal inside their document. Mask slot i of the block at anchor ``a_j``
    (position ``a_j + 1 + i``): the real slots ``t <= a_j`` of ``a_j``'s document and the
    block's slots ``0 .. i``. A sliding ``window`` keeps the keys at most ``window - 1``
    positions behind each query. anchors, keep: [B, A] from ``sample_anchors``.
    """
    b, a = anchors.shape
    t = doc_ids.shape[1]
    q = a * num_masks
    real = document_causal_mask(doc_ids, window)[:, 0]
    real = torch.cat([real, doc_ids.new_zeros(b, t, q).bool()], -1)
    anchor_doc = doc_ids.gather(1, anchors)  # [B, A]
    cols = torch.arange(t, device=anchors.device)
    ctx = (doc_ids[:, None, :] == anchor_doc[:, :, None]) & (cols <= anchors[:, :, None])
    ctx = (ctx & keep[:, :, None]).repeat_interleave(num_masks, dim=1)  # [B, Q, T]
    block = torch.arange(a, device=anchors.device).repeat_interleave(num_masks)  # [Q]
    slot = torch.arange(num_masks, device=anchors.device).repeat(a)  # [Q]
    own = (block[:, None] == block[None, :]) & (slot[None, :] <= slot[:, None])  # [Q, Q]
    if window is not None:  # slot i sits at a + 1 + i: keys t >= a + 2 + i - window
        lowest = anchors.repeat_interleave(num_masks, dim=1) + 2 + slot - window  # [B, Q]
        ctx = ctx & (cols >= lowest[..., None])
        own = own & (slot[:, None] - slot[None, :] <= window - 1)
    masks = torch.cat([ctx, own.expand(b, -1, -1)], dim=-1)  # [B, Q, T + Q]
    return torch.cat([real, masks], dim=1)[:, None]


def parallel_targets(
    anchors: Tensor, keep: Tensor, loss_mask: Tensor, doc_ids: Tensor, num_drafts: int
) -> tuple[Tensor, Tensor]:
    """(valid [B, A, K] bool, position [B, A, K] long): draft i of the block at ``a`` is the
    token at ``a + 2 + i``; valid when that is inside the row, in ``a``'s document and a
    response token (``position`` is clamped into the row)."""
    t = loss_mask.shape[1]
    pos = anchors[:, :, None] + 2 + torch.arange(num_drafts, device=anchors.device)
    inside = pos < t
    pos = pos.clamp(max=t - 1)
    flat = pos.flatten(1)
    same = doc_ids.gather(1, flat).view_as(pos) == doc_ids.gather(1, anchors)[:, :, None]
    scored = loss_mask.bool().gather(1, flat).view_as(pos)
    return inside & same & scored & keep[:, :, None], pos


def parallel_forward(
    head: Eagle3Head,
    batch: dict[str, Tensor],
    anchors: Tensor,
    keep: Tensor,
    num_drafts: int,
    pad_id: int = 0,
    attention: str = "auto",
) -> Tensor:
    """One draft pass over the real slots and a mask block per anchor.

    Returns [B, T + A * (K - 1), H] final-normed states: rows ``0..T-1`` are the real slots
    (slot t drafts x_{t+2}), then block j's mask slots in order (module docstring).
    ``attention`` (``model.attention``): ``blockwise``, and ``auto`` from ``ttt.LONG_ROW``
    tokens on, computes the mask per query block (``parallel_mask.ParallelMask``: memory
    linear in the row); otherwise SDPA with the whole [T + Q, T + Q] mask.
    """
    ids, pos, docs = batch["input_ids"], batch["position_ids"], batch["doc_ids"]
    b, a = anchors.shape
    m = num_drafts - 1
    real = head.combine_hidden_states(batch["aux_states"])  # [B, T, H]
    masked = head.combine_hidden_states(head.mask_hidden.to(real.dtype)[None, None])  # [1,1,H]
    mask_pos = pos.gather(1, anchors)[:, :, None] + torch.arange(1, m + 1, device=pos.device)
    mask_ids = torch.full((b, a * m), head.mask_token_id, dtype=ids.dtype, device=ids.device)
    all_ids = torch.cat([shift_tokens(ids, docs, 1, pad_id), mask_ids], dim=1)  # [B, T + Q]
    hidden = torch.cat([real, masked.expand(b, a * m, -1)], dim=1)  # [B, T + Q, H]
    positions = torch.cat([pos, mask_pos.view(b, -1)], dim=1)
    window = head.sliding_window
    if attention == "blockwise" or (attention == "auto" and ids.shape[1] >= LONG_ROW):
        blocks = ParallelMask(anchors, keep, docs, m, window)

        def attend(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return prefix_attention(q, k, v, blocks)[0]
    else:
        attend = sdpa_attend(parallel_mask(anchors, keep, docs, m, window))
    return head(all_ids, hidden, positions, attend)[0]


def parallel_drafting_loss(
    trainee: Trainee, opt: Eagle3Options, batch: Batch
) -> tuple[Tensor, TTTLoss]:
    """Training: draft 0 at every position plus ``num_anchors`` mask blocks per row; the
    acceptance logged is the chain over those anchors. Validation: a block at every
    position (``num_anchors`` blocks per pass) and the served walk's acceptance."""
    head = trainee.head
    k = opt.ttt_steps
    teacher_states = trainee.teacher(batch)
    ids = head.draft_to_target(torch.arange(head.draft_vocab_size, device=trainee.device))
    teacher_weight = trainee.target_lm_head[ids]
    top1 = None
    if not trainee.training:  # judged as vLLM does: the target's argmax over every id
        top1 = teacher_argmax(
            teacher_states, trainee.target_lm_head, head.target_to_draft_index(),
            opt.loss_chunk_size,
        )  # fmt: skip
    cand = step_validity(batch["loss_mask"], batch["doc_ids"], 0)  # draft 0 has a target
    if trainee.training:
        anchors, keep = sample_anchors(cand, opt.num_anchors)
        return parallel_loss(head, opt, batch, teacher_states, teacher_weight, top1, anchors, keep)
    anchors, keep = sample_anchors(cand, cand.shape[1])  # every position, ascending
    accepted = torch.zeros_like(batch["input_ids"])  # [B, T]: by the bonus token's position
    parts = []
    for start in range(0, anchors.shape[1], opt.num_anchors):
        chunk = slice(start, start + opt.num_anchors)
        a, kp = anchors[:, chunk], keep[:, chunk]
        loss, out, correct = parallel_loss(
            head, opt, batch, teacher_states, teacher_weight, top1, a, kp, with_correct=True
        )
        lengths = accepted_lengths(correct) * kp  # [B, A]
        # add: each position appears once, and unused slots (anchor 0, length 0) add nothing
        accepted.scatter_add_(1, (a + 1).clamp(max=accepted.shape[1] - 1), lengths)
        parts.append(out)
    seen, hit = served_walk(accepted, batch["loss_mask"], batch["doc_ids"], k)
    return merge_records(parts, seen, hit)


def parallel_loss(
    head: Eagle3Head,
    opt: Eagle3Options,
    batch: Batch,
    teacher_states: Tensor,
    teacher_weight: Tensor,
    top1: Tensor | None,
    anchors: Tensor,
    keep: Tensor,
    with_correct: bool = False,
):
    """Loss and metrics of one pass (``parallel_forward``) over ``anchors`` [B, A].

    Draft 0 is scored at every real slot with a target; drafts 1..K-1 at the anchors' mask
    slots. Returns (loss, ``TTTLoss`` over the anchors' chains) and, with ``with_correct``,
    ``correct`` [B, A, K] bool: draft i of block j is valid and equals the teacher's argmax.
    """
    num_drafts = opt.ttt_steps
    b, t = batch["input_ids"].shape
    a, m = anchors.shape[1], num_drafts - 1
    dev = anchors.device
    states = parallel_forward(head, batch, anchors, keep, num_drafts, attention=opt.attention)
    width = states.shape[1]
    valid, pos = parallel_targets(anchors, keep, batch["loss_mask"], batch["doc_ids"], num_drafts)
    row = torch.arange(b, device=dev)[:, None]  # [B, 1]
    # Draft 0 at every real slot t with a target (teacher row t + 1 predicts x_{t+2}).
    real_valid = step_validity(batch["loss_mask"], batch["doc_ids"], 0)  # [B, T]
    real_t = torch.arange(t, device=dev).expand(b, t)
    scored = [((row * width + real_t)[real_valid], (row * t + real_t)[real_valid] + 1)]
    # Draft i >= 1 at mask slot (j, i - 1) of block j (teacher row p - 1 predicts x_p).
    mask_slot = t + torch.arange(a * m, device=dev).view(1, a, m)  # [1, A, m]
    for i in range(1, num_drafts):
        v = valid[:, :, i]
        draft_rows = (row * width + mask_slot[:, :, i - 1])[v]
        scored.append((draft_rows, (row * t + pos[:, :, i] - 1)[v]))
    teacher, loss_fn = draft_loss(
        opt.fused_loss,
        states,
        teacher_states.reshape(b * t, -1),
        teacher_weight,
        torch.cat([rows for _, rows in scored]).unique(),
        opt.loss_chunk_size,
    )
    grad = (torch.is_grad_enabled() and states.requires_grad, False)
    flat = states.reshape(b * width, -1)
    total = flat.new_zeros((), dtype=torch.float32)
    losses, accs, counts = [], [], []
    correct = torch.zeros_like(valid)  # [B, A, K]
    for i, (d_idx, t_idx) in enumerate(scored):
        n = max(d_idx.numel(), 1)
        w = torch.full((d_idx.numel(),), 1.0 / n, device=dev)
        loss_i, draft_top1, teacher_top1 = loss_fn.apply(
            flat, head.logits_weight, teacher, d_idx, t_idx, w, opt.loss_chunk_size, grad
        )
        if top1 is not None:
            teacher_top1 = top1.reshape(-1)[t_idx]
        hit = draft_top1 == teacher_top1
        if i == 0:  # the anchors' draft 0 is their real slot's
            at = torch.zeros(b, t, dtype=torch.bool, device=dev)
            at[real_valid] = hit
            correct[:, :, 0] = at.gather(1, anchors) & valid[:, :, 0]
        else:
            correct[:, :, i][valid[:, :, i]] = hit
        total = total + opt.loss_decay**i * loss_i
        losses.append(loss_i.detach())
        accs.append(hit.sum() / n)
        counts.append(d_idx.numel())
    seen, hits = chain_counts(correct.permute(2, 0, 1), valid.permute(2, 0, 1))
    out = loss_record(total, losses, accs, counts, seen, hits)
    return (total, out, correct) if with_correct else (total, out)
