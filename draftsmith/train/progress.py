"""Training progress on the terminal: one bar of optimizer steps, loss, tokens/s, time left.

Lightning's own bar writes to stderr, which a quiet stage sends to its log file; this one
writes where :func:`draftsmith.core.console.say` does. Under ``trainer.max_time`` the bar's
end is whichever comes first, the step count or the time cap.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Timer

from draftsmith.core.console import progress


class ConsoleProgress(Callback):
    """A ``draftsmith.core.console.progress`` bar over the fit's optimizer steps (rank 0 only)."""

    def __init__(self) -> None:
        self.bar = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        total_steps = getattr(pl_module, "total_steps", None)
        total = total_steps() if callable(total_steps) else None
        self.bar = progress(total, "train", unit="step", initial=trainer.global_step)

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
        self.bar.set_postfix(post, refresh=False)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
