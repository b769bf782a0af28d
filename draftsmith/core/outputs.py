"""One guard for every output path: a command never overwrites what it did not write.

Each command calls :func:`check_output` on each path it will write, before any work
starts. A path is accepted when it does not exist yet (and could be created), or when it
already holds what the same command writes there (``own``: names that only that command
leaves behind, so resuming into its own unfinished output keeps working). Anything else
is refused in one line naming the option, the path and the fix:

- a regular file where a directory goes (or a directory where a file goes),
- a path under a regular file (``FILE/sub``),
- a non-empty directory holding none of the command's own names,
- a directory the process cannot write to.

``overwrite=True`` (each command's ``--overwrite true``) is the explicit way past the
refusal of a foreign directory or file: files of the same names are replaced, and a file
in the way of a directory is deleted.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Callable
from pathlib import Path

from draftsmith.core.errors import ConfigError

OwnTest = tuple[str, ...] | Callable[[Path], bool]


class OutputError(ConfigError):
    """An output path that would overwrite what the command did not write."""


def check_output(
    path: str | Path,
    option: str,
    own: OwnTest = (),
    *,
    overwrite: bool = False,
    is_file: bool = False,
    overwrite_flag: str | None = "--overwrite true",
) -> Path:
    """Refuse ``path`` (the value of ``option``) unless writing there loses nothing.

    ``own`` is either glob patterns of entries only this command writes in its output
    directory (any one present makes the directory its own), or a test on the directory.
    ``is_file``: the output is one file (accepted if absent, or if ``own`` accepts it).
    ``overwrite_flag`` is how the command's user asks for overwriting (None: it cannot).
    Returns the path. Raises :class:`OutputError` in one line."""
    path = Path(path)
    flag = f"--{option}"
    fix = f"give another {flag}, " + (
        f"or add {overwrite_flag} to write over it" if overwrite_flag else "or delete it first"
    )
    if path.is_symlink() and not path.exists():
        raise OutputError(f"{option}: {path} is a broken symbolic link; {fix}")
    if path.exists():
        if is_file:
            if path.is_dir():
                raise OutputError(f"{option}: {path} is a directory, expected a file; {fix}")
            if not overwrite and not _owns(path, own):
                raise OutputError(
                    f"{option}: {path} is an existing file this command did not write; {fix}"
                )
            _writable(path.parent, option, path)
            return path
        if not path.is_dir():
            if not overwrite:
                raise OutputError(
                    f"{option}: {path} is an existing file, expected a directory; {fix} "
                    "(that deletes the file)"
                )
            path.unlink()
        elif not overwrite and any(path.iterdir()) and not _owns(path, own):
            names = sorted(p.name for p in path.iterdir())
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise OutputError(
                f"{option}: {path} is a non-empty directory ({shown}) that is not this "
                f"command's output; {fix}"
            )
        else:
            _writable(path, option, path)
            return path
    _creatable(path, option)
    return path


def _owns(path: Path, own: OwnTest) -> bool:
    if callable(own):
        return bool(own(path))
    if path.is_file():
        return any(fnmatch.fnmatch(path.name, pattern) for pattern in own)
    return any(fnmatch.fnmatch(p.name, pattern) for p in path.iterdir() for pattern in own)


def _creatable(path: Path, option: str) -> None:
    """The nearest existing ancestor of ``path`` must be a writable directory."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(
            f"{option}: {path} lies under {parent}, which is a file, not a directory; "
            f"give a --{option} outside it"
        )
    _writable(parent, option, path)


def _writable(directory: Path, option: str, path: Path) -> None:
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OutputError(
            f"{option}: {path} cannot be written ({directory} is not writable by this user); "
            f"give a --{option} in a directory you can write"
        )


def json_from(command: str) -> Callable[[Path], bool]:
    """An ``own`` test for a JSON result file: a dict whose ``"command"`` is ``command``."""

    def test(path: Path) -> bool:
        try:
            data = json.loads(path.read_bytes())  # a probe: unreadable means not ours
        except (OSError, ValueError):
            return False
        return isinstance(data, dict) and data.get("command") == command

    return test


def head_dir(path: Path) -> bool:
    """An ``own`` test for ``draftsmith export``: a head directory export wrote (its model
    card has the training sections export writes)."""
    if {p.name for p in path.iterdir()} <= {"stage.yaml", "export.log", ".done.json"}:
        return True  # the pipeline's record of the stage, written before export runs
    readme = path / "README.md"
    if not (path / "config.json").is_file() or not readme.is_file():
        return False
    try:
        return "Training config" in readme.read_text(errors="replace")
    except OSError:
        return False


# What each command leaves in its output directory (resuming into it stays possible).
EXTRACT_OWN = ("plan.json", "manifest.json", "extract.log", "shard-*", "replies", "stage.yaml")
EVAL_OWN = ("results.json", "report.md", "generations.jsonl", "eval.log", "stage.yaml")
PIPELINE_OWN = (
    "pipeline.json",
    "summary.md",
    "extract-*",
    "train-*",
    "head-*",
    "eval-*",
    "study.json",
    "study.md",
    "points",
)
TRAIN_ROOT_OWN = (
    "train.log",
    "lightning_logs",
    "checkpoints",
    "config.yaml",
    "wandb",
    "stage.yaml",
)
CHECKPOINTS_OWN = ("*.ckpt", "*.ckpt.tmp")
