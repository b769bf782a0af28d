"""DFlash's objective: blocks at random anchors in training, a block at every position in
validation, walked as vLLM drafts (``walk.served_walk``) at temperature 0 (the loop's
``val/acceptance_length``) and 1 (``val/acceptance_length_t1``, ``sampled_walk``).

Context layers: the data module's ``aux_layers`` (default: every tapped layer but the last).
Draftsmith's layer id ``k`` is the residual stream after ``k`` decoder layers; vLLM's
``dflash_config.target_layer_ids`` are 0-based layer indices whose output it taps (it adds 1),
so ``target_layer_id = k - 1`` and id 0 (the embeddings) cannot be a context layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.core.errors import DatasetError
from draftsmith.drafters.attention.block_layout import anchor_candidates, block_inputs, block_mask
from draftsmith.drafters.dflash.blocks import (
    block_loss,
    default_gamma,
    slot_validity,
)
from draftsmith.drafters.dflash.options import DFlashOptions
from draftsmith.drafters.losses.loss import TTTLoss, merge_records
from draftsmith.drafters.losses.walk import (
    accepted_lengths,
    log_sampled,
    rejection_step,
    sample_anchors,
    served_walk,
)
from draftsmith.drafters.protocol import Trainee
from draftsmith.drafters.protocol.batch import Batch


def target_layer_ids(aux_layer_ids: list[int], num_hidden_layers: int) -> list[int]:
    """Draftsmith layer ids (state after k layers) -> vLLM's 0-based ``target_layer_ids``."""
    bad = [k for k in aux_layer_ids if not 1 <= k <= num_hidden_layers]
    if bad:
        raise DatasetError(
            f"data.aux_layers: {aux_layer_ids} holds {bad}; DFlash taps decoder layer outputs, "
            f"ids 1..{num_hidden_layers} (id 0 is the embeddings): drop them from data.aux_layers"
        )
    return [k - 1 for k in aux_layer_ids]


def run_blocks(
    trainee: Trainee,
    opt: DFlashOptions,
    batch: Batch,
    teacher: Tensor,
    anchors: Tensor,
    keep: Tensor,
    generator: torch.Generator | None = None,
) -> tuple[TTTLoss, Tensor, Tensor | None]:
    """Blocks at ``anchors`` [B, A] (``keep``), one drafter pass, the weighted loss;
    returns ``blocks.block_loss``'s (TTTLoss, correct [B, A, bs - 1]) and, given a
    ``generator``, the drafts accepted per block at temperature 1 ([B, A], ``sampled_walk``)."""
    head = trainee.head
    bs = opt.block_size
    ids, positions = block_inputs(
        batch["input_ids"], batch["position_ids"], anchors, bs, head.mask_token_id
    )
    mask = block_mask(anchors, keep, batch["doc_ids"], bs, head.sliding_window)
    drafts = head(ids, positions, batch["aux_states"], batch["position_ids"], mask)
    valid, target = slot_validity(anchors, keep, batch["loss_mask"], batch["doc_ids"], bs)
    gamma = opt.loss_decay_gamma or default_gamma(bs)
    lm_head = trainee.target_lm_head  # validation judges drafts over every id, as vLLM does
    if trainee.training and getattr(trainee, "loss_lm_head", None) is not None:
        lm_head = trainee.loss_lm_head  # draft and teacher restricted to the loss vocabulary
    out, correct = block_loss(
        drafts, lm_head, teacher, valid, target, gamma, opt.loss_chunk_size, fused=opt.fused_loss
    )
    sampled = None
    if generator is not None:
        sampled = sampled_walk(drafts, lm_head, teacher, valid, target, generator)
    return out, correct, sampled


def sampled_walk(drafts: Tensor, lm_head: Tensor, teacher: Tensor, valid: Tensor,
                 target: Tensor, generator: torch.Generator) -> Tensor:  # fmt: skip
    """Drafts accepted per block at temperature 1, as vLLM verifies them: [B, A] long.

    drafts [B, A * bs, H] (the parallel pass), teacher [B, T, H], valid / target from
    ``blocks.slot_validity``. Slot i's draft is sampled from its own distribution (a DFlash
    slot does not see the slot before it) and accepted with probability ``min(1, p / q)``
    against the target's distribution from row ``target - 1`` (the reply's own context, as
    in DSpark's walk); a block stops at its first rejection."""
    b, a, bs = valid.shape
    t = teacher.shape[1]
    states = drafts.view(b, a, bs, -1)
    rows = torch.arange(b, device=valid.device)[:, None, None] * t + target - 1  # [B, A, bs]
    alive = torch.ones_like(valid[:, :, 0])
    accepted = torch.zeros(b, a, dtype=torch.long, device=valid.device)
    with torch.no_grad():
        for i in range(1, bs):
            logits = states[:, :, i] @ lm_head.T  # [B, A, V]
            t_logits = teacher.reshape(b * t, -1)[rows[:, :, i].clamp(min=0)] @ lm_head.T
            _, ok = rejection_step(logits, t_logits, 1.0, generator)
            alive = alive & valid[:, :, i] & ok
            accepted += alive.long()
    return accepted


def dflash_loss(trainee: Trainee, opt: DFlashOptions, batch: Batch) -> tuple[Tensor, TTTLoss]:
    """Training: ``num_anchors`` random blocks per row, one pass; the acceptance logged is the
    average over those anchors. Validation: a block at every candidate anchor (``num_anchors``
    per pass), and the acceptance of walking each response as vLLM does (``served_walk``):
    blocks see only the context before their anchor, so one block per position gives the
    drafts of every path vLLM could take."""
    teacher = trainee.teacher(batch)
    cand = anchor_candidates(batch["loss_mask"], batch["doc_ids"], batch["position_ids"])
    if trainee.training:
        anchors, keep = sample_anchors(cand, opt.num_anchors)
        out, *_ = run_blocks(trainee, opt, batch, teacher, anchors, keep)
        return out.loss, out
    anchors, keep = sample_anchors(cand, cand.shape[1])  # every candidate, ascending
    accepted = [torch.zeros_like(batch["input_ids"]) for _ in range(2)]  # [B, T]: T = 0, T = 1
    generator = torch.Generator(device=batch["input_ids"].device).manual_seed(0)
    parts = []
    for start in range(0, anchors.shape[1], opt.num_anchors):
        chunk = slice(start, start + opt.num_anchors)
        out, correct, sampled = run_blocks(trainee, opt, batch, teacher, anchors[:, chunk],
                                           keep[:, chunk], generator)  # fmt: skip
        for acc, lengths in zip(accepted, (accepted_lengths(correct), sampled), strict=True):
            acc.scatter_add_(1, anchors[:, chunk], lengths * keep[:, chunk])  # unused add 0
        parts.append(out)
    walks = [served_walk(acc, batch["loss_mask"], batch["doc_ids"], opt.block_size - 1)
             for acc in accepted]  # fmt: skip
    log_sampled(trainee, *walks[1])
    return merge_records(parts, *walks[0])
