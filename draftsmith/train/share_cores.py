"""Share one CPU machine's cores with a streamed run's producer.

On a CPU, vLLM's extraction and torch's training each run one OpenMP thread per core, and a
parallel region waits for its slowest thread: two processes computing on the same cores
slow each other several times over (``draftsmith.core.cores``). The pipeline therefore
gives its producer the upper half of the cores (``producer_cores``), and this callback
keeps training's threads to the other half while a producer on this machine is writing,
and widens them to every core while all of them wait for the trainer (the disk bound
reached), so no core idles in either phase.
"""

from __future__ import annotations

import time

import torch
from lightning.pytorch import Callback

from draftsmith.core.cores import allowed_cores
from draftsmith.dataset.stream import StreamDir

CHECK_S = 1.0  # how often the producers' heartbeats are read


class ShareCores(Callback):
    """Set torch's thread count before each training step from where the producers of
    ``dataset`` (on this host) compute now: the cores they do not use, or all of them."""

    def __init__(self, dataset: str) -> None:
        self.stream = StreamDir(dataset)
        self.cores = allowed_cores()
        self.threads = torch.get_num_threads()
        self.checked = 0.0
        self.switches = 0

    def threads_now(self) -> int:
        """How many threads training should use now."""
        free = self.cores - self.stream.busy_cores()
        return len(free) if free else len(self.cores)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.monotonic()
        if now - self.checked < CHECK_S:
            return
        self.checked = now
        threads = self.threads_now()
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads, self.switches = threads, self.switches + 1
