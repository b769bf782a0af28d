"""Training-time test (TTT): unroll a draft head over K draft steps exactly as vLLM serves it.

Alignment (0-based indices into a packed row of length T; "stream t" is the draft chain
that vLLM would start after the target has processed token t):

- step 0, stream t: target state h_t (fused by ``fc``), embedding of token x_{t+1},
  rope position ``pos_t``; predicts x_{t+2}. This is vLLM's first pass
  (``SpecDecodeBaseProposer.set_inputs_first_pass``): input ids shifted left by one,
  positions and hidden states left at the target's.
- step k >= 1, stream t: the head's own feedback state of stream t at step k-1 (pre-norm
  ``mlp_out + residual``; ``aux_output`` in ``llama_eagle3.LlamaModel.forward``), embedding of
  x_{t+k+1} (teacher forcing: in serving, the accepted draft token), rope position
  ``pos_t + k`` (``_update_positions_dependent_metadata`` adds 1 per step); predicts x_{t+k+2}.
- attention at step k, stream t, layer l (vLLM's draft KV cache at that moment): the step-0
  keys/values of layer l at positions s <= t of the same document (written by first passes),
  plus the layer-l keys/values that steps 1..k of the SAME stream wrote (positions
  pos_t + 1 .. pos_t + k). Nothing of other streams' later steps is visible.

A shifted token that falls outside the row or into another document is replaced by
``pad_id``; those stream/step pairs are invalid targets (see ``loss.py``), and no output of a
document ever depends on another document.

Four attention implementations give the same result: ``dense`` (reference: all steps' keys
concatenated, [T, (k+1)T] boolean mask), ``efficient`` (SDPA over the step-0 prefix merged
with k diagonal scores through their log-sum-exp; memory does not grow with k),
``blockwise`` (the same merge, with the prefix attention and its log-sum-exp from one
blockwise pass that skips keys a query block cannot see; ``PrefixAttention``) and ``flex``
(dense's keys and mask as a flex-attention block mask, one fused kernel; ``ttt_flex.py``,
CUDA for training). ``auto`` picks blockwise on CPU; on CUDA, flex where the unroll is
compiled and efficient otherwise (``resolve_attention``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.checkpoint import checkpoint

from draftsmith.drafters.attention.layers import repeat_kv
from draftsmith.drafters.attention.llama import LlamaDraftHead
from draftsmith.drafters.attention.ttt_flex import flex_step_attention, ttt_block_mask

AttentionImpl = Literal["auto", "blockwise", "efficient", "dense", "flex"]


def document_causal_mask(doc_ids: Tensor) -> Tensor:
    """doc_ids [B, T] -> bool [B, 1, T, T]: query i sees key j iff j <= i, same document."""
    t = doc_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # [B, T, T]
    return (same_doc & causal)[:, None]


def shift_tokens(input_ids: Tensor, doc_ids: Tensor, shift: int, pad_id: int = 0) -> Tensor:
    """[B, T] -> [B, T]: position t holds x_{t+shift} if it is in t's document, else pad_id."""
    b, t = input_ids.shape
    out = torch.full_like(input_ids, pad_id)
    if shift >= t:
        return out
    same = doc_ids[:, shift:] == doc_ids[:, : t - shift]  # [B, T - shift]
    out[:, : t - shift] = torch.where(same, input_ids[:, shift:], pad_id)
    return out


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
    """Masked attention that also returns its log-sum-exp, computed in query blocks.

    Forward and backward (flash-attention style: scores recomputed per block, nothing of
    [T, T] kept) skip the keys a block cannot see: those after its last query (causal) and
    before the first key any of its queries may see (document starts). The log-sum-exp output
    is differentiable, so one pass gives what ``efficient_step_attention`` needs to merge the
    diagonal TTT keys. q/k/v [B, n, T, hd] (k, v already repeated to n heads), mask
    [B, 1, T, T] bool -> (out [B, n, T, hd], lse [B, n, T] float32).
    """

    @staticmethod
    def _blocks(mask: Tensor, block: int):
        t = mask.shape[-2]
        for start in range(0, t, block):
            end = min(start + block, t)
            seen = mask[:, :, start:end, :end].any(dim=2).any(dim=0).any(dim=0)  # [end]
            first = int(seen.nonzero()[0]) if bool(seen.any()) else 0
            yield start, end, first

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
        for s, e, f in PrefixAttention._blocks(mask, block):
            p, lse[:, :, s:e] = PrefixAttention._probs(
                qs[:, :, s:e], k[:, :, f:e], mask[:, :, s:e, f:e], wide
            )
            out[:, :, s:e] = torch.matmul(p.to(v.dtype), v[:, :, f:e])
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.block = block
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):  # type: ignore[override]
        q, k, v, mask, out, lse = ctx.saved_tensors
        scale, wide = q.shape[-1] ** -0.5, lse.dtype
        qs = q * scale
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        d_out = torch.zeros_like(out) if d_out is None else d_out
        delta = (d_out.to(wide) * out.to(wide)).sum(-1)  # [B, n, T]
        if d_lse is not None:
            delta = delta - d_lse  # d lse / d scores = p: folds into the softmax backward
        for s, e, f in PrefixAttention._blocks(mask, ctx.block):
            p, _ = PrefixAttention._probs(qs[:, :, s:e], k[:, :, f:e], mask[:, :, s:e, f:e], wide)
            do = d_out[:, :, s:e]
            dv[:, :, f:e] += torch.matmul(p.transpose(-1, -2).to(do.dtype), do)
            dp = torch.matmul(do, v[:, :, f:e].transpose(-1, -2)).to(wide)
            ds = dp.sub_(delta[:, :, s:e, None]).mul_(p).to(q.dtype)  # d scores / scale
            dq[:, :, s:e] = torch.matmul(ds, k[:, :, f:e]).mul_(scale)
            dk[:, :, f:e] += torch.matmul(ds.transpose(-1, -2), qs[:, :, s:e])
        return dq, dk, dv, None, None


def prefix_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, block: int = 256
) -> tuple[Tensor, Tensor]:
    """(out, lse) of masked attention; see ``PrefixAttention``. k/v may have fewer heads."""
    n_rep = q.shape[1] // k.shape[1]
    return PrefixAttention.apply(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask, block)


def efficient_step_attention(
    q: Tensor,
    keys: list[Tensor],
    values: list[Tensor],
    prefix_mask: Tensor,
    blockwise: bool = False,
) -> Tensor:
    """Step-k attention from prefix attention and k diagonal scores, merged by log-sum-exp.

    q [B, n, T, hd]; keys/values: k+1 tensors [B, n_kv, T, hd] (step 0 first);
    prefix_mask [B, 1, T, T]. Returns [B, n, T, hd].
    """
    n_rep = q.shape[1] // keys[0].shape[1]
    if blockwise:  # one pass gives both, blocks above the diagonal skipped
        out0, lse0 = prefix_attention(q, keys[0], values[0], prefix_mask)
    else:  # the fused SDPA kernel, the log-sum-exp beside it
        k0, v0 = repeat_kv(keys[0], n_rep), repeat_kv(values[0], n_rep)
        out0 = F.scaled_dot_product_attention(q, k0, v0, attn_mask=prefix_mask)  # [B, n, T, hd]
        lse0 = masked_logsumexp(q, k0, prefix_mask)  # [B, n, T]
    scale, wide = q.shape[-1] ** -0.5, torch.promote_types(q.dtype, torch.float32)
    # Query t of step k also sees, from each step j = 1..k, only stream t's own key.
    diag = [(q * repeat_kv(kj, n_rep)).sum(-1).to(wide) * scale for kj in keys[1:]]  # [B, n, T]
    lse = torch.logsumexp(torch.stack([lse0, *diag], dim=-1), dim=-1)  # [B, n, T]
    # The merge weights [B, n, T, 1] are formed in float32 and cast once; the states
    # [B, n, T, hd] stay in their dtype (no float32 round trip of out0 and each v_j).
    dtype = q.dtype
    out = torch.exp(lse0 - lse).to(dtype)[..., None] * out0
    for dj, vj in zip(diag, values[1:], strict=True):
        out = out + torch.exp(dj - lse).to(dtype)[..., None] * repeat_kv(vj, n_rep)
    return out


def dense_step_attention(
    q: Tensor, keys: list[Tensor], values: list[Tensor], prefix_mask: Tensor
) -> Tensor:
    """Reference: attention over all steps' keys with the explicit [T, (k+1)T] TTT mask."""
    n_rep = q.shape[1] // keys[0].shape[1]
    t = q.shape[2]
    eye = torch.eye(t, dtype=torch.bool, device=q.device).expand_as(prefix_mask)
    mask = torch.cat([prefix_mask] + [eye] * (len(keys) - 1), dim=-1)  # [B, 1, T, (k+1)T]
    k = repeat_kv(torch.cat(keys, dim=2), n_rep)  # [B, n, (k+1)T, hd]
    v = repeat_kv(torch.cat(values, dim=2), n_rep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def resolve_attention(attention: str, device: torch.device | str, compiled: bool) -> str:
    """``model.attention`` as a step on ``device`` runs it, the one place ``auto`` is decided:
    blockwise on CPU, flex on CUDA when the unroll is ``compiled`` and efficient (SDPA) on
    CUDA otherwise; another value is kept. Measured by ``make bench-gpu`` (H200, 2026-11-27,
    8cc20c2, frozen lm_head): fused loss + flex + compile ran 57,401 tok/s at TTT 3 and 28,417
    at TTT 7, against 35,668 and 27,004 for fused + efficient (eager at 3, compiled at 7);
    eager flex lost at TTT 3 (0.72x the efficient path); on CPU blockwise beat SDPA."""
    if attention != "auto":
        return attention
    if torch.device(device).type == "cpu":
        return "blockwise"
    return "flex" if compiled else "efficient"


class TTTAttention:
    """An ``AttendFn`` that keeps each layer's KV per draft step (the draft KV cache)."""

    def __init__(
        self, prefix_mask: Tensor, impl: AttentionImpl = "auto", doc_ids: Tensor | None = None
    ) -> None:
        if impl not in ("auto", "blockwise", "efficient", "dense", "flex"):
            raise ValueError(
                "attention must be 'auto', 'blockwise', 'efficient', 'dense' or 'flex', got "
                f"{impl!r}"
            )
        if impl == "flex" and doc_ids is None:
            raise ValueError("attention 'flex' builds its block mask from doc_ids: give them")
        impl = resolve_attention(impl, prefix_mask.device, compiled=False)  # an eager caller
        self.prefix_mask = prefix_mask  # [B, 1, T, T]
        self.doc_ids = doc_ids  # [B, T]
        self.blockwise = impl == "blockwise"
        self.dense = impl == "dense"
        self.flex = impl == "flex"
        self.block_masks: dict[int, BlockMask] = {}  # flex: per step, shared by the layers
        self.keys: dict[int, list[Tensor]] = {}
        self.values: dict[int, list[Tensor]] = {}
        self.step = 0

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, n, T, hd], k/v [B, n_kv, T, hd] of the current step -> [B, n, T, hd]."""
        if self.step == 0:
            self.keys[layer_idx], self.values[layer_idx] = [k], [v]
            if self.flex:
                return flex_step_attention(q, [k], [v], self._block_mask())
            if self.blockwise:
                return prefix_attention(q, k, v, self.prefix_mask)[0]
            n_rep = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(
                q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=self.prefix_mask
            )
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if len(keys) != self.step:
            raise RuntimeError(f"layer {layer_idx} called twice or skipped at step {self.step}")
        keys.append(k)
        values.append(v)
        if self.flex:
            return flex_step_attention(q, keys, values, self._block_mask())
        if self.dense:
            return dense_step_attention(q, keys, values, self.prefix_mask)
        return efficient_step_attention(q, keys, values, self.prefix_mask, self.blockwise)

    def _block_mask(self) -> BlockMask:
        """flex: this step's block mask (``ttt_flex.ttt_block_mask``), built once per step."""
        if self.step not in self.block_masks:
            assert self.doc_ids is not None
            self.block_masks[self.step] = ttt_block_mask(self.doc_ids, self.step)
        return self.block_masks[self.step]


def ttt_unroll(
    head: LlamaDraftHead,
    input_ids: Tensor,
    hidden_states: Tensor,
    position_ids: Tensor,
    doc_ids: Tensor,
    num_steps: int,
    impl: AttentionImpl = "auto",
    pad_id: int = 0,
) -> list[Tensor]:
    """Run ``num_steps`` draft steps over a packed batch; see the module docstring.

    Args:
        input_ids: [B, T] token ids x_0..x_{T-1}.
        hidden_states: [B, T, n_aux * H_target] fused target states (EAGLE-3) or
            [B, T, H] final target states (EAGLE-1); row t is the state after token t.
        position_ids: [B, T] rope positions of the tokens (restarting per document is fine).
        doc_ids: [B, T] document id of each token; no attention across documents.
        num_steps: K >= 1.
    Returns:
        K tensors [B, T, H]: step k's logits input (final-normed state for EAGLE-3, the
        output state for EAGLE-1) of stream t, predicting x_{t+k+2}.
    """
    if num_steps < 1:
        raise ValueError("num_steps must be >= 1")
    attend = TTTAttention(document_causal_mask(doc_ids), impl, doc_ids)
    hidden = head.combine_hidden_states(hidden_states)  # [B, T, H]
    states = []
    for k in range(num_steps):
        attend.step = k
        step_ids = shift_tokens(input_ids, doc_ids, k + 1, pad_id)  # x_{t+k+1}
        logits_in, hidden = head(step_ids, hidden, position_ids + k, attend)
        states.append(logits_in)
    return states
