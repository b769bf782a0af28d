"""Files that are whole or absent: atomic writes with a streaming sha256, and checksums.

Every stage writes its records (manifests, markers, results), its shards and the train
stage's checkpoints through here, so a crash leaves the previous file or none, never half of
one. A full disk (ENOSPC) or a file-size limit (EFBIG) becomes :class:`DiskFullError`: one
line naming the path and the free space (:func:`disk_full`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO

from draftsmith.core.errors import DiskFullError

DISK_FULL = (errno.ENOSPC, errno.EFBIG)  # no space left; file larger than the system allows


def write_atomic(path: Path, write: Any, what: str) -> tuple[str, int]:
    """Run ``write(file, sha256)`` into ``<path>.tmp``, fsync, rename to ``path``.

    Returns ``(sha256 hex, size in bytes)``. On failure the tmp file is removed and no
    file appears at ``path``; a full disk raises :class:`DiskFullError`, any other
    ``OSError`` is re-raised with a message naming ``path``.
    """
    tmp = path.with_name(path.name + ".tmp")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            write(f, digest)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if (full := _disk_full_cause(exc)) is not None:
            raise disk_full(path, full, what) from exc
        if isinstance(exc, OSError):
            reason = exc.strerror or str(exc)
            raise OSError(exc.errno, f"could not write {what} {path}: {reason}") from exc
        raise
    fsync_dir(path.parent)
    return digest.hexdigest(), size


def _disk_full_cause(exc: BaseException | None) -> OSError | None:
    """The ENOSPC/EFBIG ``OSError`` behind ``exc``, if any: writers that call ``f.write``
    from C (``torch.save``'s zip writer) raise their own error from it."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def disk_full(path: Path, exc: OSError, what: str) -> DiskFullError:
    """The one-line error for ``exc`` (ENOSPC or EFBIG) while writing ``what`` at ``path``."""
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**30:.2f} GiB free"
    except OSError:
        free = "free space unknown"
    reason = exc.strerror or os.strerror(exc.errno or 0)
    return DiskFullError(
        f"could not write {what} {path}: {reason} ({free} on {path.parent}); nothing half "
        "written was kept: free space there (or write to a larger disk), then run the same "
        "command again"
    )


def fsync_dir(directory: Path) -> None:
    """Make a rename durable; a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` via a fsynced tmp file and a rename."""
    data = (json.dumps(obj, indent=2) + "\n").encode()

    def write(f: BinaryIO, digest: Any) -> None:
        f.write(data)

    write_atomic(Path(path), write, what="file")


def sha256_file(path: Path | str, chunk_size: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in ``chunk_size`` chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
