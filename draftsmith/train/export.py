"""`draftsmith export`: a training checkpoint -> a head directory vLLM serves.

The checkpoint is read by ``checkpoints.py``; its kind's ``export`` writes the directory
(``draftsmith.drafters``), so this command works for every registered kind.

    draftsmith export --checkpoint outputs/train/smollm2/checkpoints/best.ckpt \\
        --output outputs/heads/smollm2-eagle3

``--to speculators`` writes vllm-project/speculators' layout instead, for kinds that have one
(DSpark).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from draftsmith import drafters
from draftsmith.core.config import parse_config
from draftsmith.core.console import say
from draftsmith.core.errors import exit_code
from draftsmith.core.outputs import check_output, head_dir
from draftsmith.core.targets import read_target
from draftsmith.drafters.headfiles.read import read_head_config
from draftsmith.drafters.headfiles.windows import window_note
from draftsmith.train.checkpoints import CheckpointError, head_from_checkpoint, read_checkpoint


@dataclass
class ExportConfig:
    """Write a trained head as a directory that vLLM loads (``speculative_config`` or
    ``vllm serve DIR``)."""

    checkpoint: str
    """A ``.ckpt`` file written by ``draftsmith train`` (or a DeepSpeed / sharded FSDP
    checkpoint directory)."""
    output: str
    """Directory to write: config.json, model.safetensors, README.md (model card). An
    existing head directory export wrote is replaced; anything else is refused."""
    overwrite: bool = False
    """Replace `output` even if it is a file or a directory export did not write."""
    num_speculative_tokens: int = 3
    """k that ``vllm serve DIR`` uses by default."""
    dtype: str = "bfloat16"
    """Weight dtype on disk: bfloat16, float16 or float32."""
    to: Literal["vllm", "speculators"] = "vllm"
    """The layout: vllm (what vLLM loads with ``--speculative-config``), or speculators
    (vllm-project/speculators' format, ``vllm serve DIR`` alone; DSpark heads; an EAGLE-3
    export already carries the speculators block, ``draftsmith convert --to`` rewrites one)."""


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
    if "init_from" in info:  # the published head it was fine-tuned from
        card["Started from"] = info["init_from"]
    if "draft_vocab_coverage" in info:
        card["Training data"] = {
            **card["Training data"],
            "draft_vocab_coverage": info["draft_vocab_coverage"],
        }
    kind = drafters.get(info["kind"])
    if cfg.to not in kind.layouts:
        raise CheckpointError(
            f"to: {cfg.to!r}; {kind.name} heads are exported as {', '.join(kind.layouts)}: give "
            "one of those (an EAGLE-3 export already holds the speculators block)"
        )
    layout = {"to": cfg.to} if cfg.to != "vllm" else {}  # only kinds with layouts take it
    return kind.export(
        head,
        read_target(info["target"]),
        Path(cfg.output),
        layer_ids=info.get("layer_ids"),
        num_speculative_tokens=cfg.num_speculative_tokens,
        card=card,
        dtype=dtypes[cfg.dtype],
        **layout,
    )


def main(args: list[str] | None = None) -> int:
    prog = "draftsmith export"
    return exit_code(prog, lambda: run_stage(parse_config(ExportConfig, args, prog=prog)))


def run_stage(cfg: ExportConfig) -> int:
    check_output(cfg.output, "output", head_dir, overwrite=cfg.overwrite)
    if cfg.num_speculative_tokens < 1:
        raise CheckpointError(
            f"num_speculative_tokens: {cfg.num_speculative_tokens}; give at least 1"
        )
    out = export_checkpoint(cfg)
    say(f"exported: {out}  ({serve_hint(out)})")
    if note := window_note(read_head_config(str(out))):
        say(f"export: {note}")
    return 0


def serve_hint(head_dir: Path) -> str:
    """How vLLM serves the exported head (its kind says)."""
    config = read_head_config(head_dir)
    method = drafters.head_method(config)
    kind = drafters.kind_of_method(method, config) if method else drafters.get("eagle3")
    return kind.serve_hint(head_dir, config)


if __name__ == "__main__":
    sys.exit(main())
