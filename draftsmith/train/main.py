"""`draftsmith train`: the Lightning CLI over ``DraftModule`` and ``EagleDataModule``.

    draftsmith train fit --config configs/train/smollm2.yaml
    draftsmith train fit --config configs/train/smollm2.yaml --model.ttt_steps 3
    draftsmith train validate --config configs/train/smollm2.yaml --ckpt_path best.ckpt
    draftsmith train fit --config configs/train/smollm2.yaml --print_config

Beyond LightningCLI's own sections (``trainer``, ``model``, ``data``, ``optimizer`` is the
module's), ``checkpoint`` configures the ModelCheckpoint that keeps the best head by
simulated acceptance length and the last one (for resuming: ``--ckpt_path last``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from draftsmith.train.data import EagleDataModule
from draftsmith.train.module import DraftModule

STRATEGIES = ("auto", "ddp", "ddp_spawn", "ddp_find_unused_parameters_true", "fsdp", "deepspeed")


def wandb_has_key() -> bool:
    netrc = Path.home() / ".netrc"
    return bool(os.environ.get("WANDB_API_KEY")) or (
        netrc.is_file() and "api.wandb.ai" in netrc.read_text()
    )


class TrainCLI(LightningCLI):
    """LightningCLI with draftsmith's defaults and early checks."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/acceptance_length",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.filename": "best",
                "checkpoint.auto_insert_metric_name": False,
            }
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        strategy = config.trainer.strategy
        if isinstance(strategy, str) and strategy not in STRATEGIES:
            raise ValueError(
                f"trainer.strategy: unknown strategy {strategy!r}; use one of {list(STRATEGIES)} "
                "or a class_path (e.g. lightning.pytorch.strategies.DeepSpeedStrategy with "
                "init_args.config: configs/deepspeed/zero2.json)"
            )
        if not Path(config.data.data).is_dir():
            raise FileNotFoundError(
                f"data.data: {config.data.data} is not a directory; run `draftsmith extract` "
                "first or point data.data at its output"
            )
        if not wandb_has_key():
            os.environ.setdefault("WANDB_MODE", "offline")  # logs stay local; `wandb sync` later
        loggers = config.trainer.logger
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            args = getattr(logger, "init_args", None)
            if args is not None and logger.class_path.endswith("WandbLogger") and not args.name:
                args.name = Path(str(config.config[0])).stem if config.get("config") else None


def main(args: list[str] | None = None) -> int:
    """Run ``draftsmith train <fit|validate> ...``; returns 0 (errors raise)."""
    on_gpu = torch.cuda.is_available()
    TrainCLI(
        DraftModule,
        EagleDataModule,
        args=args,
        trainer_defaults={
            "precision": "bf16-mixed" if on_gpu else "32-true",
            "use_distributed_sampler": False,  # EagleDataModule deals rows to ranks itself
            "log_every_n_steps": 10,
        },
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "draftsmith train"},
        run=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
