"""Reading a sample's stored bytes straight into the caller's buffers.

The training loader reads each sample with one ``pread`` per tensor range, into the batch
it is building (no memory map, no intermediate copy), and checks the sample's xxh3-64
(``shards.sample_digest``) on the bytes it has just read: at several GB/s a core it costs
a fraction of the read, where a sha256 of the whole shard cost a second pass over the file
at ~0.3-1 GB/s. ``will_need`` asks the kernel to start reading the samples a reader takes
next, so a cold read keeps the disk busy while the CPU copies and hashes.

Where the time goes is counted by ``PHASES`` when a benchmark turns it on (``bench-loader``
prints the breakdown): ``read`` (the preads, page faults of fresh batch memory included),
``checksum``, and whatever the callers time under other names.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


class Phases:
    """Seconds per phase of the data path, summed in this process while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.on:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def reset(self, on: bool) -> None:
        self.on, self.seconds = on, {}


PHASES = Phases()


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bf16 and fp8
    included): what ``pread`` fills and ``xxhash`` reads."""
    if not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill ``view`` from the file at ``offset`` (several reads where the kernel returns
    fewer bytes); a file that ends first is refused in one line naming it."""
    done, size = 0, view.nbytes
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise_short(path, offset + done, size - done)
        done += got


def raise_short(path: Path, offset: int, missing: int) -> None:
    from draftsmith.core.errors import DatasetError

    raise DatasetError(
        f"{path}: ended {missing} bytes short of offset {offset + missing}; the shard was "
        "cut or replaced while training read it. Re-extract it (`draftsmith extract "
        "--repair true` with the same --output)"
    )


def will_need(fd: int, ranges: list[tuple[int, int]]) -> None:
    """Ask the kernel to read ``(offset, length)`` ranges ahead (``POSIX_FADV_WILLNEED``:
    asynchronous readahead); nothing where the OS has no ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return
    for offset, length in ranges:
        if length > 0:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


class OpenFiles:
    """Read-only file descriptors of a process, reopened after a fork, at most ``limit``
    (least recently used closed first)."""

    def __init__(self, limit: int = 128) -> None:
        self.limit = limit
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def get(self, key: int, path: Path) -> int:
        if self._pid != os.getpid():  # a forked worker: its own descriptors
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.pop(key, None)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            if len(self._fds) >= self.limit:
                os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[key] = fd  # most recent last
        return fd

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds = {}

    def __getstate__(self) -> dict:
        return {"limit": self.limit, "_fds": {}, "_pid": -1}
