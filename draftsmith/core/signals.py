"""SIGTERM, as SLURM, spot machines and ``timeout`` send it: stop soon, keep what is whole.

A stage stopped by SIGTERM ends in one line saying what it kept and how to go on, and exits
with status 143 (128 + 15, what a shell reports for a process SIGTERM killed, so schedulers
that requeue on it still see a preemption rather than a success or a usage error).

The train stage lets Lightning turn the signal into a flag checked between steps
(``train/preemption.py``); extraction has no step short enough to wait for, so inside
:func:`sigterm_raises` the signal raises :class:`Terminated` in the main thread at once.
Every write goes through ``core/files.write_atomic``, so what is cut short leaves no file.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

EXIT_SIGTERM = 128 + signal.SIGTERM  # 143


class Terminated(BaseException):
    """Raised by SIGTERM inside :func:`sigterm_raises`. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way swallows it."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`Terminated` in the main thread; later ones
    are ignored while it unwinds (engines shut down, tmp files go). A no-op off the main
    thread, where Python cannot install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop: cleanup runs to its end
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def ignore_first_sigterm() -> None:
    """For child processes whose parent shuts them down (DataLoader workers): the first
    SIGTERM, sent to the whole process group, is the parent's to act on and is ignored
    here; a second one (``multiprocessing``'s ``terminate()`` of a worker the parent could
    not stop otherwise, as at its exit) ends the process as SIGTERM always does."""

    def first(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, first)
