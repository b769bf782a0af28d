"""The DataLoader over ``ShardBatches`` (``shard_order.py``): workers, pinning, resuming."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from draftsmith.train.shard_order import ShardBatches


class ShardLoader(DataLoader):
    """The DataLoader over ``ShardBatches``; its position goes into checkpoints.

    With ``num_workers`` W >= 1 the batches are read, packed and collated in W worker
    processes while the steps before train (on a GPU, reading in the training process would
    stall it); worker ``j % W`` reads batch j and the DataLoader takes them in turn, so any
    W gives the same batches in the same order (module docstring). ``on_stop`` is called
    in the training process after an epoch that the policy ends training with (drop)."""

    def __init__(
        self,
        batches: ShardBatches,
        batches_done: Callable[[], int],
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int = 2,
        worker_init_fn: Callable[[int], None] | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        if multiprocessing.get_start_method() != "fork":  # the batches hold the trainer's hooks
            num_workers = 0
        super().__init__(
            batches,
            batch_size=None,
            num_workers=num_workers,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor if num_workers else None,
            worker_init_fn=worker_init_fn if num_workers else None,
        )
        # What may be in flight per worker: its prefetched batches, one in the pin thread,
        # one training and one that Lightning fetched ahead.
        batches.pool_slots = prefetch_factor + 3 if num_workers else 0
        self.batches_done, self.on_stop = batches_done, on_stop

    def __iter__(self) -> Iterator[Any]:
        b: ShardBatches = self.dataset  # type: ignore[assignment]
        b.prepare(max(self.num_workers, 1))  # here, before the workers fork
        yield from super().__iter__()
        if b.stream is not None and b.stream.policy == "drop" and self.on_stop is not None:
            self.on_stop()

    def state_dict(self) -> dict[str, Any]:
        b: ShardBatches = self.dataset  # type: ignore[assignment]
        done = self.batches_done()
        return {"epoch": b.current_epoch(), "batches_done": done, **b.position(done)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        b: ShardBatches = self.dataset  # type: ignore[assignment]
        b.skip = state["batches_done"]  # the epoch comes back with Lightning's own loop
