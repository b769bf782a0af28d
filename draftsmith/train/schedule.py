"""The optimizer and learning-rate schedule of a draft head: AdamW, warm-up, then a cosine.

A run is capped by steps or by time (``trainer.max_time``, what the pipeline's budget sets).
The cosine follows whichever cap is nearer, so a time-capped run still ends its schedule at
``min_lr_ratio`` instead of being cut off at a high learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch


def lr_factor(
    step: int, warmup: int, total: int, min_ratio: float, time_done: float = 0.0
) -> float:
    """Learning-rate multiplier: linear warm-up over ``warmup`` steps, then a cosine from 1
    to ``min_ratio`` over the rest of ``total`` steps, or of the time cap when ``time_done``
    (its spent fraction, 0..1) is further along."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = max((step - warmup) / max(total - warmup, 1), time_done)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def adamw_with_schedule(
    params: Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
    time_progress: Callable[[], float] = lambda: 0.0,
) -> dict:
    """Lightning's ``configure_optimizers`` answer: AdamW (betas 0.9, 0.95) stepped per
    optimizer step by ``lr_factor``; ``time_progress()`` is the spent fraction of a time cap."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    total = max(total_steps, 1)
    warmup = min(warmup_steps, max(total - 1, 0))

    def factor(step: int) -> float:
        return lr_factor(step, warmup, total, min_lr_ratio, time_progress())

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
