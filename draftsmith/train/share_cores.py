"""Share one CPU machine's cores with a streamed run's producer.

On a CPU, vLLM's extraction and torch's training each run one OpenMP thread per core, and a
parallel region waits for its slowest thread: two processes computing on the same cores
slow each other several times over (``draftsmith.core.cores``). The pipeline therefore
gives its producer the upper half of the cores (``producer_cores``), and this callback
keeps training's threads to the other half while a producer on this machine is writing,
and widens them to every core while all of them wait for the trainer (the disk bound
reached), so no core idles in either phase. ``RegainCores`` gives an unstreamed run the cores
another process was keeping busy when it started, once they are free.
"""

from __future__ import annotations

import os
import time

import torch
from lightning.pytorch import Callback

from draftsmith.core.console import say
from draftsmith.core.cores import allowed_cores, busy_between, cpu_ticks, regain_cores
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


class RegainCores(Callback):
    """A run that started beside a busy core (``avoid_busy_cores``) takes it back, with its
    threads, as soon as it is free: a minute's load at the start would otherwise halve a
    run of hours. Checked every ``every_s`` seconds between steps, from the cores' ticks
    since the last check (nothing waits)."""

    def __init__(self, every_s: float = 30.0, measure=None) -> None:
        self.every_s, self.checked, self.done = every_s, time.monotonic(), False
        self.last = cpu_ticks()
        self.measure = measure or self._since_last

    def _since_last(self) -> dict[int, float]:
        now = cpu_ticks()
        load, self.last = busy_between(self.last, now), now
        return load

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.monotonic()
        if self.done or now - self.checked < self.every_s:
            return
        self.checked = now
        if note := regain_cores(self.measure()):
            torch.set_num_threads(len(os.sched_getaffinity(0)))
            self.done = True
            say(f"train: {note}")
