"""The MTP kind's objective: the layer unrolled over K recursive steps as vLLM drafts.

Step k (0-based) of stream t (the chain vLLM starts after the target processed token t) reads
the embedding of x_{t+k+1} at rope position ``pos_t + k`` and, at step 0, the target's state
at t as vLLM feeds it (``families.Family.fed``: after the final norm, or before it for MiMo);
at step k >= 1 the layer's own feedback state of step k - 1. It predicts x_{t+k+2}. Attention
sees step 0's keys of the same document up to t and the keys steps 1..k of the same stream
wrote: vLLM's draft KV cache (``ttt.py`` has the alignment and the attention).

Loss: step k's soft cross-entropy against the target's own next-token distribution, weighted
``decay ** k / sum_j decay ** j`` (FastMTP-style; ``options.py``). Validation judges drafts
by the target's argmax and walks each response as vLLM drafts it (``walk.served_walk``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from draftsmith.drafters.attention.ttt import TTTAttention, document_causal_mask, shift_tokens
from draftsmith.drafters.losses.acceptance import acceptance_from_counts
from draftsmith.drafters.losses.loss import TTTLoss, teacher_argmax, ttt_loss
from draftsmith.drafters.losses.walk import served_walk
from draftsmith.drafters.mtp.families import FAMILIES
from draftsmith.drafters.mtp.model import MTPLayer
from draftsmith.drafters.mtp.options import MTPOptions
from draftsmith.drafters.protocol import Trainee
from draftsmith.drafters.protocol.batch import Batch


def step_weights(steps: int, decay: float | None) -> list[float]:
    """FastMTP-style weights of the K steps, summing to 1 (equal when ``decay`` is None)."""
    raw = [1.0 if decay is None else decay**k for k in range(steps)]
    return [w / sum(raw) for w in raw]


def mtp_unroll(head: MTPLayer, input_ids: Tensor, states: Tensor, position_ids: Tensor,
               doc_ids: Tensor, steps: int, impl: str = "auto") -> list[Tensor]:  # fmt: skip
    """K logits inputs [B, T, H] (step k, stream t predicts x_{t+k+2}; module docstring).

    input_ids, position_ids, doc_ids [B, T]; states [B, T, H] the target's state as fed."""
    attend = TTTAttention(document_causal_mask(doc_ids), impl)  # type: ignore[arg-type]
    out = []
    for k in range(steps):
        attend.step = k
        logits_in, states = head(shift_tokens(input_ids, doc_ids, k + 1), states,
                                 position_ids + k, attend)  # fmt: skip
        out.append(logits_in)
    return out


def fed_states(trainee: Trainee, batch: Batch) -> Tensor:
    """The target state vLLM feeds this layer at step 0, [B, T, H]."""
    if FAMILIES[trainee.head.family].fed == "post_norm":
        return trainee.teacher(batch)
    return batch["teacher_states"]


def mtp_loss(trainee: Trainee, opt: MTPOptions, batch: Batch) -> tuple[Tensor, TTTLoss]:
    """(loss, record) of one batch; validation adds the served walk's counts."""
    teacher = trainee.teacher(batch)
    steps = mtp_unroll(trainee.head, batch["input_ids"], fed_states(trainee, batch),
                       batch["position_ids"], batch["doc_ids"], opt.mtp_steps)  # fmt: skip
    top1 = None
    if not trainee.training:  # accuracy as vLLM judges it: the target's argmax
        top1 = teacher_argmax(teacher, trainee.target_lm_head, None, opt.loss_chunk_size)
    decay = 1.0 if opt.mtp_step_decay is None else opt.mtp_step_decay
    lm_head = trainee.target_lm_head
    out = ttt_loss(steps, lm_head, teacher, lm_head, batch["loss_mask"], batch["doc_ids"], top1,
                   decay, opt.loss_chunk_size, fused=opt.fused_loss)  # fmt: skip
    out = dataclasses.replace(out, loss=out.loss / sum(decay**k for k in range(opt.mtp_steps)))
    if not trainee.training:
        accepted = torch.zeros_like(batch["input_ids"])
        accepted[:, 1:] = out.stream_accepted[:, :-1]  # stream t's bonus token is x_{t+1}
        seen, hit = served_walk(accepted, batch["loss_mask"], batch["doc_ids"], opt.mtp_steps)
        out = dataclasses.replace(out, chain_seen=seen, chain_hit=hit,
                                  acceptance_length=acceptance_from_counts(seen, hit))  # fmt: skip
    return out.loss, out
