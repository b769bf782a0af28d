"""An autograd function that computes its gradients during its forward.

The draft losses (``loss.ChunkedDraftLoss``, ``fused_loss.FusedDraftLoss``) build logits a
chunk of tokens at a time and never keep them: the gradient wrt the states [N, H] and the
lm_head [V, H] is summed in the forward, saved, and only scaled by the incoming gradient in
``backward``. Subclasses write ``forward`` and end it with ``finish``.
"""

from __future__ import annotations

import torch
from torch import Tensor


class GradsInForward(torch.autograd.Function):
    """Base of the losses whose forward returns ``(total, draft_top1, teacher_top1)`` and
    takes ``(states, weight, ...)`` followed by 7 non-differentiable arguments."""

    @staticmethod
    def finish(ctx, need_grad: tuple[bool, bool], grad_states: Tensor | None,
               grad_weight: Tensor | None, weight: Tensor, total: Tensor, draft_top1: Tensor,
               teacher_top1: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Save the gradients (the lm_head's in ``weight``'s dtype) for ``backward``; the
        argmaxes carry no gradient."""
        grads = [
            grad_states if need_grad[0] else None,
            grad_weight.to(weight.dtype) if need_grad[1] else None,
        ]
        ctx.need_grad = need_grad
        ctx.save_for_backward(*[g for g in grads if g is not None])
        ctx.mark_non_differentiable(draft_top1, teacher_top1)
        return total, draft_top1, teacher_top1

    @staticmethod
    def backward(ctx, grad_total: Tensor, *_unused: Tensor):  # type: ignore[override]
        saved = iter(ctx.saved_tensors)
        grads = [grad_total * next(saved) if need else None for need in ctx.need_grad]
        return *grads, *([None] * 7)
