"""Masked attention computed one query block at a time: memory O(block x T), never [T, T].

``PrefixAttention`` returns the attention output and its log-sum-exp in one pass (what the TTT
merge of ``ttt.efficient_step_attention`` needs), flash-attention style: forward and backward
recompute each block's scores, skip the keys the block cannot see (after its last query, and
before the first key any of its queries sees: document starts, the sliding window), and keep
nothing of [T, T] for backward. The mask is a ``masks.RowMask`` (built per block from the
documents and the window) or an explicit [B, 1, T, T] tensor (``masks.DenseMask``).

``masked_logsumexp`` is the log-sum-exp alone, in query blocks under activation checkpointing
(the SDPA path's companion).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from draftsmith.drafters.attention.layers import repeat_kv
from draftsmith.drafters.attention.masks import DenseMask, RowMask, as_mask


def _masked_lse_block(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    """q [B, n, Tq, hd], k [B, n, S, hd], mask [B, 1, Tq, S] -> float32 lse [B, n, Tq]."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(wide) * scale  # [B, n, Tq, S]
    return scores.masked_fill(~mask, float("-inf")).logsumexp(dim=-1)


def masked_logsumexp(q: Tensor, k: Tensor, mask: Tensor, block: int = 512) -> Tensor:
    """log sum_s exp(q . k_s / sqrt(hd)) over the keys ``mask`` allows, in query blocks.

    Each block runs under activation checkpointing, so no [T, S] score tensor is kept for
    backward (it is recomputed one block at a time). Shapes as ``_masked_lse_block``.
    """
    scale = q.shape[-1] ** -0.5
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    out = []
    for start in range(0, q.shape[2], block):
        qb, mb = q[:, :, start : start + block], mask[:, :, start : start + block]
        if grad:
            out.append(checkpoint(_masked_lse_block, qb, k, mb, scale, use_reentrant=False))
        else:
            out.append(_masked_lse_block(qb, k, mb, scale))
    return torch.cat(out, dim=2)


class PrefixAttention(torch.autograd.Function):
    """Masked causal attention that also returns its log-sum-exp, in query blocks.

    q/k/v [B, n, T, hd] (k, v already repeated to n heads), ``mask`` a ``RowMask`` /
    ``DenseMask`` (module docstring) -> (out [B, n, T, hd], lse [B, n, T] float32). The
    log-sum-exp output is differentiable, so one pass gives what the TTT merge needs.
    """

    @staticmethod
    def _blocks(mask: Tensor | RowMask | DenseMask, block: int):
        """(start, end, first key) of each query block (``masks.RowMask.spans``)."""
        return as_mask(mask).spans(block)

    @staticmethod
    def _probs(q, k, mask, wide):
        """Softmax of the masked scores of one block (q pre-scaled), in place: few passes."""
        scores = torch.matmul(q, k.transpose(-1, -2)).to(wide)
        scores.masked_fill_(~mask, float("-inf"))
        lse = scores.logsumexp(dim=-1)
        return scores.sub_(lse[..., None]).exp_(), lse

    @staticmethod
    def forward(ctx, q, k, v, mask, block):  # type: ignore[override]
        scale, wide = q.shape[-1] ** -0.5, torch.promote_types(q.dtype, torch.float32)
        qs = q * scale  # scaling q ([T, hd]) is cheaper than scaling the scores ([T, T])
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=wide, device=q.device)
        spans = list(mask.spans(block))
        for s, e, f in spans:
            p, lse[:, :, s:e] = PrefixAttention._probs(
                qs[:, :, s:e], k[:, :, f:e], mask.block(s, e, f), wide
            )
            out[:, :, s:e] = torch.matmul(p.to(v.dtype), v[:, :, f:e])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.spans = mask, spans
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        scale, wide = q.shape[-1] ** -0.5, lse.dtype
        qs = q * scale
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        d_out = torch.zeros_like(out) if d_out is None else d_out
        delta = (d_out.to(wide) * out.to(wide)).sum(-1)  # [B, n, T]
        if d_lse is not None:
            delta = delta - d_lse  # d lse / d scores = p: folds into the softmax backward
        for s, e, f in ctx.spans:
            p, _ = PrefixAttention._probs(qs[:, :, s:e], k[:, :, f:e], ctx.mask.block(s, e, f),
                                          wide)  # fmt: skip
            do = d_out[:, :, s:e]
            dv[:, :, f:e] += torch.matmul(p.transpose(-1, -2).to(do.dtype), do)
            dp = torch.matmul(do, v[:, :, f:e].transpose(-1, -2)).to(wide)
            ds = dp.sub_(delta[:, :, s:e, None]).mul_(p).to(q.dtype)  # d scores / scale
            dq[:, :, s:e] = torch.matmul(ds, k[:, :, f:e]).mul_(scale)
            dk[:, :, f:e] += torch.matmul(ds.transpose(-1, -2), qs[:, :, s:e])
        return dq, dk, dv, None, None


def prefix_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | RowMask | DenseMask, block: int = 256
) -> tuple[Tensor, Tensor]:
    """(out, lse) of masked attention; see ``PrefixAttention``. k/v may have fewer heads;
    ``mask``: a ``RowMask`` or an explicit bool [B, 1, T, T]."""
    n_rep = q.shape[1] // k.shape[1]
    return PrefixAttention.apply(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), as_mask(mask), block)
