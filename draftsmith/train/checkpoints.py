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

import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from draftsmith import drafters
from draftsmith.core.errors import DraftsmithError

CHECKPOINT_KEY = "draftsmith"
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

        with tempfile.TemporaryDirectory() as tmp:
            merged = Path(tmp) / "merged.ckpt"
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

    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(path, merged)  # {"model": state dict, "optimizer_0": ...}
        shards = load_file(merged, path)
    ckpt = load_file(path / FSDP_METADATA)
    return {**ckpt, "state_dict": shards["model"]}


def _safe_types() -> list[type]:
    import importlib

    types = []
    for dotted in SAFE_TYPES:
        module, _, name = dotted.rpartition(".")
        types.append(getattr(importlib.import_module(module), name))
    return types


def load_file(path: Path, shown: Path | None = None) -> Any:
    """``torch.load`` that runs no code: ``weights_only=True`` with :data:`SAFE_TYPES`
    allowed. A file that is not a checkpoint, or that holds any other type (a pickle from
    elsewhere can run code when unpickled), is refused in one line naming it."""
    shown = shown or path
    try:
        with torch.serialization.safe_globals(_safe_types()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = next((line for line in str(err).splitlines() if "GLOBAL" in line), "")
        if found:
            raise CheckpointError(
                f"checkpoint: {shown} holds a type draftsmith does not load "
                f"({found.strip()}); only tensors, containers and {list(SAFE_TYPES)} are "
                "read, so a checkpoint cannot run code; export checkpoints `draftsmith train` "
                "wrote"
            ) from err
        raise CheckpointError(
            f"checkpoint: {shown} is not a readable checkpoint ({err}); give a .ckpt file "
            "`draftsmith train` wrote"
        ) from err
    except Exception as err:  # a damaged or foreign file fails in many ways; all are one line
        problem = str(err).splitlines()[0] if str(err) else ""
        problem = f"{type(err).__name__}: {problem}" if problem else type(err).__name__
        raise CheckpointError(
            f"checkpoint: {shown} is not a readable checkpoint ({problem}); give a .ckpt "
            "file `draftsmith train` wrote"
        ) from err


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
