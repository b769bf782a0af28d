"""The vocabulary maps drafters share: a reduced draft vocabulary, and a mask token.

- ``draft_vocab``: the target ids an EAGLE-3 head drafts over (``d2t`` maps them back), or
  that DFlash's ``loss_vocab_size`` scores: the most frequent loss-masked ids, EOS kept.
- ``choose_mask_token``: the token id of the mask slots of block drafters (DFlash, P-EAGLE):
  ``model.mask_token_id`` when given; else the first id past the tokenizer when the target's
  vocabulary is padded beyond it (a spare id no text ever produces); else the highest id
  that never occurs as a response token in the dataset.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import TargetInfo


class TokenCounts(Protocol):
    """What the vocabulary choices read of the training data (the data module)."""

    def train_token_counts(self, vocab_size: int) -> Tensor:
        """How often each id is a loss-masked token in the training split, long [vocab]."""
        ...


def default_draft_vocab_size(vocab_size: int) -> int:
    """Full vocabulary up to 32k ids; 32k above (Llama-3's 128k, Qwen's 151k)."""
    return min(vocab_size, 32_000)


def draft_vocab(counts: Tensor, size: int, always: list[int] | None = None) -> Tensor:
    """The ``size`` target ids of the draft vocabulary, ascending: every id in ``always``
    (e.g. EOS / end of turn), then the most frequent ids by ``counts`` [V], ties by lower id."""
    forced = list(dict.fromkeys(int(i) for i in always or []))
    if not 0 < size <= counts.numel() or len(forced) > size:
        raise ValueError(
            f"draft vocab size {size} must be in [1, {counts.numel()}] and >= the "
            f"{len(forced)} always-included ids"
        )
    if any(not 0 <= i < counts.numel() for i in forced):
        raise ValueError(f"always-included ids {forced} must be in [0, {counts.numel()})")
    order = torch.sort(counts, descending=True, stable=True).indices  # ties: lower id first
    chosen = torch.zeros(counts.numel(), dtype=torch.bool)
    chosen[forced] = True
    rest = order[~chosen[order]][: size - len(forced)]
    chosen[rest] = True
    return chosen.nonzero().squeeze(1)


def tokenizer_size(target: TargetInfo) -> int | None:
    """How many ids the target's tokenizer has (None when it cannot be read)."""
    from draftsmith.core.readers import ReadError
    from draftsmith.core.targets import load_tokenizer

    try:
        return len(load_tokenizer(target.path))
    except ReadError:  # no tokenizer files: no spare id is known
        return None


def choose_mask_token(
    target: TargetInfo, dm: TokenCounts | None, requested: int | None
) -> tuple[int, bool]:
    """(mask token id, whether it is a spare id past the tokenizer); module docstring."""
    vocab = target.vocab_size
    if requested is not None:
        if not 0 <= requested < vocab:
            raise ConfigError(
                f"model.mask_token_id: {requested} is outside the target's vocabulary "
                f"0..{vocab - 1}; give an id in it or null to choose one"
            )
        n = tokenizer_size(target)
        return requested, n is not None and requested >= n
    n = tokenizer_size(target)
    if n is not None and n < vocab:
        return n, True
    counts = dm.train_token_counts(vocab)
    unused = (counts == 0).nonzero().flatten()
    return int(unused[-1] if unused.numel() else counts.argmin()), False
