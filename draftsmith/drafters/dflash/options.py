"""DFlash's ``model.*`` options."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.drafters.protocol.options import (
    BlockOptions,
    HeadOptions,
    WindowOptions,
    exclusive,
)


@dataclass
class DFlashOptions(HeadOptions, BlockOptions, WindowOptions):
    """A block of ``block_size`` slots drafted in one pass from the target's context."""

    block_size: int = 8
    """DFlash: slots per block, the anchor plus ``block_size - 1`` drafts (serve with
    ``num_speculative_tokens`` = block_size - 1)."""
    train_mask_embedding: bool | None = None
    """DFlash: learn the mask slots' input vector (exported as ``mask_embedding.pt``); null:
    unless the mask id is spare with a non-zero row."""
    loss_decay_gamma: float | None = None
    """DFlash: slot i >= 1 weighs ``exp(-(i - 1) / gamma)``; null: the paper's 7 / 5 / 4 for
    block sizes 16 / 10 / 8 and below."""
    loss_vocab_size: int | None = exclusive(None)
    """DFlash: score the training loss over the most frequent loss-masked tokens only (EOS
    kept), like an EAGLE-3 draft vocabulary: the loss's cost falls with it. Drafting and
    validation still use the full vocabulary. Null: all ids."""
