"""DSpark's objective and its validation walk.

Training: random anchors per row, one parallel pass, then per valid slot (the valid prefix of
each block, ``blocks.slot_targets``) with the Markov input teacher-forced (the TRUE previous
token), three terms, each a weighted mean with slot i weighing ``exp(-i / gamma)``
(``options.py`` says where each default comes from)::

    loss = ce_w * CE(logits, true token) + tv_w * TV(softmax(logits), p_target)
           + conf_w * BCE(confidence logit, 1 - TV)      (the target 1 - TV is detached)

where ``logits = lm_head(h_i) + markov_w2(markov_w1(prev_i))`` and ``p_target`` is the
target's own next-token distribution at that position. Logits exist for ``loss_chunk_size``
slots at a time (each chunk recomputed in backward: ``torch.utils.checkpoint``).

Validation walks each response as vLLM drafts it (``DSparkSpeculator._sample_sequential``):
a block at every candidate anchor, the parallel pass, then slot by slot the Markov bias of
the previous DRAFTED token (slot 0: the anchor). At temperature 0 a draft is the argmax and is
accepted while it equals the target's argmax; at temperature 1 it is sampled and accepted with
probability ``min(1, p / q)`` (rejection sampling, one seeded draw). ``walk.served_walk``
turns the accepted lengths into vLLM's acceptance length: T = 0 is the loop's
``val/acceptance_length``, T = 1 is logged as ``val/acceptance_length_t1`` by
``walk.log_sampled`` (summed counts over the epoch, like the loop's own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from draftsmith.drafters.attention.block_layout import anchor_candidates, block_inputs, block_mask
from draftsmith.drafters.dspark.blocks import (
    position_weights,
    slot_targets,
)
from draftsmith.drafters.dspark.model import DSparkDrafter
from draftsmith.drafters.dspark.options import DSparkOptions
from draftsmith.drafters.losses.acceptance import chain_counts
from draftsmith.drafters.losses.loss import TTTLoss, loss_record, merge_records
from draftsmith.drafters.losses.walk import log_sampled, rejection_step, sample_anchors, served_walk
from draftsmith.drafters.protocol import Trainee
from draftsmith.drafters.protocol.batch import Batch


def _chunk_terms(head: DSparkDrafter, lm_head: Tensor, h: Tensor, prev: Tensor, true: Tensor,
                 teacher_h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """n slots -> (CE [n], TV [n], draft argmax [n], target argmax [n])."""
    logits = head.logits(h, prev, lm_head).float()  # [n, V]
    with torch.no_grad():
        t_logits = (teacher_h @ lm_head.T).float()
        target = t_logits.softmax(-1)
    ce = F.cross_entropy(logits, true, reduction="none")
    tv = 0.5 * (logits.softmax(-1) - target).abs().sum(-1)
    return ce, tv, logits.argmax(-1), t_logits.argmax(-1)


def block_objective(head: DSparkDrafter, lm_head: Tensor, states: Tensor, teacher: Tensor,
                    input_ids: Tensor, valid: Tensor, prev_row: Tensor, true_ids: Tensor,
                    opt: DSparkOptions) -> tuple[TTTLoss, Tensor]:  # fmt: skip
    """The weighted three-term loss of the blocks (module docstring).

    Args:
        states: [B, A, bs, H] the drafter's final-normed slot states.
        teacher: [B, T, H] the target's final-normed states (row p predicts token p + 1).
        input_ids: [B, T]; valid, prev_row, true_ids: ``blocks.slot_targets`` ([B, A, bs]).
    Returns: (the record, its "steps" the bs slots; ``correct`` [B, A, bs] bool: a valid
    slot whose teacher-forced draft equals the target's argmax).
    """
    b, a, bs = valid.shape
    t = teacher.shape[1]
    slot = torch.arange(bs, device=valid.device).expand(b, a, bs)[valid]  # [n]
    h = states[valid]  # [n, H]
    prev = input_ids.gather(1, prev_row.flatten(1)).view_as(prev_row)[valid]  # teacher forcing
    rows = (torch.arange(b, device=valid.device)[:, None, None] * t + prev_row)[valid]
    teacher_h = teacher.reshape(b * t, -1)[rows]
    parts = []
    for s in range(0, h.shape[0], opt.loss_chunk_size):
        c = slice(s, s + opt.loss_chunk_size)
        args = (head, lm_head, h[c], prev[c], true_ids[valid][c], teacher_h[c])
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(_chunk_terms, *args, use_reentrant=False))
        else:
            parts.append(_chunk_terms(*args))
    empty = h.new_zeros(0)
    ce, tv, top1, t_top1 = (torch.cat(p) for p in zip(*parts, strict=True)) if parts else (
        empty, empty, empty.long(), empty.long())  # fmt: skip
    w = position_weights(bs, opt.position_decay_gamma).to(h.device)[slot]  # [n]
    norm = w.sum().clamp(min=1e-12)
    per_slot = opt.ce_loss_weight * ce + opt.tv_loss_weight * tv
    if head.confidence_head is not None:
        logit = head.confidence_logit(h, prev)
        bce = F.binary_cross_entropy_with_logits(logit, (1.0 - tv).detach(), reduction="none")
        per_slot = per_slot + opt.confidence_loss_weight * bce
    total = (w * per_slot).sum() / norm + states.sum() * 0.0  # keeps a graph with no slot
    correct = torch.zeros_like(valid)
    correct[valid] = top1 == t_top1
    losses, accs = [], []
    counts = valid.sum((0, 1))  # [bs]
    for i in range(bs):
        here = slot == i
        n = max(int(counts[i]), 1)
        losses.append(per_slot[here].detach().sum() / n)
        accs.append(correct[:, :, i].sum() / n)
    seen, hit = chain_counts(correct.permute(2, 0, 1).flatten(1), valid.permute(2, 0, 1).flatten(1))
    return loss_record(total, losses, accs, counts, seen, hit), correct


def walk_blocks(head: DSparkDrafter, lm_head: Tensor, states: Tensor, teacher: Tensor,
                anchor_ids: Tensor, valid: Tensor, prev_row: Tensor, temperature: float,
                generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
    """Drafts accepted per block as vLLM drafts them (module docstring): [B, A] long.

    states [B, A, bs, H] (the parallel pass), teacher [B, T, H], anchor_ids [B, A] (slot 0's
    Markov input), valid / prev_row from ``blocks.slot_targets``; ``temperature`` 0 (argmax)
    or 1 (sampled, rejection-sampled against the target's distribution)."""
    b, a, bs = valid.shape
    t = teacher.shape[1]
    rows = torch.arange(b, device=valid.device)[:, None] * t
    prev, alive = anchor_ids, torch.ones_like(valid[:, :, 0])
    accepted = torch.zeros(b, a, dtype=torch.long, device=valid.device)
    with torch.no_grad():
        for i in range(bs):
            logits = head.logits(states[:, :, i], prev, lm_head).float()  # [B, A, V]
            t_logits = (teacher.reshape(b * t, -1)[rows + prev_row[:, :, i]] @ lm_head.T).float()
            draft, ok = rejection_step(logits, t_logits, temperature, generator)
            alive = alive & valid[:, :, i] & ok
            accepted += alive.long()
            prev = draft
    return accepted


def run_blocks(trainee: Trainee, opt: DSparkOptions, batch: Batch, teacher: Tensor,
               anchors: Tensor, keep: Tensor):  # fmt: skip
    """One parallel pass over the blocks at ``anchors`` [B, A] (``keep``): (states
    [B, A, bs, H], valid, prev_row, true_ids)."""
    head, bs = trainee.head, opt.block_size
    ids, positions = block_inputs(batch["input_ids"], batch["position_ids"], anchors, bs,
                                  head.mask_token_id)  # fmt: skip
    mask = block_mask(anchors, keep, batch["doc_ids"], bs)
    states = head(ids, positions, batch["aux_states"], batch["position_ids"], mask)
    valid, prev_row, true_ids = slot_targets(anchors, keep, batch["input_ids"],
                                             batch["loss_mask"], batch["doc_ids"], bs)  # fmt: skip
    return states.view(*anchors.shape, bs, -1), valid, prev_row, true_ids


def dspark_loss(trainee: Trainee, opt: DSparkOptions, batch: Batch) -> tuple[Tensor, TTTLoss]:
    """Training: ``num_anchors`` random blocks per row. Validation: a block at every candidate
    anchor (``num_anchors`` per pass), walked at temperature 0 and 1 (module docstring)."""
    teacher = trainee.teacher(batch)
    lm_head = trainee.target_lm_head
    cand = anchor_candidates(batch["loss_mask"], batch["doc_ids"], batch["position_ids"])

    def objective(anchors: Tensor, keep: Tensor):
        states, valid, prev_row, true_ids = run_blocks(trainee, opt, batch, teacher, anchors, keep)
        out, _ = block_objective(trainee.head, lm_head, states, teacher, batch["input_ids"],
                                 valid, prev_row, true_ids, opt)  # fmt: skip
        return out, states, valid, prev_row

    if trainee.training:
        out, *_ = objective(*sample_anchors(cand, opt.num_anchors))
        return out.loss, out
    anchors, keep = sample_anchors(cand, cand.shape[1])  # every candidate, ascending
    accepted = [torch.zeros_like(batch["input_ids"]) for _ in range(2)]  # T = 0, T = 1
    generator = torch.Generator(device=batch["input_ids"].device).manual_seed(0)
    parts = []
    for start in range(0, anchors.shape[1], opt.num_anchors):
        chunk = slice(start, start + opt.num_anchors)
        out, states, valid, prev_row = objective(anchors[:, chunk], keep[:, chunk])
        anchor_ids = batch["input_ids"].gather(1, anchors[:, chunk])
        for temperature, acc in zip((0.0, 1.0), accepted, strict=True):
            m = walk_blocks(trainee.head, lm_head, states, teacher, anchor_ids, valid, prev_row,
                            temperature, generator)  # fmt: skip
            acc.scatter_add_(1, anchors[:, chunk], m * keep[:, chunk])  # unused slots add 0
        parts.append(out)
    walks = [served_walk(acc, batch["loss_mask"], batch["doc_ids"], opt.block_size)
             for acc in accepted]  # fmt: skip
    log_sampled(trainee, *walks[1])
    return merge_records(parts, *walks[0])
