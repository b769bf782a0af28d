"""P-EAGLE's attention mask one query block at a time, for the blockwise pass (long rows).

The same mask as ``parallel.parallel_mask`` (the real slots ``0..T-1`` causal in their
document, then ``num_masks`` mask slots per anchor, each seeing its anchor's document up to
the anchor and its block's earlier slots; a sliding window on every key), with
``masks.RowMask``'s interface, so ``blockwise.PrefixAttention`` computes it in O(block x
(T + Q)) memory: never the [T + Q, T + Q] tensor. The layout is causal in index order (a key
is never after its query), which is what the blockwise pass assumes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from draftsmith.drafters.attention.masks import RowMask


class ParallelMask:
    """P-EAGLE's mask over ``T + A * num_masks`` slots. anchors, keep: [B, A]
    (``walk.sample_anchors``); doc_ids [B, T]; ``window`` in tokens or None."""

    def __init__(
        self, anchors: Tensor, keep: Tensor, doc_ids: Tensor, num_masks: int, window: int | None
    ) -> None:
        self.rows = RowMask(doc_ids, window)  # the real slots
        self.t, self.m, self.window = doc_ids.shape[1], num_masks, window
        self.anchor = anchors.repeat_interleave(num_masks, dim=1)  # [B, Q]: each slot's anchor
        self.keep = keep.repeat_interleave(num_masks, dim=1)  # [B, Q]
        self.slot = torch.arange(num_masks, device=anchors.device).repeat(anchors.shape[1])  # [Q]
        lowest = self.rows.starts.gather(1, self.anchor)  # the anchor's document start
        if window is not None:  # slot i sits at a + 1 + i: keys t >= a + 2 + i - window
            lowest = torch.maximum(lowest, self.anchor + 2 + self.slot - window)
        # A mask slot that sees no context (anchor not kept) sees its own block only.
        block_start = self.t + torch.arange(self.slot.numel(), device=anchors.device) - self.slot
        self.lowest = torch.cat(
            [self.rows.lowest, torch.where(self.keep, lowest, block_start)], dim=1
        )  # [B, T + Q]: the first key each slot sees

    @property
    def size(self) -> int:
        return self.lowest.shape[1]

    def spans(self, block: int) -> Iterator[tuple[int, int, int]]:
        for start in range(0, self.size, block):
            end = min(start + block, self.size)
            yield start, end, int(self.lowest[:, start:end].min())

    def block(self, start: int, end: int, first: int) -> Tensor:
        """bool [B, 1, end - start, end - first]: slots start..end-1 over keys first..end-1."""
        dev = self.lowest.device
        keys = torch.arange(first, end, device=dev)  # [S]
        rows = torch.arange(start, end, device=dev)  # [R]
        real_key = keys < self.t
        seen = (keys >= self.lowest[:, start:end, None]) & (keys <= rows[:, None])  # [B, R, S]
        q = (rows - self.t).clamp(min=0)  # mask rows: their slot index
        anchor = self.anchor[:, q]  # [B, R]
        ctx = real_key & (keys <= anchor[..., None]) & self.keep[:, q, None]
        k = (keys - self.t).clamp(min=0)  # mask keys: their slot index
        own_block = ~real_key & ((q // self.m)[:, None] == (k // self.m)[None])  # [R, S]
        gap = self.slot[q][:, None] - self.slot[k][None]
        own = own_block & (gap >= 0)
        if self.window is not None:
            own = own & (gap <= self.window - 1)
        masked = seen & (ctx | own)  # mask rows: a context key or an earlier slot of the block
        real = seen & real_key  # real rows: their document's keys within the window
        return torch.where((rows >= self.t)[:, None], masked, real)[:, None]

    def dense(self) -> Tensor:
        """bool [B, 1, T + Q, T + Q]: ``parallel.parallel_mask``."""
        return self.block(0, self.size, 0)
