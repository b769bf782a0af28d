"""Memory-bounded loss against the target (teacher) over the draft vocabulary.

Teacher distribution for the token at position p+1: ``softmax(final_norm(h_p) @ W_t[ids].T)``
where ``W_t`` is the target's lm_head and ``ids`` [draft_vocab] the target ids of the draft
vocabulary. That is: the target's logits gathered at the draft-vocab ids, then softmax, i.e. the
target distribution restricted to the draft vocabulary and renormalised. Tokens outside the
draft vocabulary carry no loss (the head cannot produce them); they do count as errors in the
accuracy when ``teacher_top1`` comes from the full vocabulary (``teacher_argmax``).

Cost: the teacher's probabilities are computed once per batch and shared by the K TTT steps
(``Teacher``), and the draft lm_head's gradient is skipped when it is frozen.

Objective per token (``loss``), with d = softmax(draft logits) and t the teacher:

- ``kl``: the soft cross-entropy ``-sum_v t_v log d_v``, i.e. KL(t || d) plus the teacher's
  entropy (a constant: same gradient, ``d - t``).
- ``tv``: total variation ``0.5 * sum_v |d_v - t_v|``. A draft token sampled from d is accepted
  with probability ``1 - TV(d, t)``, so this is the quantity speculative sampling pays for.
  Its gradient wrt the logits, with s = sign(d - t): ``0.5 * d_j * (s_j - sum_v d_v s_v)``.
- ``kl_tv``: ``(1 - tv_weight) * kl + tv_weight * tv``.

Memory: logits are only ever built for ``chunk_size`` tokens at a time. The autograd function
computes the loss and its gradients chunk by chunk during the forward, and keeps only gradient
buffers the size of its inputs ([N, H] and [draft_vocab, H]). Peak extra memory is
O(chunk_size * draft_vocab), independent of the number of tokens.

On CUDA the same loss runs fused (``fused_loss.py``, ``model.fused_loss``; ``draft_loss``
picks the path): bf16 logits, online softmax in Triton, no fp32 [tokens, vocab] tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.losses.acceptance import (
    acceptance_from_counts,
    chain_counts,
    step_validity,
)
from draftsmith.drafters.losses.fused_loss import (
    FusedDraftLoss,
    FusedMode,
    LogitTeacher,
    compute_dtype,
    fused_enabled,
)
from draftsmith.drafters.losses.grads_in_forward import GradsInForward

if TYPE_CHECKING:
    from draftsmith.drafters.attention.sequence_parallel import SequenceShard

LossKind = Literal["kl", "tv", "kl_tv"]


def objective_weights(loss: str, tv_weight: float = 0.5) -> tuple[float, float]:
    """(weight of the soft cross-entropy, weight of TV) of ``loss`` (module docstring)."""
    if loss == "kl":
        return 1.0, 0.0
    if loss == "tv":
        return 0.0, 1.0
    if loss == "kl_tv":
        if not 0.0 <= tv_weight <= 1.0:
            raise ConfigError(f"model.tv_weight: {tv_weight} is not in [0, 1]; pick e.g. 0.5")
        return 1.0 - tv_weight, tv_weight
    raise ConfigError(f"model.loss: {loss!r} is not one of 'kl', 'tv', 'kl_tv'")


def chunk_objective(
    logits: Tensor, teacher: Tensor, weights: tuple[float, float], need_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """Per-row loss [n] and its gradient wrt ``logits`` [n, V] (None unless ``need_grad``).

    logits [n, V] draft logits (float32 or wider), teacher [n, V] probabilities, weights
    (cross-entropy, TV) from ``objective_weights``.
    """
    ce_w, tv_w = weights
    logd = logits.log_softmax(-1)  # [n, V]
    loss = ce_w * -(teacher * logd).sum(-1) if ce_w else logits.new_zeros(logits.shape[0])
    if not tv_w:  # the soft cross-entropy alone: d(CE)/d logits = d - t (sum(t) = 1)
        return loss, logd.exp_().sub_(teacher).mul_(ce_w) if need_grad else None
    d = logd.exp_()
    diff = d - teacher
    loss = loss + tv_w * 0.5 * diff.abs().sum(-1)
    if not need_grad:
        return loss, None
    s = diff.sign_()  # [n, V]; in place from here on: few [n, V] buffers
    grad = s.sub_((d * s).sum(-1, keepdim=True)).mul_(d).mul_(0.5 * tv_w)  # d(tv_w * TV)/dz
    return loss, grad.add_(d.sub_(teacher), alpha=ce_w) if ce_w else grad


class Teacher:
    """The teacher's distribution over the draft vocabulary, row by row.

    Row p of ``states`` [M, Ht] (final-normed target states) gives
    ``softmax(states[p] @ weight.T)`` over the draft vocabulary ([draft_vocab, Ht] rows of the
    target's lm_head). Every TTT step reads the same rows shifted by one, so the rows a batch
    needs (``rows``) are computed once, in chunks, when they fit ``cache_elements`` floats;
    otherwise each call recomputes its rows (memory stays O(chunk x draft vocab)).
    """

    def __init__(
        self,
        states: Tensor,
        weight: Tensor,
        rows: Tensor,
        chunk_size: int = 1024,
        cache_elements: int = 2**28,
    ) -> None:
        self.states, self.weight = states, weight
        self.wide = torch.promote_types(states.dtype, torch.float32)
        self.probs: Tensor | None = None
        if 0 < rows.numel() * weight.shape[0] <= cache_elements:
            self.slot = torch.full((states.shape[0],), -1, dtype=torch.long, device=rows.device)
            self.slot[rows] = torch.arange(rows.numel(), device=rows.device)
            parts = [self._compute(c) for c in rows.split(chunk_size)]
            self.probs = torch.cat([p for p, _ in parts])  # [R, V]
            self.top1 = torch.cat([t for _, t in parts])  # [R]

    def _compute(self, index: Tensor) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            logits = self.states[index] @ self.weight.T  # [n, V]
            return logits.to(self.wide).softmax(-1), logits.argmax(-1)

    def __call__(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """index [n] rows -> (probabilities [n, V] float32, argmax [n] draft ids)."""
        if self.probs is None:
            return self._compute(index)
        slot = self.slot[index]
        return self.probs[slot], self.top1[slot]


class ChunkedDraftLoss(GradsInForward):
    """sum_i w_i * loss(p_teacher_i, softmax(x_i @ W.T)) over index pairs, in chunks of tokens
    (``objective`` = (cross-entropy weight, TV weight), see ``objective_weights``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        states: Tensor,  # [N, H] draft logits inputs (flattened)
        weight: Tensor,  # [V, H] draft lm_head
        teacher: Teacher,
        draft_index: Tensor,  # [P] distinct rows of `states`
        teacher_index: Tensor,  # [P] rows of the teacher
        token_weight: Tensor,  # [P] float
        chunk_size: int,
        need_grad: tuple[bool, bool],  # (states, weight): grads are computed in forward
        objective: tuple[float, float] = (1.0, 0.0),
    ) -> tuple[Tensor, Tensor, Tensor]:
        wide = torch.promote_types(states.dtype, torch.float32)  # softmax math in >= float32
        grad_states = torch.zeros_like(states) if need_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=wide) if need_grad[1] else None
        total = torch.zeros((), dtype=wide, device=states.device)
        draft_top1 = torch.empty_like(draft_index)
        teacher_top1 = torch.empty_like(draft_index)
        for start in range(0, draft_index.numel(), chunk_size):
            di = draft_index[start : start + chunk_size]
            x = states[di]  # [n, H]
            logits = (x @ weight.T).to(wide)  # [n, V]
            p, teacher_top1[start : start + chunk_size] = teacher(
                teacher_index[start : start + chunk_size]
            )  # [n, V]
            w = token_weight[start : start + chunk_size].to(wide)  # [n]
            draft_top1[start : start + chunk_size] = logits.argmax(-1)
            row_loss, g = chunk_objective(logits, p, objective, need_grad[0] or need_grad[1])
            total += (w * row_loss).sum()
            if g is not None:
                g = g.mul_(w[:, None])  # d(w * loss) / d logits
            if need_grad[0]:
                # Indices are distinct within a call: plain (deterministic) assignment.
                grad_states[di] = (g.to(weight.dtype) @ weight).to(states.dtype)
            if need_grad[1]:
                grad_weight += g.T @ x.to(wide)
        return GradsInForward.finish(ctx, need_grad, grad_states, grad_weight, weight, total,
                                     draft_top1, teacher_top1)  # fmt: skip


def draft_loss(
    fused: FusedMode,
    draft_states: Tensor,
    teacher_states: Tensor,
    teacher_weight: Tensor,
    rows: Tensor,
    chunk_size: int = 1024,
    cache_elements: int = 2**28,
) -> tuple[Teacher | LogitTeacher, type[torch.autograd.Function]]:
    """(teacher, loss function) of the path ``fused`` (``model.fused_loss``) picks for
    ``draft_states``: ``Teacher`` and ``ChunkedDraftLoss`` (torch; CPU), or ``LogitTeacher``
    and ``FusedDraftLoss`` (Triton; CUDA). Both functions take the same arguments.

    teacher_states [M, Ht], teacher_weight [draft_vocab, Ht], rows [R] the teacher rows the
    batch reads (``Teacher``).
    """
    if not fused_enabled(fused, draft_states.device):
        teacher = Teacher(teacher_states, teacher_weight, rows, chunk_size, cache_elements)
        return teacher, ChunkedDraftLoss
    dtype = compute_dtype(draft_states)
    logit_teacher = LogitTeacher(
        teacher_states, teacher_weight, rows, dtype, chunk_size, cache_elements
    )
    return logit_teacher, FusedDraftLoss


def teacher_argmax(
    teacher_states: Tensor,
    target_lm_head: Tensor,
    target_to_draft: Tensor | None = None,
    chunk_size: int = 1024,
) -> Tensor:
    """The target's greedy next token over its FULL vocabulary, in draft ids.

    teacher_states [B, T, Ht] (final-normed), target_lm_head [V_target, Ht], target_to_draft
    [V_target] long (-1 outside the draft vocab; None = identity) -> [B, T] long (-1 = the
    greedy token is not in the draft vocabulary, so no draft can match it).
    """
    flat = teacher_states.reshape(-1, teacher_states.shape[-1])  # [B*T, Ht]
    with torch.no_grad():
        top1 = torch.cat(
            [(c @ target_lm_head.T).argmax(-1) for c in flat.split(chunk_size)]
        )  # [B*T] target ids
    if target_to_draft is not None:
        top1 = target_to_draft[top1]
    return top1.view(teacher_states.shape[:-1])


@dataclass
class TTTLoss:
    loss: Tensor  # scalar: sum_k decay**k * mean_k(loss)
    step_loss: Tensor  # [K] detached mean loss per step
    step_accuracy: Tensor  # [K] top-1 agreement with the teacher per step
    step_count: Tensor  # [K] number of valid (stream, step) pairs
    acceptance_length: Tensor  # scalar, see simulated_acceptance_length
    chain_seen: Tensor  # [K] see chain_counts
    chain_hit: Tensor  # [K]
    stream_accepted: Tensor | None = None  # [B, T] drafts a chain started at t would have
    # accepted (TTT streams; validation walks them as vLLM drafts, ``served_walk``)


def ttt_loss(
    step_states: list[Tensor],
    logits_weight: Tensor,
    teacher_states: Tensor,
    teacher_weight: Tensor,
    loss_mask: Tensor,
    doc_ids: Tensor,
    teacher_top1: Tensor | None = None,
    decay: float = 0.8,
    chunk_size: int = 1024,
    teacher_cache: int = 2**28,
    loss: LossKind = "kl",
    tv_weight: float = 0.5,
    fused: FusedMode = "auto",
    shard: SequenceShard | None = None,
) -> TTTLoss:
    """Loss, accuracy and simulated acceptance of a TTT unroll (alignment as in ``ttt.py``).

    Args:
        step_states: K tensors [B, T, H]; step k's stream t predicts x_{t+k+2}.
        logits_weight: [draft_vocab, H] the head's lm_head (``head.logits_weight``).
        teacher_states: [B, T, Ht] final-normed target states; row p predicts x_{p+1}, so the
            teacher of stream t at step k is row t+k+1.
        teacher_weight: [draft_vocab, Ht] target lm_head rows at the draft vocab's target ids.
        loss_mask: [B, T] bool, true where x_p is an assistant token to be predicted.
        doc_ids: [B, T] document of each token.
        teacher_top1: [B, T] long draft id of the target's full-vocab argmax at row p (from
            ``teacher_argmax``; -1 = outside the draft vocab). None: argmax over the draft vocab.
        teacher_cache: most floats of teacher probabilities ([rows, draft_vocab]) computed once
            and shared by the K steps; above it (or 0) each step recomputes its chunks, so peak
            memory stays O(chunk_size x draft_vocab).
        loss, tv_weight: the per-token objective (module docstring): ``kl``, ``tv`` or
            ``kl_tv`` = ``(1 - tv_weight) * kl + tv_weight * tv``.
        fused: ``model.fused_loss`` (``draft_loss``): ``auto`` is the fused Triton path for
            CUDA states, this module's torch path otherwise.
        shard: sequence parallelism (``sequence_parallel.py``): ``step_states`` are this
            rank's rows [B, T / P, H], ``teacher_states`` / ``teacher_top1`` those rows and
            ``shard.halo`` more, ``loss_mask`` / ``doc_ids`` the whole row's; every token
            weighs 1 / the whole row's count, so the ranks' losses sum to the row's.
    """
    objective = objective_weights(loss, tv_weight)
    b, t, _ = step_states[0].shape
    mine = slice(None) if shard is None else shard.rows
    width = teacher_states.shape[1]  # T, or T / P + halo with a shard
    ar = torch.arange(b * t, device=loss_mask.device).view(b, t)  # flat row of (b, t)
    teacher_row = torch.arange(b, device=loss_mask.device)[:, None] * width + torch.arange(
        t, device=loss_mask.device
    )  # [B, T]: the teacher row of (b, t)
    grad = torch.is_grad_enabled()
    need_grad = (
        grad and any(s.requires_grad for s in step_states),
        grad and logits_weight.requires_grad,
    )
    # Every step's teacher rows lie among those of step 0 shifted by one ... K: the rows p
    # whose next token x_{p+1} carries loss in p's document.
    needed = step_validity(loss_mask, doc_ids, -1)
    if shard is not None:
        needed = shard.with_halo(needed)
    rows = torch.arange(b * width, device=loss_mask.device).view(b, width)[needed]
    teacher, loss_fn = draft_loss(
        fused, step_states[0], teacher_states.reshape(b * width, -1), teacher_weight, rows,
        chunk_size, teacher_cache,
    )  # fmt: skip
    losses, accs, counts, corrects, valids = [], [], [], [], []
    total = teacher_states.new_zeros((), dtype=torch.float32)
    for k, states in enumerate(step_states):
        whole = step_validity(loss_mask, doc_ids, k)  # [B, T] of the whole row
        valid = whole[:, mine]  # [B, T] (this rank's rows with a shard)
        draft_index = ar[valid]  # [P]
        teacher_index = (teacher_row + k + 1)[valid]  # same row, position t + k + 1
        count = max(int(whole.sum()) if shard is not None else draft_index.numel(), 1)
        w = torch.full((draft_index.numel(),), 1.0 / count, device=states.device)
        loss_k, draft_top1, teacher_top1_k = loss_fn.apply(
            states.reshape(b * t, -1), logits_weight, teacher,
            draft_index, teacher_index, w, chunk_size, need_grad, objective,
        )  # fmt: skip
        if teacher_top1 is not None:
            teacher_top1_k = teacher_top1.reshape(-1)[teacher_index]
        correct = torch.zeros_like(valid)
        correct[valid] = draft_top1 == teacher_top1_k
        total = total + decay**k * loss_k
        losses.append(loss_k.detach())
        accs.append(correct.sum() / count)
        counts.append(draft_index.numel())
        corrects.append(correct)
        valids.append(valid)
    seen, hit = chain_counts(torch.stack(corrects), torch.stack(valids))
    accepted = (torch.stack(corrects) & torch.stack(valids)).long().cumprod(0).sum(0)  # [B, T]
    return loss_record(total, losses, accs, counts, seen, hit, stream_accepted=accepted)


def loss_record(
    total: Tensor,
    losses: list[Tensor],
    accuracies: list[Tensor],
    counts: list[int] | Tensor,
    seen: Tensor,
    hit: Tensor,
    stream_accepted: Tensor | None = None,
) -> TTTLoss:
    """The ``TTTLoss`` of one pass: per-draft-position lists stacked, acceptance from the
    chain counts (``seen``, ``hit`` [K])."""
    return TTTLoss(
        loss=total,
        step_loss=torch.stack(losses),
        step_accuracy=torch.stack(accuracies).float(),
        step_count=counts.cpu() if isinstance(counts, Tensor) else torch.tensor(counts),
        acceptance_length=acceptance_from_counts(seen, hit),
        chain_seen=seen,
        chain_hit=hit,
        stream_accepted=stream_accepted,
    )


def merge_records(parts: list[TTTLoss], seen: Tensor, hit: Tensor) -> tuple[Tensor, TTTLoss]:
    """One (loss, TTTLoss) from passes over chunks of anchors, each weighted by its scored
    drafts; acceptance from the served walk's counts (``walk.served_walk``)."""
    dev = parts[0].loss.device
    counts = torch.stack([p.step_count for p in parts]).float().to(dev)  # [n, K]
    share = counts / counts.sum(0).clamp(min=1)
    total = counts.sum(1) / counts.sum().clamp(min=1)
    step_loss = sum(p.step_loss * w for p, w in zip(parts, share, strict=True))
    step_accuracy = sum(p.step_accuracy * w for p, w in zip(parts, share, strict=True))
    loss = sum(p.loss * float(w) for p, w in zip(parts, total, strict=True))
    out = TTTLoss(
        loss=loss,
        step_loss=step_loss,
        step_accuracy=step_accuracy,
        step_count=counts.sum(0).long(),
        acceptance_length=acceptance_from_counts(seen, hit).to(dev),
        chain_seen=seen.to(dev),
        chain_hit=hit.to(dev),
    )
    return loss, out
