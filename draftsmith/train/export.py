"""`draftsmith export`: a training checkpoint -> a head directory vLLM serves.

A checkpoint written by ``draftsmith train`` carries, beside the weights, what the head needs
to be rebuilt without the dataset (``DraftModule.on_save_checkpoint``): its kind, constructor
arguments, target, tapped layer ids, the data summary and the last validation metrics.
Sharded checkpoints (directories) are consolidated first: DeepSpeed ZeRO's, and FSDP's with
``state_dict_type: sharded`` (torch.distributed.checkpoint files plus Lightning's ``meta.pt``).

    draftsmith export --checkpoint outputs/train/smollm2/checkpoints/best.ckpt \\
        --output outputs/heads/smollm2-eagle3
"""

from __future__ import annotations

import json
import pickle
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.config import parse_config
from draftsmith.core.console import say
from draftsmith.core.errors import DraftsmithError, exit_code
from draftsmith.core.targets import read_target
from draftsmith.drafters.dflash.export import export_dflash
from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.headfiles import HEADS, export_head
from draftsmith.train.module import CHECKPOINT_KEY

FSDP_METADATA = "meta.pt"  # Lightning's file beside the shards of an FSDP sharded checkpoint
# Beyond tensors and containers, the only types a draftsmith checkpoint holds: Lightning's
# hyper-parameter dict and the paths its callbacks keep. Anything else is refused unread.
SAFE_TYPES = ("lightning.fabric.utilities.data.AttributeDict", "pathlib.PosixPath")


class CheckpointError(DraftsmithError):
    """A checkpoint that is missing, or was not written by ``draftsmith train``."""


@dataclass
class ExportConfig:
    """Write a trained head as a directory that vLLM loads (``speculative_config`` or
    ``vllm serve DIR``)."""

    checkpoint: str
    """A ``.ckpt`` file written by ``draftsmith train`` (or a DeepSpeed / sharded FSDP
    checkpoint directory)."""
    output: str
    """Directory to write: config.json, model.safetensors, README.md (model card)."""
    num_speculative_tokens: int = 3
    """k that ``vllm serve DIR`` uses by default."""
    dtype: str = "bfloat16"
    """Weight dtype on disk: bfloat16, float16 or float32."""


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint on CPU; consolidate a sharded (DeepSpeed or FSDP) directory first."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint: {path} does not exist; train first or fix the path")
    if path.is_dir() and (path / FSDP_METADATA).is_file():
        ckpt = read_fsdp_sharded(path)
    elif path.is_dir():  # DeepSpeed ZeRO: shards of weights and optimizer states
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
    heads = {**HEADS, "dflash": DFlashDrafter}
    if info["kind"] not in heads:
        raise CheckpointError(
            f"checkpoint: head kind {info['kind']!r} is not one of {sorted(heads)}; retrain "
            "with this version of draftsmith"
        )
    head = heads[info["kind"]](**info["head_kwargs"])
    state = {k[len("head.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("head.")}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint: head weights do not fit: missing {missing}, unexpected {unexpected}"
        )
    return head, info


def export_checkpoint(cfg: ExportConfig) -> Path:
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if cfg.dtype not in dtypes:
        raise CheckpointError(f"dtype: {cfg.dtype!r} is not one of {sorted(dtypes)}")
    ckpt = read_checkpoint(cfg.checkpoint)
    head, info = head_from_checkpoint(ckpt)
    hparams = dict(ckpt.get("hyper_parameters", {}))
    card = {
        "Training data": info.get("data", {}),
        "Training config": {
            **hparams,
            "epochs": ckpt.get("epoch"),
            "steps": ckpt.get("global_step"),
        },
        "Metrics (validation, simulated in training)": info.get("metrics", {}),
        "Checkpoint": {"path": str(Path(cfg.checkpoint).absolute())},
    }
    if "draft_vocab_coverage" in info:
        card["Training data"] = {
            **card["Training data"],
            "draft_vocab_coverage": info["draft_vocab_coverage"],
        }
    write = export_dflash if info["kind"] == "dflash" else export_head
    return write(
        head,
        info["kind"],
        read_target(info["target"]),
        Path(cfg.output),
        layer_ids=info.get("layer_ids"),
        num_speculative_tokens=cfg.num_speculative_tokens,
        card=card,
        dtype=dtypes[cfg.dtype],
    )


def main(args: list[str] | None = None) -> int:
    prog = "draftsmith export"
    return exit_code(prog, lambda: run_stage(parse_config(ExportConfig, args, prog=prog)))


def run_stage(cfg: ExportConfig) -> int:
    out = export_checkpoint(cfg)
    say(f"exported: {out}  ({serve_hint(out)})")
    return 0


def serve_hint(head_dir: Path) -> str:
    """How vLLM serves the exported head: EAGLE heads name their target in their config
    (``vllm serve DIR``); a DFlash drafter is given to the target's server."""
    config = json.loads((Path(head_dir) / "config.json").read_text())
    if config.get("architectures") != ["DFlashDraftModel"]:
        return f"vllm serve {head_dir}, or speculative_config model={head_dir}"
    spec = f'{{"method": "dflash", "model": "{head_dir}", "num_speculative_tokens": K}}'
    return f"vllm serve TARGET --speculative-config '{spec}'"


if __name__ == "__main__":
    sys.exit(main())
