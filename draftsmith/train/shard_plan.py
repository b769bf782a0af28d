"""Which shards a rank trains in shard order, and how their rows fall into batches.

``Pass`` is what the loader workers of one rank share during a pass. ``ShardPlan``
computes a shard's packed rows and batch count from its sidecar (or manifest entry) alone,
so every loader worker, and a resumed run, derive the same schedule without reading
states. ``shard_order.py`` walks it.
"""

from __future__ import annotations

import math
import multiprocessing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.dataset import HiddenStatesDataset
from draftsmith.dataset.stream import sidecar
from draftsmith.train.packing import pack

SEED_STRIDE = 1_000_003  # keeps (seed, shard) seeds apart


class Pass:
    """What the loader workers of one rank share during one pass over its shards (made in
    the training process before the workers fork; fresh every epoch)."""

    TOKENS, TRAIN_S, WAITED_S, SHARDS, ENDED = range(5)  # ``stats`` slots

    def __init__(self, shards: int, workers: int) -> None:
        self.workers = workers
        self.lock = multiprocessing.Lock()
        self.finished = multiprocessing.Array("i", shards, lock=False)
        """Per planned shard of the rank (by position): workers done with it this pass."""
        self.stats = multiprocessing.Array("d", 5, lock=False)
        """Tokens read, seconds reading (summed over workers), seconds waiting for shards
        (summed), shards done, workers ended."""

    def add(self, slot: int, value: float) -> float:
        with self.lock:
            self.stats[slot] += value
            return self.stats[slot]


def shard_seed(seed: int, shard: int, epoch: int = 0) -> int:
    return (seed * SEED_STRIDE + shard) * 1009 + epoch


@dataclass
class ShardPlan:
    """Which shards a rank trains and how its rows fall into batches."""

    root: Path
    shards: list[int]
    """Planned shard indices this rank trains, in order."""
    all_shards: list[int]
    """Every planned shard (all ranks)."""
    row_tokens: int
    batch_size: int
    seed: int
    val_ids: set[str] = field(default_factory=set)
    """Validation samples: never trained (their shards are never deleted)."""
    listed: dict[int, dict[str, Any]] | None = None
    """Offline: each shard's manifest entry (a dataset may have no sidecars); None when
    streaming (the sidecars, written as shards arrive)."""
    manifest: dict[str, Any] | None = None
    """The dataset's manifest without its shard list: each shard opened for reading takes
    it instead of parsing manifest.json again (None: it is read)."""

    def info(self, index: int) -> dict[str, Any] | None:
        """What is recorded about shard ``index`` (None: not written yet)."""
        if self.listed is not None:
            return self.listed.get(index)
        return sidecar(self.root, index)

    def train_lengths(self, index: int, info: dict[str, Any]) -> list[int]:
        """Token counts of shard ``index``'s training samples, from its sidecar (no states
        read; a deleted shard's sidecar still has them)."""
        lengths = info.get("sample_tokens")
        if lengths is None:  # written before sidecars recorded lengths: read the header
            lengths = one_shard(self.root, info, manifest=self.manifest).lengths
        return [n for n, sid in zip(lengths, info["sample_ids"], strict=True)
                if sid not in self.val_ids]  # fmt: skip

    def rows(self, index: int, info: dict[str, Any]) -> list[list[int]]:
        """Shard ``index``'s packed rows (training-sample positions among its training
        samples), in packing order."""
        return pack(self.train_lengths(index, info), self.row_tokens, shard_seed(self.seed, index))

    def batches(self, index: int, info: dict[str, Any]) -> int:
        return math.ceil(len(self.rows(index, info)) / self.batch_size)

    def holds_validation(self, info: dict[str, Any]) -> bool:
        return any(sid in self.val_ids for sid in info["sample_ids"])


def one_shard(
    root: Path,
    info: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    check: bool = False,
    manifest: dict[str, Any] | None = None,
) -> HiddenStatesDataset:
    return HiddenStatesDataset(root, dtype, check_shards=check, shard_infos=[info],
                               manifest=manifest)  # fmt: skip
