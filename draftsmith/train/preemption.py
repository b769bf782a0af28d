"""A fit stopped by SIGTERM (SLURM, spot machines, ``timeout``) saves where it stands.

Lightning's signal connector only sets ``trainer.received_sigterm``; its loops raise
``SIGTERMException`` (a ``SystemExit``) after the training batch in flight, or in the
middle of validation. :class:`SaveOnSigterm` writes the last checkpoint at that point (in
``on_train_batch_end``, the same place ``every_n_train_steps`` checkpoints are written, so a
resume continues with the next batch exactly as an uninterrupted run would; in
``on_exception`` when the signal came during validation), and :func:`exit_on_sigterm` turns
the exception into one line on stderr and exit status 143 (``core/signals.py``).

DataLoader workers ignore the first SIGTERM (``packing.worker_init``): a signal sent to the
whole process group would otherwise kill them first and end the fit in their tracebacks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.signals import EXIT_SIGTERM


class SaveOnSigterm(Callback):
    """Save the last checkpoint when the fit is stopped by SIGTERM; the exception then
    carries ``saved = (global step, path or None, why not, is rank 0)`` for the report."""

    def __init__(self) -> None:
        self.step: int | None = None  # the global step a checkpoint was saved at
        self.path: str | None = None
        self.failed: str | None = None  # why the save failed (a full disk), if it did

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if trainer.received_sigterm:  # Lightning raises right after this batch's hooks
            self._save(trainer)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        if self.step != trainer.global_step:  # stopped in validation: not saved yet
            self._save(trainer)
        exception.saved = (trainer.global_step, self.path, self.failed, trainer.is_global_zero)

    def _save(self, trainer: Trainer) -> None:
        """Write ``last.ckpt`` the way the checkpoint callback does (so ``--ckpt_path last``
        finds it), or ``<default_root_dir>/last.ckpt`` without one."""
        callback = trainer.checkpoint_callback
        try:
            if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
                # Its own save of last.ckpt (private in Lightning 2.6): the path, versioning
                # and the state it records are then the ones a later save would use.
                done = callback._last_global_step_saved == trainer.global_step
                if not (done and callback.last_model_path):  # not saved at this step yet
                    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))
                self.path = callback.last_model_path
            else:
                root = getattr(callback, "dirpath", None) or trainer.default_root_dir
                self.path = str(Path(root) / "last.ckpt")
                trainer.save_checkpoint(self.path)
        except DraftsmithError as err:  # a full disk: say so in the one line
            self.failed, self.path = str(err), None
        self.step = trainer.global_step


def exit_on_sigterm(prog: str, fn: Callable[[], int]) -> int:
    """Run ``fn``; a fit stopped by SIGTERM becomes one line on stderr (rank 0) and 143."""
    try:
        return fn()
    except SIGTERMException as err:
        step, path, failed, rank_zero = getattr(err, "saved", (None, None, None, True))
        if not rank_zero:
            return EXIT_SIGTERM
        where = f" at step {step}" if step is not None else ""
        if path:
            line = f"checkpoint saved to {path}; resume with --ckpt_path {path}"
        else:
            line = f"no checkpoint saved ({failed or 'none was written'})"
        print(f"{prog}: stopped by SIGTERM{where}; {line}", file=sys.stderr, flush=True)
        return EXIT_SIGTERM
