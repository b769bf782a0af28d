"""One kind of error for what a user can fix, and the one place it becomes an exit code.

Library code raises a :class:`DraftsmithError` subclass whose message names the file or
option, the value and the fix. Only a stage's ``main`` turns it into one line on stderr
and exit status 2 (:func:`exit_code`); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class DraftsmithError(ValueError):
    """Bad input or configuration; the message says what to change."""


class ConfigError(DraftsmithError):
    """An option has a value that cannot work; the message names it and the fix."""


class DatasetError(DraftsmithError):
    """A dataset directory that is missing, unfinished, corrupt or of an unknown format."""


class DiskFullError(DraftsmithError):
    """A write failed for lack of space (ENOSPC) or a file-size limit (EFBIG); nothing half
    written is left, and the message names the path, the free space and the fix."""


def report(prog: str, err: BaseException) -> int:
    """Print ``err`` as one line naming the command; return the exit status 2."""
    message = " ".join(original_message(str(err)).split("\n"))
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return 2


def original_message(text: str) -> str:
    """The error's own words where a DataLoader worker re-raised it: torch puts "Caught X
    in DataLoader worker process 0. Original Traceback ..." and the worker's whole
    traceback before them, ending in ``module.X: message``."""
    if "Original Traceback" not in text:
        return text
    last = text.rstrip().rsplit("\nTraceback", 1)[-1].rsplit("\n", 1)[-1]
    name, sep, message = last.partition(": ")
    return message if sep and "Error" in name else last


def exit_code(prog: str, fn: Callable[[], int | None]) -> int:
    """Run ``fn``; a :class:`DraftsmithError` becomes one line on stderr and status 2."""
    try:
        return fn() or 0
    except DraftsmithError as err:
        return report(prog, err)
