"""The block layout DFlash and DSpark share: which positions anchor a block, the block's
input ids and positions, and the attention mask over (context keys, block keys).

A block anchored at row position ``a`` is ``[x_a, MASK, ..., MASK]`` at positions
``a .. a + bs - 1``; it sees the context of its own document before ``a`` and its own
slots (both directions), as vLLM's block drafters do. With a sliding window of ``w`` tokens
slot ``i`` sees only the keys at most ``w - 1`` positions from its own, either side (vLLM
makes a window symmetric for non-causal attention; ``masks.py``). ``block_states`` drafts a
block at every position of one sequence (the kinds' eval replicas).
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.drafters.protocol.batch import PAD_DOC_ID


def anchor_candidates(loss_mask: Tensor, doc_ids: Tensor, position_ids: Tensor) -> Tensor:
    """[B, T] bool: positions that may anchor a block (module docstring)."""
    mask = loss_mask.bool()
    nxt = torch.zeros_like(mask)
    nxt[:, :-1] = mask[:, 1:] & (doc_ids[:, 1:] == doc_ids[:, :-1])
    return mask & nxt & (position_ids >= 1) & (doc_ids != PAD_DOC_ID)


def block_inputs(
    input_ids: Tensor, position_ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int
) -> tuple[Tensor, Tensor]:
    """(block_ids [B, A * bs], block_positions [B, A * bs]): ``[x_a, MASK, ...]`` at positions
    ``pos(a) + 0 .. bs - 1``, blocks back to back."""
    b, a = anchors.shape
    ids = torch.full(
        (b, a, block_size), mask_token_id, dtype=input_ids.dtype, device=anchors.device
    )
    ids[:, :, 0] = input_ids.gather(1, anchors)
    offsets = torch.arange(block_size, device=anchors.device)
    pos = position_ids.gather(1, anchors)[:, :, None] + offsets  # [B, A, bs]
    return ids.view(b, -1), pos.view(b, -1)


def block_mask(
    anchors: Tensor, keep: Tensor, doc_ids: Tensor, block_size: int, window: int | None = None
) -> Tensor:
    """[B, 1, Q, T + Q] bool, Q = A * bs: slot of block j sees the context keys t with
    ``doc(t) == doc(a_j)`` and ``t < a_j``, and the slots of block j; with ``window``, only
    keys within ``window - 1`` positions of the slot (module docstring). Memory O(Q x T)."""
    b, a = anchors.shape
    t = doc_ids.shape[1]
    anchor_doc = doc_ids.gather(1, anchors)  # [B, A]
    cols = torch.arange(t, device=anchors.device)
    ctx = (doc_ids[:, None, :] == anchor_doc[:, :, None]) & (cols < anchors[:, :, None])
    slot = torch.arange(block_size, device=anchors.device)
    if window is None:
        ctx = (ctx & keep[:, :, None]).repeat_interleave(block_size, dim=1)  # [B, Q, T]
    else:  # slot i of the block at a sits at a + i: keys t >= a + i - window + 1
        lowest = anchors[:, :, None] + slot - window + 1  # [B, A, bs]
        near = cols >= lowest[..., None]  # [B, A, bs, T]
        ctx = ((ctx & keep[:, :, None])[:, :, None] & near).flatten(1, 2)  # [B, Q, T]
    block = torch.arange(a, device=anchors.device).repeat_interleave(block_size)  # [Q]
    own = block[:, None] == block[None, :]  # [Q, Q]
    if window is not None:
        gap = (slot[:, None] - slot[None, :]).abs().repeat(a, a)  # [Q, Q]
        own = own & (gap <= window - 1)
    return torch.cat([ctx, own.expand(b, -1, -1)], dim=-1)[:, None]


ANCHORS = 64  # blocks per drafter pass in ``block_states``


def block_states(head, tokens: Tensor, states: Tensor, block_size: int) -> Tensor:
    """[L, bs, H]: row t holds the block anchored at ``tokens[t + 1]`` (its context: tokens
    ``0..t``), the final-normed states of its slots; the last row (no anchor) is zero.

    ``head``: a block drafter, ``head(ids, positions, states, context positions, mask)``;
    tokens [L]; states [L, n_ctx, H_target], the tapped states in ascending layer order.
    """
    n = tokens.numel()
    positions = torch.arange(n)[None]
    docs = torch.zeros(1, n, dtype=torch.long)
    aux = states.reshape(1, n, -1)
    out = torch.zeros(n, block_size, head.hidden_size)
    for lo in range(1, n, ANCHORS):
        anchors = torch.arange(lo, min(lo + ANCHORS, n))[None]  # a = t + 1
        keep = torch.ones_like(anchors, dtype=torch.bool)
        ids, pos = block_inputs(tokens[None], positions, anchors, block_size, head.mask_token_id)
        mask = block_mask(anchors, keep, docs, block_size, getattr(head, "sliding_window", None))
        slots = head(ids, pos, aux, positions, mask)[0]  # [A * bs, H]
        out[anchors[0] - 1] = slots.view(anchors.shape[1], block_size, -1)
    return out
