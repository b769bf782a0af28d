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

With ``model.sliding_window`` w, every key above is seen only within vLLM's window: a step-k
query at position ``pos_t + k`` sees the step-0 keys at ``pos_t + k - w + 1 .. pos_t`` and the
step-j keys while ``k - j <= w - 1`` (``masks.py``).

Four attention implementations give the same result: ``dense`` (reference: all steps' keys
concatenated, [T, (k+1)T] boolean mask), ``efficient`` (SDPA over the step-0 prefix merged
with k diagonal scores through their log-sum-exp; memory does not grow with k, but its
[T, T] mask does with the row), ``blockwise`` (the same merge, with the prefix attention and
its log-sum-exp from one blockwise pass that skips keys a query block cannot see and builds
each block's mask from the documents: memory linear in the row; ``blockwise.py``) and
``flex`` (dense's keys and mask as a flex-attention block mask, one fused kernel;
``ttt_flex.py``, CUDA for training). ``auto`` picks blockwise on CPU; on CUDA, flex where the
unroll is compiled or the row is long (``LONG_ROW``) and efficient otherwise
(``resolve_attention``).

Sequence parallelism (``sequence_parallel.py``): the states of a row are split across ranks;
every rank keeps the row's token ids, positions and documents, and attention sees the whole
row for its share of the heads (Ulysses), so the unroll above is unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from draftsmith.drafters.attention.blockwise import (  # noqa: F401 (re-exported)
    PrefixAttention,
    masked_logsumexp,
    prefix_attention,
)
from draftsmith.drafters.attention.layers import repeat_kv
from draftsmith.drafters.attention.llama import LlamaDraftHead
from draftsmith.drafters.attention.masks import RowMask, diagonal_seen
from draftsmith.drafters.attention.sequence_parallel import SequenceShard
from draftsmith.drafters.attention.ttt_flex import flex_step_attention, ttt_block_mask

AttentionImpl = Literal["auto", "blockwise", "efficient", "dense", "flex"]


def document_causal_mask(doc_ids: Tensor, window: int | None = None) -> Tensor:
    """doc_ids [B, T] -> bool [B, 1, T, T]: query i sees key j iff j <= i, same document (and
    ``i - j <= window - 1`` with a sliding window; ``masks.RowMask`` builds it per block)."""
    t = doc_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    if window is not None:
        causal = causal & ~torch.ones_like(causal).tril(-window)
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


def efficient_step_attention(
    q: Tensor,
    keys: list[Tensor],
    values: list[Tensor],
    prefix_mask: Tensor | RowMask,
    blockwise: bool = False,
    window: int | None = None,
) -> Tensor:
    """Step-k attention from prefix attention and k diagonal scores, merged by log-sum-exp.

    q [B, n, T, hd]; keys/values: k+1 tensors [B, n_kv, T, hd] (step 0 first);
    prefix_mask: step k's mask over the step-0 keys, bool [B, 1, T, T] or a ``RowMask`` (the
    blockwise pass builds it per block); ``window``: the diagonal keys a sliding window
    leaves (``masks.diagonal_seen``). Returns [B, n, T, hd].
    """
    n_rep = q.shape[1] // keys[0].shape[1]
    step = len(keys) - 1
    if blockwise:  # one pass gives both, blocks above the diagonal skipped
        out0, lse0 = prefix_attention(q, keys[0], values[0], prefix_mask)
    else:  # the fused SDPA kernel, the log-sum-exp beside it
        mask = prefix_mask.dense() if isinstance(prefix_mask, RowMask) else prefix_mask
        k0, v0 = repeat_kv(keys[0], n_rep), repeat_kv(values[0], n_rep)
        out0 = F.scaled_dot_product_attention(q, k0, v0, attn_mask=mask)  # [B, n, T, hd]
        lse0 = masked_logsumexp(q, k0, mask)  # [B, n, T]
    seen = [j for j in range(1, step + 1) if diagonal_seen(step, j, window)]
    keys, values = [keys[j] for j in seen], [values[j] for j in seen]
    scale, wide = q.shape[-1] ** -0.5, torch.promote_types(q.dtype, torch.float32)
    # Query t of step k also sees, from each step j = 1..k, only stream t's own key.
    diag = [(q * repeat_kv(kj, n_rep)).sum(-1).to(wide) * scale for kj in keys]  # [B, n, T]
    lse = torch.logsumexp(torch.stack([lse0, *diag], dim=-1), dim=-1)  # [B, n, T]
    # The merge weights [B, n, T, 1] are formed in float32 and cast once; the states
    # [B, n, T, hd] stay in their dtype (no float32 round trip of out0 and each v_j).
    dtype = q.dtype
    out = torch.exp(lse0 - lse).to(dtype)[..., None] * out0
    for dj, vj in zip(diag, values, strict=True):
        out = out + torch.exp(dj - lse).to(dtype)[..., None] * repeat_kv(vj, n_rep)
    return out


def dense_step_attention(
    q: Tensor,
    keys: list[Tensor],
    values: list[Tensor],
    prefix_mask: Tensor,
    window: int | None = None,
) -> Tensor:
    """Reference: attention over all steps' keys with the explicit [T, (k+1)T] TTT mask
    (``prefix_mask`` [B, 1, T, T] is step k's over the step-0 keys)."""
    n_rep = q.shape[1] // keys[0].shape[1]
    t, step = q.shape[2], len(keys) - 1
    eye = torch.eye(t, dtype=torch.bool, device=q.device).expand_as(prefix_mask)
    diags = [eye if diagonal_seen(step, j, window) else ~eye & eye for j in range(1, step + 1)]
    mask = torch.cat([prefix_mask, *diags], dim=-1)  # [B, 1, T, (k+1)T]
    k = repeat_kv(torch.cat(keys, dim=2), n_rep)  # [B, n, (k+1)T, hd]
    v = repeat_kv(torch.cat(values, dim=2), n_rep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# Rows of at least this many tokens run flex under ``auto`` on CUDA even when the unroll is
# not compiled: the efficient path's SDPA mask is [T, T] (1 GiB of booleans a row at 32k),
# flex's block mask is (T / 128)^2. Below it the measured choice stands (eager flex lost 0.72x
# to efficient at TTT 3, 2k rows, H200, 2026-11-27).
LONG_ROW = 8192


def resolve_attention(
    attention: str, device: torch.device | str, compiled: bool, row_tokens: int = 0
) -> str:
    """``model.attention`` as a step on ``device`` runs it, the one place ``auto`` is decided:
    blockwise on CPU; on CUDA flex when the unroll is ``compiled`` or the row holds at least
    ``LONG_ROW`` tokens, efficient (SDPA) otherwise; another value is kept. Measured by ``make
    bench-gpu`` (H200, 2026-11-27, 8cc20c2, frozen lm_head): fused loss + flex + compile ran
    57,401 tok/s at TTT 3 and 28,417 at TTT 7, against 35,668 and 27,004 for fused + efficient
    (eager at 3, compiled at 7); eager flex lost at TTT 3 (0.72x the efficient path); on CPU
    blockwise beat SDPA."""
    if attention != "auto":
        return attention
    if torch.device(device).type == "cpu":
        return "blockwise"
    return "flex" if compiled or row_tokens >= LONG_ROW else "efficient"


class TTTAttention:
    """An ``AttendFn`` that keeps each layer's KV per draft step (the draft KV cache).

    ``mask``: a ``masks.RowMask`` (documents and sliding window, built per block; flex reads
    its ``doc_ids``) or an explicit step-independent bool [B, 1, T, T] (then ``doc_ids`` for
    flex).
    """

    def __init__(
        self,
        mask: Tensor | RowMask,
        impl: AttentionImpl = "auto",
        doc_ids: Tensor | None = None,
    ) -> None:
        if impl not in ("auto", "blockwise", "efficient", "dense", "flex"):
            raise ValueError(
                "attention must be 'auto', 'blockwise', 'efficient', 'dense' or 'flex', got "
                f"{impl!r}"
            )
        self.rows = mask if isinstance(mask, RowMask) else None
        self.window = self.rows.window if self.rows is not None else None
        doc_ids = self.rows.doc_ids if self.rows is not None else doc_ids
        if impl == "flex" and doc_ids is None:
            raise ValueError("attention 'flex' builds its block mask from doc_ids: give them")
        device = mask.doc_ids.device if self.rows is not None else mask.device
        impl = resolve_attention(impl, device, compiled=False)  # an eager caller
        self.explicit = None if self.rows is not None else mask  # [B, 1, T, T]
        self.doc_ids = doc_ids  # [B, T]
        self.blockwise = impl == "blockwise"
        self.dense = impl == "dense"
        self.flex = impl == "flex"
        self.block_masks: dict[int, BlockMask] = {}  # flex: per step, shared by the layers
        self.dense_masks: dict[int, Tensor] = {}  # SDPA paths: per step (one without window)
        self.keys: dict[int, list[Tensor]] = {}
        self.values: dict[int, list[Tensor]] = {}
        self.step = 0

    def prefix(self, dense: bool) -> Tensor | RowMask:
        """This step's mask over the step-0 keys: a ``RowMask`` for the blockwise pass, else
        bool [B, 1, T, T] (built once per step, once for all steps without a window)."""
        if self.rows is None:
            return self.explicit
        step = self.step if self.window is not None else 0
        if not dense:
            return self.rows.at_step(step)
        if step not in self.dense_masks:
            self.dense_masks[step] = self.rows.at_step(step).dense()
        return self.dense_masks[step]

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, n, T, hd], k/v [B, n_kv, T, hd] of the current step -> [B, n, T, hd]."""
        if self.step == 0:
            self.keys[layer_idx], self.values[layer_idx] = [k], [v]
            if self.flex:
                return flex_step_attention(q, [k], [v], self._block_mask())
            if self.blockwise:
                return prefix_attention(q, k, v, self.prefix(dense=False))[0]
            n_rep = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(
                q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=self.prefix(dense=True)
            )
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if len(keys) != self.step:
            raise RuntimeError(f"layer {layer_idx} called twice or skipped at step {self.step}")
        keys.append(k)
        values.append(v)
        if self.flex:
            return flex_step_attention(q, keys, values, self._block_mask())
        if self.dense:
            return dense_step_attention(q, keys, values, self.prefix(dense=True), self.window)
        prefix = self.prefix(dense=not self.blockwise)
        return efficient_step_attention(q, keys, values, prefix, self.blockwise, self.window)

    def _block_mask(self) -> BlockMask:
        """flex: this step's block mask (``ttt_flex.ttt_block_mask``), built once per step."""
        if self.step not in self.block_masks:
            assert self.doc_ids is not None
            self.block_masks[self.step] = ttt_block_mask(self.doc_ids, self.step, self.window)
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
    window: int | None = None,
    shard: SequenceShard | None = None,
) -> list[Tensor]:
    """Run ``num_steps`` draft steps over a packed batch; see the module docstring.

    Args:
        input_ids: [B, T] token ids x_0..x_{T-1}.
        hidden_states: [B, T, n_aux * H_target] fused target states (EAGLE-3) or
            [B, T, H] final target states (EAGLE-1); row t is the state after token t.
            With ``shard``: this rank's rows only, [B, T / P, ...].
        position_ids: [B, T] rope positions of the tokens (restarting per document is fine).
        doc_ids: [B, T] document id of each token; no attention across documents.
        num_steps: K >= 1.
        window: the head's sliding window in tokens (None: full attention).
        shard: this rank's share of the row under sequence parallelism (None: the whole row).
    Returns:
        K tensors [B, T, H] ([B, T / P, H] with ``shard``): step k's logits input
        (final-normed state for EAGLE-3, the output state for EAGLE-1) of stream t,
        predicting x_{t+k+2}.
    """
    if num_steps < 1:
        raise ValueError("num_steps must be >= 1")
    attend = TTTAttention(RowMask(doc_ids, window), impl)
    call = attend if shard is None else shard.attend(attend)
    mine = slice(None) if shard is None else shard.rows
    hidden = head.combine_hidden_states(hidden_states)  # [B, T, H]
    states = []
    for k in range(num_steps):
        attend.step = k
        step_ids = shift_tokens(input_ids, doc_ids, k + 1, pad_id)[:, mine]  # x_{t+k+1}
        logits_in, hidden = head(step_ids, hidden, position_ids[:, mine] + k, call)
        states.append(logits_in)
    return states
