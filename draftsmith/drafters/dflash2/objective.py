"""DFlash2's objective: DFlash's loss plus the selector's K-way cross-entropy; validation walks
the selector as vLLM 0.32 drafts with it, at temperature 0 and 1.

Training (``block_objective``): DFlash's blocks at random anchors and its per-slot weighted
soft cross-entropy (``drafters/dflash/blocks.py``), then, per scored slot ``i`` of a block at
``a`` (it predicts the token at ``a + i``), teacher-forced:

- candidates: the top-K ids of the slot's unary logits ``lm_head(h_i)`` over the whole
  vocabulary (what vLLM serves);
- gold: the target's argmax there (its greedy token, speculators' hard target); missing from
  the candidates, it replaces the weakest one (``selector.with_gold``);
- predecessor: the reply's token at ``a + i - 1`` (slot 1: the anchor);
- ``CE_i = cross_entropy(S(pred, candidates), gold's place)``, slots weighted
  ``exp(-(i - 1) / gamma)`` as in DFlash's loss, normalised over the scored slots::

      loss = dflash_loss + selector_loss_weight * sum_s w_s CE_s / sum_s w_s

The record's per-slot accuracy and simulated acceptance count the selector's teacher-forced
choice among the served candidates (a slot whose gold is not among them is wrong), not the
unary argmax: what vLLM drafts is the selector's choice. ``train/selector_loss`` and
``train/candidate_recall`` (gold among the served top-K) are logged beside.

Validation (``selector_walk``): a block at every candidate anchor, the one pass, then slot by
slot as vLLM's ``DFlash2Speculator`` walks: scores of the slot's candidates given the token
chosen at the slot before (slot 1: the anchor). Temperature 0: the best-scoring candidate,
accepted while it equals the target's argmax. Temperature 1 (vLLM with
``draft_sample_method: probabilistic``: Gumbel-max over the scores, and the scores at the
candidates, -inf elsewhere, as the draft logits: ``draft_logits``): a candidate sampled
from ``q = softmax(scores)`` over the K, accepted with probability ``min(1, p / q)``
(``candidate_step``: ``walk.rejection_step`` on the candidates). ``walk.served_walk`` turns
the accepted lengths into vLLM's acceptance length: T = 0 the loop's
``val/acceptance_length``, T = 1 ``val/acceptance_length_t1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from draftsmith.drafters.attention.block_layout import anchor_candidates, block_inputs, block_mask
from draftsmith.drafters.dflash.blocks import block_loss, default_gamma, slot_validity, slot_weights
from draftsmith.drafters.dflash2.model import DFlash2Drafter
from draftsmith.drafters.dflash2.options import DFlash2Options
from draftsmith.drafters.dflash2.selector import top_candidates, with_gold
from draftsmith.drafters.losses.acceptance import chain_counts
from draftsmith.drafters.losses.loss import TTTLoss, loss_record, merge_records
from draftsmith.drafters.losses.walk import log_sampled, sample_anchors, served_walk
from draftsmith.drafters.protocol import Trainee
from draftsmith.drafters.protocol.batch import Batch


def _selector_chunk(head: DFlash2Drafter, h: Tensor, lm_head: Tensor, candidates: Tensor,
                    label: Tensor, pred: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """n slots -> (K-way CE [n], the selector's choice [n]: a place in ``candidates``)."""
    unary = torch.einsum("nh,nkh->nk", h, lm_head[candidates])  # [n, K]
    scores = head.candidate_selector(unary, h, pred[:, None], candidates)[:, 0]  # [n, K]
    return F.cross_entropy(scores.float(), label, reduction="none"), scores.argmax(-1)


def selector_terms(
    head: DFlash2Drafter,
    h: Tensor,
    lm_head: Tensor,
    gold: Tensor,
    pred: Tensor,
    chunk_size: int,
    stop_gradient: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher-forced selector terms of n scored slots (module docstring).

    Args: h [n, H] the slots' final-normed states; lm_head [V, H]; gold [n], pred [n] long.
    Returns: (CE [n], correct [n] bool: the choice is gold AND gold was served, contains [n]
    bool: gold among the served top-K).
    """
    if stop_gradient:
        h = h.detach()
    ces, correct, contains = [], [], []
    for s in range(0, h.shape[0], chunk_size):
        c = slice(s, s + chunk_size)
        with torch.no_grad():
            candidates, _ = top_candidates(h[c], lm_head, head.top_k)
        candidates, label, served = with_gold(candidates, gold[c])
        args = (head, h[c], lm_head, candidates, label, pred[c])
        if torch.is_grad_enabled():  # logits of a chunk at a time, recomputed in backward
            ce, choice = checkpoint(_selector_chunk, *args, use_reentrant=False)
        else:
            ce, choice = _selector_chunk(*args)
        ces.append(ce)
        correct.append(served & (choice == label))
        contains.append(served)
    if not ces:
        empty = h.new_zeros(0, dtype=torch.bool)
        return h.new_zeros(0), empty, empty
    return torch.cat(ces), torch.cat(correct), torch.cat(contains)


def teacher_argmax(teacher: Tensor, rows: Tensor, lm_head: Tensor, chunk_size: int) -> Tensor:
    """The target's greedy token of each row: teacher [N, H] final-normed, rows [n] -> [n]."""
    with torch.no_grad():
        parts = [(teacher[rows[s : s + chunk_size]] @ lm_head.T).argmax(-1)
                 for s in range(0, rows.shape[0], chunk_size)]  # fmt: skip
    return torch.cat(parts) if parts else rows.new_zeros(0)


def block_objective(trainee: Trainee, opt: DFlash2Options, batch: Batch, teacher: Tensor,
                    anchors: Tensor, keep: Tensor):  # fmt: skip
    """One pass over the blocks at ``anchors`` [B, A] (``keep``) and the objective (module
    docstring): (the record, states [B, A, bs, H], valid, target [B, A, bs])."""
    head, bs = trainee.head, opt.block_size
    ids, positions = block_inputs(batch["input_ids"], batch["position_ids"], anchors, bs,
                                  head.mask_token_id)  # fmt: skip
    mask = block_mask(anchors, keep, batch["doc_ids"], bs, head.sliding_window)
    drafts = head(ids, positions, batch["aux_states"], batch["position_ids"], mask)
    valid, target = slot_validity(anchors, keep, batch["loss_mask"], batch["doc_ids"], bs)
    gamma = opt.loss_decay_gamma or default_gamma(bs)
    full = trainee.target_lm_head  # candidates and gold over every id, as vLLM serves them
    lm_head = full
    if trainee.training and getattr(trainee, "loss_lm_head", None) is not None:
        lm_head = trainee.loss_lm_head  # DFlash's loss over the loss vocabulary only
    unary, _ = block_loss(drafts, lm_head, teacher, valid, target, gamma, opt.loss_chunk_size,
                          fused=opt.fused_loss)  # fmt: skip

    b, a, _ = valid.shape
    t = teacher.shape[1]
    states = drafts.view(b, a, bs, -1)
    rows = (torch.arange(b, device=valid.device)[:, None, None] * t + target - 1)[valid]  # [n]
    gold = teacher_argmax(teacher.reshape(b * t, -1), rows, full, opt.loss_chunk_size)
    pred = batch["input_ids"].reshape(-1)[rows]  # the reply's token before the predicted one
    ce, hit, served = selector_terms(head, states[valid], full, gold, pred, opt.loss_chunk_size,
                                     opt.selector_stop_gradient)  # fmt: skip
    slot = torch.arange(bs, device=valid.device).expand(b, a, bs)[valid]  # [n]
    w = slot_weights(bs, gamma).to(ce.device)[slot]
    selector_loss = (w * ce).sum() / w.sum().clamp(min=1e-12)
    total = unary.loss + opt.selector_loss_weight * selector_loss

    correct = torch.zeros_like(valid)
    correct[valid] = hit
    counts = valid.sum((0, 1))  # [bs]
    losses, accs = [], []
    for i in range(1, bs):
        n = max(int(counts[i]), 1)
        mean_ce = ce.detach()[slot == i].sum() / n
        losses.append(unary.step_loss[i - 1] + opt.selector_loss_weight * mean_ce)
        accs.append(correct[:, :, i].sum() / n)
    seen, hit_counts = chain_counts(correct[:, :, 1:].permute(2, 0, 1).flatten(1),
                                    valid[:, :, 1:].permute(2, 0, 1).flatten(1))  # fmt: skip
    out = loss_record(total, losses, accs, counts[1:], seen, hit_counts)
    recall = served.float().mean() if served.numel() else served.new_zeros((), dtype=torch.float)
    log_selector(trainee, batch, selector_loss.detach(), recall)
    return out, states, valid, target


def log_selector(trainee: Trainee, batch: Batch, selector_loss: Tensor, recall: Tensor) -> None:
    """Log the selector's loss and the gold token's recall in the served top-K (a trainee that
    cannot log, a bare test object, is skipped)."""
    if not hasattr(trainee, "log_dict"):
        return
    split = "train" if trainee.training else "val"
    logs = {f"{split}/selector_loss": selector_loss, f"{split}/candidate_recall": recall}
    trainee.log_dict(logs, batch_size=batch["input_ids"].shape[0], sync_dist=not trainee.training)


def draft_logits(head: DFlash2Drafter, lm_head: Tensor, hidden: Tensor, prev: Tensor) -> Tensor:
    """One slot's draft logits as vLLM caches them: the selector's scores at the slot's K
    candidates given the token chosen before (``prev``), -inf elsewhere.

    hidden [..., H] final-normed slot states, prev [...] long, lm_head [V, H] -> [..., V]
    float32 (its argmax is vLLM's greedy draft; ``softmax(logits / T)`` its q at T > 0)."""
    candidates, unary = top_candidates(hidden, lm_head, head.top_k)  # [..., K]
    scores = head.candidate_selector(unary, hidden, prev[..., None], candidates)[..., 0, :]
    logits = torch.full((*hidden.shape[:-1], lm_head.shape[0]), float("-inf"),
                        device=hidden.device)  # fmt: skip
    return logits.scatter_(-1, candidates, scores.float())


def candidate_step(candidates: Tensor, scores: Tensor, t_logits: Tensor, temperature: float,
                   generator: torch.Generator | None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``walk.rejection_step`` on the K candidates: (draft [...] long, accepted [...] bool).

    candidates, scores [..., K] (the selector's, given the token before), t_logits [..., V]
    (the target's). Temperature 0: the best-scoring candidate, accepted when it is the target's
    argmax. Otherwise one drawn from ``q = softmax(scores / T)`` (0 off the candidates: vLLM's
    draft logits are -inf there), accepted with probability ``min(1, p / q)``, p the target's
    ``softmax(t_logits / T)`` over the whole vocabulary."""
    if temperature == 0:
        draft = candidates.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
        return draft, draft == t_logits.argmax(-1)
    q = (scores.float() / temperature).softmax(-1)
    place = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=generator).view(q.shape[:-1])
    draft = candidates.gather(-1, place[..., None]).squeeze(-1)
    log_p = (t_logits.float() / temperature).log_softmax(-1).gather(-1, draft[..., None])
    ratio = log_p.squeeze(-1).exp() / q.gather(-1, place[..., None]).squeeze(-1)
    device = generator.device if generator is not None else q.device
    u = torch.rand(ratio.shape, generator=generator, device=device).to(ratio.device)
    return draft, u < ratio.clamp(max=1.0)


def selector_walk(head: DFlash2Drafter, lm_head: Tensor, states: Tensor, teacher: Tensor,
                  anchor_ids: Tensor, valid: Tensor, target: Tensor,
                  temperatures: tuple[float, ...] = (0.0,),
                  generator: torch.Generator | None = None) -> list[Tensor]:  # fmt: skip
    """Drafts accepted per block as vLLM's DFlash2 walk drafts them (module docstring), one
    walk per temperature (0, or 1: sampled with ``generator``); the slots' candidates and the
    target's logits are computed once for all.

    states [B, A, bs, H] (the one pass), lm_head [V, H], teacher [B, T, H], anchor_ids [B, A]
    (slot 1's predecessor), valid / target from ``slot_validity``.
    Returns: per temperature, accepted drafts per block [B, A] long.
    """
    b, a, bs = valid.shape
    t = teacher.shape[1]
    rows = torch.arange(b, device=valid.device)[:, None, None] * t + target - 1  # [B, A, bs]
    n = len(temperatures)
    prev, alive = [anchor_ids] * n, [torch.ones_like(valid[:, :, 0])] * n
    accepted = [torch.zeros(b, a, dtype=torch.long, device=valid.device) for _ in range(n)]
    with torch.no_grad():
        for i in range(1, bs):
            h = states[:, :, i]  # [B, A, H]
            candidates, unary = top_candidates(h, lm_head, head.top_k)  # [B, A, K]
            t_logits = teacher.reshape(b * t, -1)[rows[:, :, i].clamp(min=0)] @ lm_head.T
            for j, temperature in enumerate(temperatures):
                scores = head.candidate_selector(unary, h, prev[j][..., None], candidates)
                draft, ok = candidate_step(candidates, scores[..., 0, :], t_logits, temperature,
                                           generator)  # fmt: skip
                alive[j] = alive[j] & valid[:, :, i] & ok
                accepted[j] += alive[j].long()
                prev[j] = draft
    return accepted


def dflash2_loss(trainee: Trainee, opt: DFlash2Options, batch: Batch) -> tuple[Tensor, TTTLoss]:
    """Training: ``num_anchors`` random blocks per row. Validation: a block at every candidate
    anchor (``num_anchors`` per pass), walked at temperature 0 and 1 (module docstring)."""
    teacher = trainee.teacher(batch)
    cand = anchor_candidates(batch["loss_mask"], batch["doc_ids"], batch["position_ids"])
    if trainee.training:
        anchors, keep = sample_anchors(cand, opt.num_anchors)
        out, *_ = block_objective(trainee, opt, batch, teacher, anchors, keep)
        return out.loss, out
    anchors, keep = sample_anchors(cand, cand.shape[1])  # every candidate, ascending
    accepted = [torch.zeros_like(batch["input_ids"]) for _ in range(2)]  # [B, T]: T = 0, T = 1
    generator = torch.Generator(device=batch["input_ids"].device).manual_seed(0)
    parts = []
    for start in range(0, anchors.shape[1], opt.num_anchors):
        chunk = slice(start, start + opt.num_anchors)
        out, states, valid, target = block_objective(trainee, opt, batch, teacher,
                                                     anchors[:, chunk], keep[:, chunk])  # fmt: skip
        anchor_ids = batch["input_ids"].gather(1, anchors[:, chunk])
        walks = selector_walk(trainee.head, trainee.target_lm_head, states, teacher, anchor_ids,
                              valid, target, (0.0, 1.0), generator)  # fmt: skip
        for acc, m in zip(accepted, walks, strict=True):
            acc.scatter_add_(1, anchors[:, chunk], m * keep[:, chunk])  # unused slots add 0
        parts.append(out)
    walks = [served_walk(acc, batch["loss_mask"], batch["doc_ids"], opt.block_size - 1)
             for acc in accepted]  # fmt: skip
    log_sampled(trainee, *walks[1])
    return merge_records(parts, *walks[0])
