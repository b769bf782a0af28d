"""Memory the data path runs into: the page cache, and the C allocator's freed memory.

Page cache, for benchmarks that read from a cold one: ``evict`` asks the kernel to drop a
file's cached pages (``posix_fadvise`` DONTNEED after ``fsync``, so no page is dirty and
every one can go); no root is needed, unlike ``/proc/sys/vm/drop_caches``. The kernel may
keep pages anyway (tmpfs keeps all of them: its pages are the file), so
``resident_fraction`` asks ``mincore`` what is still cached.

Allocator: ``keep_freed_memory`` makes glibc serve large allocations from its heap and
keep what is freed, so that buffers allocated and freed once per batch do not fault every
page in again (see its docstring for the measurement).

All of these are Linux (glibc) facilities: elsewhere ``evict`` and ``keep_freed_memory``
do nothing and ``resident_fraction`` answers None.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable
from pathlib import Path


def evict(paths: Iterable[Path]) -> bool:
    """Drop each file's pages from the page cache; False where the OS has no fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def warm(paths: Iterable[Path], chunk: int = 1 << 24) -> None:
    """Read every byte of each file once, so that its pages are cached."""
    buf = bytearray(chunk)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt (malloc.h)


def map_large_allocations(threshold: int = 1 << 16) -> bool:
    """Map every allocation of ``threshold`` bytes or more afresh and unmap it when freed.

    A threshold set explicitly stays put (glibc otherwise raises it to the size of each
    mapped block freed, up to 32 MiB, and keeps later blocks of that size in its heap), so
    the resident set follows the memory in use: ``bench.memory`` reads peaks from it.
    Returns False where the C library has no ``mallopt`` (not glibc).
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1


def keep_freed_memory() -> bool:
    """Serve every allocation from glibc's heap and never give freed memory back.

    glibc maps each allocation over its mmap threshold (at most 32 MiB) afresh and unmaps
    it when freed, so a process that allocates and frees ~100 MB buffers per batch (a
    packed row at an 8B shape) page-faults in every page of them each time. Measured on
    the loader at the Llama-3.1-8B shape, one process, warm cache: ~750k minor faults and
    three quarters of the time in the kernel per pass; with this, ~0 and 2.5x the tokens/s.

    The cost: the process keeps its heap, and holes left between buffers of varying sizes
    make it settle above the peak in use. Measured per worker at that shape: 0.5-1.5 GB
    with bf16 storage; with fp8 (larger float32 decode buffers) 1.5 GB after one epoch,
    2.2 GB after 30, still creeping slowly. Call it in DataLoader workers, whose one job is
    this loop. Returns False where the C library has no ``mallopt`` (not glibc).
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1
    ok &= libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1  # the largest an int says
    return bool(ok)


def resident_fraction(paths: Iterable[Path]) -> float | None:
    """Share of the files' pages now in the page cache (0..1); None where unknown.

    Maps each file privately (copy-on-write, so the buffer is writable for ctypes; nothing
    is written) and asks ``mincore`` per page; mapping touches no page.
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mincore"):
        return None
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.mincore.restype = ctypes.c_int
    page = mmap.PAGESIZE
    resident = total = 0
    for path in paths:
        size = Path(path).stat().st_size
        if size == 0:
            continue
        pages = -(-size // page)
        vec = (ctypes.c_ubyte * pages)()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
            anchor = ctypes.c_char.from_buffer(m)
            try:
                rc = libc.mincore(ctypes.addressof(anchor), size, vec)
            finally:
                del anchor  # release the export before the map closes
        if rc != 0:
            return None
        resident += sum(b & 1 for b in vec)
        total += pages
    return resident / total if total else None
