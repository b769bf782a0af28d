"""Training progress on the terminal: one bar of optimizer steps, loss, tokens/s, time left.

Lightning's own bar writes to stderr, which a quiet stage sends to its log file; this one
writes where :func:`draftsmith.core.console.say` does. Under ``trainer.max_time`` the bar's
end is whichever comes first, the step count or the time cap (the steps the cap leaves at
the rate so far), so its time left is the run's.
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Timer

from draftsmith.core.console import progress


class ConsoleProgress(Callback):
    """A ``draftsmith.core.console.progress`` bar over the fit's optimizer steps (rank 0 only)."""

    def __init__(self) -> None:
        self.bar = None
        self.planned: int | None = None
        self.start: tuple[float, int] = (0.0, 0)  # (time, global step) at the fit's start

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        total_steps = getattr(pl_module, "total_steps", None)
        self.planned = total_steps() if callable(total_steps) else None
        self.start = (time.monotonic(), trainer.global_step)
        self.bar = progress(self.planned, "train", unit="step", initial=trainer.global_step)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self.bar is None:
            return
        self.bar.update(trainer.global_step - self.bar.n)
        metrics = trainer.callback_metrics
        post = {}
        if "loss" in metrics:
            post["loss"] = f"{float(metrics['loss']):.3f}"
        if "train/tokens_per_s" in metrics:
            post["tok_s"] = f"{float(metrics['train/tokens_per_s']):,.0f}"
        if "val/acceptance_length" in metrics:
            post["val_AL"] = f"{float(metrics['val/acceptance_length']):.3f}"
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        left = timer.time_remaining("train") if timer is not None else None
        if left is not None:
            post["cap_left"] = f"{left / 60:.1f}min"
            self.bar.total = capped_total(self.planned, trainer.global_step, left, self.start)
        self.bar.set_postfix(post, refresh=False)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def capped_total(planned: int | None, step: int, left_s: float, start: tuple[float, int]) -> int:
    """The step the time cap ends at, at the step rate since ``start`` (time, step); never
    past ``planned``."""
    t0, step0 = start
    elapsed, done = time.monotonic() - t0, step - step0
    if done <= 0 or elapsed <= 0:
        return planned if planned is not None else step
    projected = step + int(left_s * done / elapsed)
    return min(planned, projected) if planned is not None else projected
