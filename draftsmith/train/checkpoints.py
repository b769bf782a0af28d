"""Reading a training checkpoint back: a ``.ckpt`` file, or a sharded directory.

A checkpoint written by ``draftsmith train`` carries, beside the weights, what the head needs
to be rebuilt without the dataset (``DraftModule.on_save_checkpoint``, under
``CHECKPOINT_KEY``): its kind, constructor arguments, target, tapped layer ids, the data
summary and the last validation metrics. Sharded checkpoints (directories) are consolidated
first: DeepSpeed ZeRO's, and FSDP's with ``state_dict_type: sharded``
(torch.distributed.checkpoint files plus Lightning's ``meta.pt``). Nothing in a checkpoint
can run code: only tensors, containers and ``SAFE_TYPES`` are unpickled.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from draftsmith import drafters
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.readers import ReadError, read_torch, refuse_foreign_pickle

CHECKPOINT_KEY = "draftsmith"
# What the pickles of sharded checkpoints may name (read with plain pickle by DeepSpeed and
# torch.distributed.checkpoint, so anything else is refused before they run).
PICKLED = ("torch.", "collections.", "builtins.", "deepspeed.", "lightning.", "pathlib.",
           "numpy.", "_codecs.encode", "argparse.Namespace")  # fmt: skip
FIX = "give a .ckpt file (or sharded checkpoint directory) that `draftsmith train` wrote"
FSDP_METADATA = "meta.pt"  # Lightning's file beside the shards of an FSDP sharded checkpoint
# Beyond tensors and containers, the only types a draftsmith checkpoint holds: Lightning's
# hyper-parameter dict and the paths its callbacks keep. Anything else is refused unread.
SAFE_TYPES = ("lightning.fabric.utilities.data.AttributeDict", "pathlib.PosixPath")


class CheckpointError(DraftsmithError):
    """A checkpoint that is missing, or was not written by ``draftsmith train``."""


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint on CPU; consolidate a sharded (DeepSpeed or FSDP) directory first."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint: {path} does not exist; train first or fix the path")
    if path.is_dir() and (path / FSDP_METADATA).is_file():
        ckpt = read_fsdp_sharded(path)
    elif path.is_dir():  # DeepSpeed ZeRO: shards of weights and optimizer states
        latest = path / "latest"
        tag = latest.read_text(errors="replace").strip() if latest.is_file() else ""
        if not tag or not (path / tag).is_dir():
            raise CheckpointError(
                f"checkpoint: {path} is a directory but neither a DeepSpeed checkpoint (a "
                "'latest' file naming a tag directory) nor a sharded FSDP one (meta.pt); "
                "give a .ckpt file "
                "`draftsmith train` wrote, or a sharded checkpoint directory"
            )
        from lightning.pytorch.utilities.deepspeed import (
            convert_zero_checkpoint_to_fp32_state_dict,
        )

        for states in sorted((path / tag).glob("*.pt")):  # DeepSpeed unpickles them fully
            refuse_foreign_pickle(states, "deepspeed checkpoint", FIX, PICKLED)
        with tempfile.TemporaryDirectory() as tmp:
            merged = Path(tmp) / "merged.ckpt"
            with damaged_shards(path):
                convert_zero_checkpoint_to_fp32_state_dict(str(path), str(merged))
            ckpt = load_file(merged, path)
    else:
        ckpt = load_file(path)
    if not isinstance(ckpt, dict) or CHECKPOINT_KEY not in ckpt:
        raise CheckpointError(
            f"checkpoint: {path} has no '{CHECKPOINT_KEY}' entry; it was not written by "
            "`draftsmith train` (a checkpoint from before its first validation has none either)"
        )
    return ckpt


def read_fsdp_sharded(path: Path) -> dict[str, Any]:
    """A checkpoint Lightning's FSDP wrote with ``state_dict_type: sharded``, as one dict:
    ``meta.pt`` (everything but tensors) plus the weights, merged on CPU without processes."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = load_file(path / FSDP_METADATA)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint: {path} has meta.pt but no .metadata; {FIX}")
    refuse_foreign_pickle(path / ".metadata", "fsdp checkpoint", FIX, PICKLED)  # plain pickle
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        with damaged_shards(path):
            dcp_to_torch_save(path, merged)  # {"model": state dict, "optimizer_0": ...}
        shards = load_file(merged, path)
    return {**ckpt, "state_dict": shards["model"]}


@contextlib.contextmanager
def damaged_shards(path: Path) -> Iterator[None]:
    """A sharded checkpoint whose files are damaged fails in the library that merges them,
    in many ways; each becomes one line naming the directory."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as err:
        problem = " ".join(str(err).split())[:160]
        raise CheckpointError(
            f"checkpoint: {path} cannot be merged ({type(err).__name__}: {problem}); a shard "
            f"is damaged or missing; {FIX}"
        ) from None


def _safe_types() -> list[type]:
    import importlib

    types = []
    for dotted in SAFE_TYPES:
        module, _, name = dotted.rpartition(".")
        types.append(getattr(importlib.import_module(module), name))
    return types


def load_file(path: Path, shown: Path | None = None) -> Any:
    """``torch.load`` that runs no code: tensors, containers and :data:`SAFE_TYPES` only.
    A file that is not a checkpoint, or that holds any other type (a pickle from elsewhere
    can run code when unpickled), is refused in one line naming it (``shown``: the path the
    user gave, where ``path`` is a consolidated copy of it)."""
    try:
        return read_torch(path, "checkpoint", FIX, allow=tuple(_safe_types()))
    except ReadError as err:
        raise CheckpointError(str(err).replace(str(path), str(shown or path), 1)) from None


def head_from_checkpoint(ckpt: dict[str, Any]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(the trained head, its ``draftsmith`` info) from a loaded checkpoint."""
    info = ckpt[CHECKPOINT_KEY]
    if info["kind"] not in drafters.KINDS:
        raise CheckpointError(
            f"checkpoint: head kind {info['kind']!r} is not one of {sorted(drafters.KINDS)}; "
            "retrain with this version of draftsmith"
        )
    state = {k[len("head.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("head.")}
    try:
        head = drafters.get(info["kind"]).rebuild(info, state)
    except ValueError as err:
        raise CheckpointError(f"checkpoint: {err}") from err
    return head, info
