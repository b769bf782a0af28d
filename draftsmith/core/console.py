"""A quiet terminal: what a stage does goes to the user, what its libraries say to a file.

A stage runs inside :func:`stage_log`: the process's stdout and stderr (file descriptors
1 and 2, so vLLM's engine processes, Lightning and Python warnings too) go to a log file
in the stage's directory, while :func:`say` and :func:`progress` still reach the terminal.
``--verbose`` on the ``draftsmith`` command, or ``DRAFTSMITH_VERBOSE=1``, shows everything
live instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

VERBOSE_ENV = "DRAFTSMITH_VERBOSE"

_terminal: TextIO | None = None  # the real stdout while fds 1 and 2 point at a log file


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").lower() not in ("", "0", "false", "no")


def terminal() -> TextIO:
    """Where the user reads: the real stdout, even while a stage's logs go to a file."""
    return _terminal or sys.stdout


def say(*parts: object) -> None:
    """One line for the user (never redirected to a log)."""
    print(*parts, file=terminal(), flush=True)


def progress(total: int | None, desc: str, unit: str = "it", **kw):
    """A tqdm bar on the terminal: count, rate and time left."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=terminal(), dynamic_ncols=True, **kw)


def _writes_to_fd(stream: TextIO, fd: int) -> bool:
    try:
        return stream.fileno() == fd
    except (AttributeError, OSError, ValueError):
        return False


@contextlib.contextmanager
def _python_streams_to(log: TextIO) -> Iterator[None]:
    """Point sys.stdout/sys.stderr at ``log`` only where they do not write to fds 1 and 2
    (notebooks, pytest's capture). Where they do, the fd redirection already covers them,
    and loggers that keep a reference to them (vLLM's) never hold a file that closes."""
    with contextlib.ExitStack() as stack:
        if not _writes_to_fd(sys.stdout, 1):
            stack.enter_context(contextlib.redirect_stdout(log))
        if not _writes_to_fd(sys.stderr, 2):
            stack.enter_context(contextlib.redirect_stderr(log))
        yield


@contextlib.contextmanager
def stage_log(path: Path | str) -> Iterator[Path | None]:
    """Send fds 1 and 2 to ``path`` (appending) for the block; yield the log's path.

    Nested calls (a pipeline's stage inside the pipeline's own log) switch to the inner
    file and back. With ``--verbose`` nothing is redirected and None is yielded.
    """
    global _terminal
    if verbose():
        yield None
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    outer = _terminal
    if _terminal is None:  # keep the real terminal reachable for say()
        _terminal = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    with open(path, "a", buffering=1) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            with _python_streams_to(log):
                yield path
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            if outer is None and _terminal is not None:
                _terminal.close()
            _terminal = outer
