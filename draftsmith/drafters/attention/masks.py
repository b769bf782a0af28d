"""Which keys a query of a packed row may see, as vLLM's draft attention lets it: never a
[T, T] tensor unless a caller asks for one.

A packed row holds documents back to back (``doc_ids`` [B, T], positions restarting at each
document, padding last as one more document), so inside a document a position difference is
a row-index difference. Query ``i`` sees key ``j`` when both are in one document, ``j <= i``
(causal) and, with a sliding window of ``w`` tokens, ``i + shift - j <= w - 1``.

The window is vLLM's (``v1/attention/backends``: FlashAttention's ``window_size = (w - 1,
0)``, the CPU kernel's ``sliding_window``, measured against ``cpu_attention_with_kv_cache``
2026-11-28): ``w`` keys including the query's own, by position in the sequence. A TTT step
``k`` query of stream ``t`` sits at position ``pos_t + k`` (``shift = k``), so its window over
the step-0 keys ends ``k`` earlier, and the keys steps 1..k wrote (positions ``pos_t + j``) are
seen while ``k - j <= w - 1`` (``diagonal_seen``). A non-causal block (DFlash) sees
``|i - j| <= w - 1`` (vLLM makes the window symmetric there).

``RowMask`` hands ``PrefixAttention`` one query block at a time: the first key the block can
see (``spans``) and the block's mask over the keys from there (``block``), so the memory of a
pass is O(block x T). ``DenseMask`` gives the same interface over an explicit mask.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from draftsmith.core.errors import ConfigError


def check_window(window: int | None, longest_draft: int, option: str, reach: str) -> None:
    """Refuse a window that does not cover the drafts themselves (``longest_draft``: the
    steps or slots after the one that reads the context), in one line naming ``option``."""
    if window is not None and window <= longest_draft:
        raise ConfigError(
            f"model.sliding_window: {window} must exceed {option} {longest_draft} ({reach}); "
            f"give at least {longest_draft + 1}, or null for full attention"
        )


def diagonal_seen(step: int, written: int, window: int | None) -> bool:
    """Whether the query of TTT step ``step`` sees the key step ``written`` wrote in its own
    stream (position ``written - step`` relative to it)."""
    return window is None or step - written <= window - 1


def doc_starts(doc_ids: Tensor) -> Tensor:
    """[B, T] -> [B, T] long: the row index where each token's document starts."""
    t = doc_ids.shape[1]
    idx = torch.arange(t, device=doc_ids.device).expand_as(doc_ids)
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(new, idx, 0).cummax(dim=1).values


class RowMask:
    """Document-causal attention over a packed row, with an optional sliding window (module
    docstring). doc_ids [B, T]; ``window`` in tokens (None: full); ``shift``: how many
    positions after its row index a query sits (TTT step k)."""

    def __init__(self, doc_ids: Tensor, window: int | None = None, shift: int = 0) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        self.doc_ids, self.window, self.shift = doc_ids, window, shift
        self.starts = doc_starts(doc_ids)  # [B, T]
        self.lowest = self.starts  # [B, T]: the first key each query sees
        if window is not None:
            rows = torch.arange(doc_ids.shape[1], device=doc_ids.device)
            self.lowest = torch.maximum(self.starts, rows + shift - window + 1)

    @property
    def size(self) -> int:
        return self.doc_ids.shape[1]

    def at_step(self, step: int) -> RowMask:
        """The mask of TTT step ``step``'s queries over the step-0 keys (the same without a
        window)."""
        if self.window is None or step == self.shift:
            return self
        return RowMask(self.doc_ids, self.window, step)

    def spans(self, block: int) -> Iterator[tuple[int, int, int]]:
        """(start, end, first): query blocks of ``block`` rows and the first key any query of
        the block sees (keys past ``end`` are never seen: causal)."""
        for start in range(0, self.size, block):
            end = min(start + block, self.size)
            yield start, end, int(self.lowest[:, start:end].min())

    def block(self, start: int, end: int, first: int) -> Tensor:
        """bool [B, 1, end - start, end - first]: queries start..end-1 over keys first..end-1."""
        keys = torch.arange(first, end, device=self.doc_ids.device)
        rows = torch.arange(start, end, device=self.doc_ids.device)
        seen = (keys[None, None] >= self.lowest[:, start:end, None]) & (
            keys[None, None] <= rows[None, :, None]
        )
        return seen[:, None]

    def dense(self) -> Tensor:
        """bool [B, 1, T, T]: the whole mask (the SDPA paths and tests)."""
        return self.block(0, self.size, 0)


class DenseMask:
    """``RowMask``'s interface over an explicit causal mask [B, 1, T, T] (true = attend)."""

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask

    @property
    def size(self) -> int:
        return self.mask.shape[-1]

    def spans(self, block: int) -> Iterator[tuple[int, int, int]]:
        for start in range(0, self.size, block):
            end = min(start + block, self.size)
            seen = self.mask[:, :, start:end, :end].any(dim=2).any(dim=0).any(dim=0)  # [end]
            first = int(seen.nonzero()[0]) if bool(seen.any()) else 0
            yield start, end, first

    def block(self, start: int, end: int, first: int) -> Tensor:
        return self.mask[:, :, start:end, first:end]

    def dense(self) -> Tensor:
        return self.mask


def as_mask(mask: Tensor | RowMask | DenseMask) -> RowMask | DenseMask:
    """A mask object from an explicit [B, 1, T, T] mask or one already."""
    return DenseMask(mask) if isinstance(mask, Tensor) else mask


def window_keys(query_pos: Tensor, key_pos: Tensor, window: int | None) -> Tensor:
    """bool: a query at position ``query_pos`` sees a key at ``key_pos`` through a causal
    window of ``window`` (broadcast shapes; None: every earlier key)."""
    if window is None:
        return torch.ones(torch.broadcast_shapes(query_pos.shape, key_pos.shape), dtype=torch.bool,
                          device=query_pos.device)  # fmt: skip
    return query_pos - key_pos <= window - 1
