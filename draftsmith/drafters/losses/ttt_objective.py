"""The objective of heads unrolled with training-time test (EAGLE-3, EAGLE-1).

Per batch the head is unrolled ``ttt_steps`` times (``ttt.py``); step k's loss is the soft
cross-entropy (``loss: kl``), the total variation (``tv``) or their blend against the teacher,
the target's own next-token distribution (``loss.py``), weighted ``loss_decay**k``.
Validation judges drafts as vLLM does (the target's argmax over every id) and walks each
response as vLLM drafts it (``walk.served_walk``), so its acceptance is the served one.
Under sequence parallelism (``trainee.sequence_shard``) each rank unrolls and scores its rows
of the row, and ``reduce_record`` makes the record the whole row's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from draftsmith.drafters.attention.sequence_parallel import SequenceShard
from draftsmith.drafters.attention.ttt import resolve_attention, ttt_unroll
from draftsmith.drafters.attention.ttt_compile import compiled_unroll, use_compile
from draftsmith.drafters.losses.acceptance import acceptance_from_counts
from draftsmith.drafters.losses.loss import TTTLoss, teacher_argmax, ttt_loss
from draftsmith.drafters.losses.walk import served_walk
from draftsmith.drafters.protocol import Trainee
from draftsmith.drafters.protocol.batch import Batch
from draftsmith.drafters.protocol.options import TTTOptions


def unrolled_loss(
    trainee: Trainee,
    opt: TTTOptions,
    batch: Batch,
    states: Tensor,
    teacher: Tensor,
    teacher_weight: Tensor,
    to_draft: Tensor | None,
) -> tuple[TTTLoss, list[Tensor]]:
    """(the record of a TTT unroll, the K step outputs [B, T, H]).

    Args:
        states: what the head's ``combine_hidden_states`` reads, [B, T, *].
        teacher: final-normed target states [B, T, H] (``trainee.teacher``).
        teacher_weight: the target lm_head rows of the head's vocabulary [V_draft, H].
        to_draft: [V] the draft id of each target id (-1 outside), None for the full vocab.
    """
    head = trainee.head
    shard = getattr(trainee, "sequence_shard", None)  # the row split across ranks, or None
    compiled = use_compile(opt.compile, opt.ttt_steps, states.device)
    unroll = compiled_unroll() if compiled else ttt_unroll
    row = batch["input_ids"].shape[1]
    steps = unroll(
        head, batch["input_ids"], states, batch["position_ids"], batch["doc_ids"],
        opt.ttt_steps, resolve_attention(opt.attention, states.device, compiled, row),
        window=head.sliding_window, shard=shard,
    )  # fmt: skip
    top1 = None
    if not trainee.training:  # accuracy as vLLM judges it: the target's argmax over all ids
        top1 = teacher_argmax(teacher, trainee.target_lm_head, to_draft, opt.loss_chunk_size)
    out = ttt_loss(
        steps, head.logits_weight, teacher, teacher_weight, batch["loss_mask"],
        batch["doc_ids"], top1, opt.loss_decay, opt.loss_chunk_size,
        loss=opt.loss, tv_weight=opt.tv_weight, fused=opt.fused_loss, shard=shard,
    )  # fmt: skip
    if shard is not None:  # the whole row's record on every rank sharing it
        out = reduce_record(out, shard)
    if not trainee.training:  # the acceptance vLLM serves: chains where the last one ended
        accepted = torch.zeros_like(batch["input_ids"])
        accepted[:, 1:] = out.stream_accepted[:, :-1]  # stream t's bonus token is x_{t+1}
        seen, hit = served_walk(accepted, batch["loss_mask"], batch["doc_ids"], opt.ttt_steps)
        out = dataclasses.replace(
            out,
            chain_seen=seen,
            chain_hit=hit,
            acceptance_length=acceptance_from_counts(seen, hit),
        )
    return out, steps


def reduce_record(out: TTTLoss, shard: SequenceShard) -> TTTLoss:
    """A rank's share of a row's ``TTTLoss`` -> the row's: sums of the shares (each token
    weighed 1 / the row's count, so the sum is the row's mean), chains summed, streams
    gathered; the loss is the row's, its gradient ``shard.whole_loss``'s."""
    seen, hit = shard.sum(out.chain_seen), shard.sum(out.chain_hit)
    accepted = out.stream_accepted
    return dataclasses.replace(
        out,
        loss=shard.whole_loss(out.loss),
        step_loss=shard.sum(out.step_loss),
        step_accuracy=shard.sum(out.step_accuracy),
        step_count=shard.sum(out.step_count),
        acceptance_length=acceptance_from_counts(seen, hit),
        chain_seen=seen,
        chain_hit=hit,
        stream_accepted=None if accepted is None else shard.gather_rows(accepted),
    )
