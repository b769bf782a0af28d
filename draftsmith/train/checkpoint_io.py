"""Checkpoints that are whole or absent, and a full disk in one line.

Lightning's ``TorchCheckpointIO`` saves through an fsspec transaction: the bytes go to a
``tempfile.mkstemp()`` file (under /tmp, often another filesystem) that is then *moved* onto
the checkpoint path. Across filesystems that move is a copy straight into ``last.ckpt``, so a
disk that fills up mid-copy leaves half a checkpoint under the name ``--ckpt_path last``
resumes from, and nothing is fsynced. :class:`AtomicCheckpointIO` writes ``<path>.tmp``
beside the target instead, fsyncs and renames it (``core/files.write_atomic``), where ENOSPC
and EFBIG become one ``DiskFullError`` line naming the path and the free space.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import Strategy

from draftsmith.core.files import write_atomic


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves go through ``write_atomic`` (remote paths
    keep Lightning's own transaction; loading is unchanged)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)  # refuses options
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f, digest: torch.save(checkpoint, f), what="checkpoint")


def save_atomically(strategy: Strategy) -> None:
    """Give ``strategy`` an :class:`AtomicCheckpointIO` where it would save with the plain
    ``TorchCheckpointIO`` (single process, DDP); sharded strategies (FSDP, DeepSpeed) and a
    checkpoint IO the user configured are left as they are."""
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
