"""Batch buffers a loader worker reuses once the training process is done with them.

Reading into fresh memory costs more than the read: every 4 KiB page of a new shared
buffer is faulted in and zeroed, and at an 8B shape a batch is ~130 MB. Measured on the
2-core CPU machine, one pread of 128 MB from a warm page cache: 4-5 GB/s into a buffer
used before, 0.8-1.1 GB/s into a new one (anonymous or shared memory alike). So each worker
keeps ``slots`` batches of shared memory and fills a free one; the training process says
when it is done with a batch (``release``: once it is pinned and copied to the GPU, or
decoded into the drafters' batch on the CPU), and only then may the worker fill it again.

A batch the training process never releases (a test keeping batches in a list, a consumer
that does not know the pool) only costs the reuse: when a worker finds none of its slots
free it builds the batch in fresh memory, as before. The flags live in shared memory made
in the training process before the workers fork. The buffers are each worker's, made as it
needs them, or, with ``preallocate``, made and touched once in the training process: then
workers that are started again every epoch (the shard-order loader's) inherit them, and no
epoch's first batches pay for fresh memory (in bench-loader's 12-batch epochs at the 8B
shape, every batch did).
"""

from __future__ import annotations

import itertools
import multiprocessing
import weakref

import torch
from torch import Tensor
from torch.utils.data import get_worker_info

SLOT_KEY = "pool_slot"  # long [2] in a pooled batch: (pool, slot); absent otherwise
_POOLS: weakref.WeakValueDictionary[int, BatchPool] = weakref.WeakValueDictionary()
_IDS = itertools.count()
Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""A batch's buffers: name -> (shape, dtype)."""


class BatchPool:
    """``slots`` reusable batches per worker of one loader (flags: 1 while handed out).
    Made in the training process, before the workers fork."""

    def __init__(self, workers: int, slots: int) -> None:
        self.workers, self.slots = max(workers, 1), slots
        self.busy = multiprocessing.Array("b", self.workers * slots, lock=False)
        self._buffers: dict[int, dict[str, Tensor]] = {}  # this worker's, by slot
        self.id = next(_IDS)
        _POOLS[self.id] = self

    def take(self, shapes: Shapes) -> dict[str, Tensor] | None:
        """Buffers of the given shapes: a free slot's (reused where its shapes match) in a
        worker; None outside one or when every slot of this worker is handed out."""
        worker = get_worker_info()
        if worker is None or self.slots == 0:
            return None
        mine = range(worker.id * self.slots, (worker.id + 1) * self.slots)
        free = [k for k in mine if not self.busy[k]]
        # A slot that already holds buffers first: new memory only when none is free.
        free.sort(key=lambda k: k not in self._buffers)
        for slot in free[:1]:
            buffers = self._buffers.get(slot)
            if buffers is None or not fits(buffers, shapes):
                buffers = {name: shared(shape, dtype) for name, (shape, dtype) in shapes.items()}
                self._buffers[slot] = buffers = self._label(buffers, slot)
            self.busy[slot] = 1
            # A batch of fewer rows (a shard's last) fills the first rows of the slot's.
            return {k: v if k == SLOT_KEY else v[: shapes[k][0][0]] for k, v in buffers.items()}
        return None

    def preallocate(self, shapes: Shapes) -> None:
        """Every slot's buffers, made and touched here in the training process before the
        workers fork (they inherit them); a slot whose batch differs gets fresh buffers."""
        for slot in range(self.workers * self.slots):
            if slot not in self._buffers:
                buffers = {name: shared(shape, dtype) for name, (shape, dtype) in shapes.items()}
                for t in buffers.values():
                    t.view(torch.uint8).zero_()  # fault the pages in once, here
                self._buffers[slot] = self._label(buffers, slot)

    def _label(self, buffers: dict[str, Tensor], slot: int) -> dict[str, Tensor]:
        buffers[SLOT_KEY] = shared((2,), torch.long)
        buffers[SLOT_KEY][0], buffers[SLOT_KEY][1] = self.id, slot
        return buffers

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_buffers": {}}


def fits(buffers: dict[str, Tensor], shapes: Shapes) -> bool:
    """Whether a slot's buffers can hold a batch of ``shapes``: the same tensors, dtypes and
    row shapes, and at least as many rows."""
    return set(buffers) - {SLOT_KEY} == set(shapes) and all(
        buffers[name].dtype == dtype
        and buffers[name].shape[1:] == shape[1:]
        and buffers[name].shape[0] >= shape[0]
        for name, (shape, dtype) in shapes.items()
    )


def release(batch: dict[str, Tensor]) -> None:
    """The training process is done with ``batch``'s buffers: their worker may refill them.
    A batch from no pool (or a pool gone with its loader) is left alone."""
    slot = batch.get(SLOT_KEY)
    if slot is None:
        return
    pool = _POOLS.get(int(slot[0]))
    if pool is not None:
        pool.busy[int(slot[1])] = 0


def shared(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialised tensor in shared memory (what ``default_collate`` stacks into in a
    worker): handing it to the training process copies nothing."""
    numel = 1
    for d in shape:
        numel *= d
    elem = torch.empty(0, dtype=dtype)
    return elem.new(elem._typed_storage()._new_shared(numel, device="cpu")).view(shape)


def detach_from(out: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """``out`` with every tensor that shares memory with ``batch``'s cloned, so that the
    batch's buffers can be released while ``out`` trains."""
    ptrs = {v.untyped_storage().data_ptr() for v in batch.values()}
    return {k: v.clone() if v.untyped_storage().data_ptr() in ptrs else v for k, v in out.items()}
