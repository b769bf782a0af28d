"""`draftsmith train`: the Lightning CLI over ``DraftModule`` and ``StatesDataModule``.

    draftsmith train fit --config configs/train/smollm2.yaml
    draftsmith train fit --config configs/train/smollm2.yaml --model.ttt_steps 3
    draftsmith train validate --config configs/train/smollm2.yaml --ckpt_path best.ckpt
    draftsmith train fit --config configs/train/smollm2.yaml --print_config

Beyond LightningCLI's own sections (``trainer``, ``model``, ``data``, ``optimizer`` is the
module's), ``checkpoint`` configures the ModelCheckpoint that keeps the best head by
simulated acceptance length and the last one (for resuming: ``--ckpt_path last``).
``trainer.strategy: fsdp`` or ``deepspeed`` with ``trainer.accelerator: cpu`` runs
Lightning's strategy on CPU processes over gloo (``strategies.py``).

SIGTERM (preemption) saves ``last.ckpt`` at the step reached and exits 143 with one line
saying how to resume (``preemption.py``); checkpoints are written atomically, and a full
disk ends in one line naming the path and the free space (``checkpoint_io.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from draftsmith import drafters
from draftsmith.core.config import parse_errors
from draftsmith.core.console import say, stage_log
from draftsmith.core.cores import avoid_busy_cores
from draftsmith.core.errors import ConfigError, exit_code
from draftsmith.core.outputs import CHECKPOINTS_OWN, TRAIN_ROOT_OWN, check_output
from draftsmith.train.checkpoint_io import save_atomically
from draftsmith.train.checkpoints import load_file
from draftsmith.train.data import StatesDataModule
from draftsmith.train.module import DraftModule, cli_signature
from draftsmith.train.preemption import SaveOnSigterm, exit_on_sigterm
from draftsmith.train.progress import ConsoleProgress
from draftsmith.train.resume import check_resume
from draftsmith.train.share_cores import RegainCores, ShareCores
from draftsmith.train.strategies import GPU_ONLY, cpu_strategy, runs_on_cpu

STRATEGIES = ("auto", "ddp", "ddp_spawn", "ddp_find_unused_parameters_true", "fsdp", "deepspeed")


# ``ckpt_path`` values Lightning resolves itself rather than reading as a path.
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")


def wandb_has_key() -> bool:
    netrc = Path.home() / ".netrc"
    return bool(os.environ.get("WANDB_API_KEY")) or (
        netrc.is_file() and "api.wandb.ai" in netrc.read_text()
    )


class TrainCLI(LightningCLI):
    """LightningCLI with draftsmith's defaults, early checks and a quiet console."""

    exit_stack: contextlib.ExitStack  # holds the stage log open until the run ends
    dry_run = False  # parse and check only: nothing is instantiated, written or run

    def setup_parser(self, *args: Any, **kwargs: Any) -> None:
        """The parser, with every drafter kind registered by now and its options."""
        with cli_signature():
            super().setup_parser(*args, **kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, then send this process's logs to ``<default_root_dir>/train.log``."""
        with warnings.catch_warnings():  # in-process calls (the pipeline) pass args on purpose
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            with parse_errors():
                super().parse_arguments(parser, args)
        if self.dry_run:
            return
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        root = Path(config.trainer.default_root_dir or ".")
        if config.trainer.default_root_dir:  # before the log file: nothing written yet
            check_output(root, "trainer.default_root_dir", TRAIN_ROOT_OWN, overwrite_flag=None)
        dirpath = config.get("checkpoint") and config.checkpoint.get("dirpath")
        if dirpath:
            check_output(dirpath, "checkpoint.dirpath", CHECKPOINTS_OWN, overwrite_flag=None)
        self.exit_stack.enter_context(stage_log(root / "train.log"))

    def _parse_ckpt_path(self) -> None:
        """LightningCLI would overwrite the ``model`` options given with the checkpoint's,
        silently. Here they are compared instead: an option that changes what is trained is
        refused in one line, one that may change is kept (``DraftModule.on_load_checkpoint``
        applies it and says so)."""
        subcommand = self.config.get("subcommand")
        ckpt_path = subcommand and self.config[subcommand].get("ckpt_path")
        if not ckpt_path or str(ckpt_path) in LIGHTNING_CKPT_NAMES:
            return  # "last" / "best": Lightning finds them, on_load_checkpoint checks them
        if not Path(ckpt_path).exists():
            raise ConfigError(
                f"ckpt_path: {ckpt_path} does not exist; give a checkpoint file (a run's "
                "checkpoints/last.ckpt or best.ckpt), a sharded checkpoint directory, or "
                "'last' to resume this run's own last checkpoint"
            )
        if not Path(ckpt_path).is_file():
            return  # a sharded directory: on_load_checkpoint checks it
        ckpt = load_file(Path(ckpt_path))
        saved = dict(ckpt.get("hyper_parameters") or {}) if isinstance(ckpt, dict) else {}
        model = self.config[subcommand].get("model")
        ours = model.as_dict() if hasattr(model, "as_dict") else dict(model or {})
        ours = {k: v for k, v in ours.items() if k != "__path__"}
        check_resume(saved, ours, {}, {})

    def instantiate_classes(self) -> None:
        if not self.dry_run:
            super().instantiate_classes()

    def _run_subcommand(self, subcommand: str) -> None:
        if not self.dry_run:
            super()._run_subcommand(subcommand)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        strategy = cpu_strategy(config.trainer.strategy, config.trainer.accelerator)
        if strategy is not None:  # Lightning's FSDP / DeepSpeed refuse CPU: their CPU stand-ins
            kwargs.setdefault("strategy", strategy)
        trainer = super().instantiate_trainer(**kwargs)
        save_atomically(trainer.strategy)  # no half last.ckpt on a full disk
        if self.subcommand == "fit":
            trainer.callbacks.append(ConsoleProgress())
            trainer.callbacks.append(SaveOnSigterm())
            if config.data.stream and runs_on_cpu(config.trainer.accelerator):
                trainer.callbacks.append(ShareCores(config.data.data))  # a producer beside it
            if (regain := getattr(self, "regain", None)) is not None:
                trainer.callbacks.append(regain)  # cores busy at the start, taken back when free
            waited = getattr(self.datamodule, "window_wait_s", 0.0)
            if waited >= 1.0 and (note := charge_wait(trainer, waited)):
                say(f"train: {note}")
        return trainer

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
            raise ConfigError(
                f"trainer.strategy: unknown strategy {strategy!r}; use one of {list(STRATEGIES)} "
                "or a class_path (e.g. lightning.pytorch.strategies.DeepSpeedStrategy with "
                "init_args.config: configs/deepspeed/zero2.json)"
            )
        class_path = getattr(strategy, "class_path", None)
        if class_path in GPU_ONLY and runs_on_cpu(config.trainer.accelerator):
            raise ConfigError(
                f"trainer.strategy: {class_path} runs on CUDA GPUs only; on CPU use class_path "
                f"{GPU_ONLY[class_path]} (same init_args), or trainer.accelerator: gpu"
            )
        check_sequence_parallel(config)
        if self.dry_run:  # the dataset is written by the stage before
            return
        if not config.data.data or not Path(config.data.data).is_dir():
            raise ConfigError(
                f"data.data: {config.data.data} is not a directory; run `draftsmith extract` "
                "first or point data.data at its output"
            )
        streamed = bool(config.data.stream)  # ShareCores sets the threads then
        if runs_on_cpu(config.trainer.accelerator) and strategy in ("auto", None) and not streamed:
            if note := avoid_busy_cores():  # one process: its threads keep off busy cores
                torch.set_num_threads(len(os.sched_getaffinity(0)))
                say(f"train: {note}")
                self.regain = RegainCores()  # ...until they are free again
        if not wandb_has_key():
            os.environ.setdefault("WANDB_MODE", "offline")  # logs stay local; `wandb sync` later
        loggers = config.trainer.logger
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            args = getattr(logger, "init_args", None)
            if args is not None and logger.class_path.endswith("WandbLogger") and not args.name:
                args.name = Path(str(config.config[0])).stem if config.get("config") else None


def check_sequence_parallel(config: Any) -> None:
    """``data.sequence_parallel`` against the processes and the kind, before anything starts
    (a dry run included): it must divide ``data.row_tokens`` and ``trainer.devices x
    trainer.num_nodes``, and the kind must split a row (``Drafter.sequence_halo``)."""
    size = config.data.get("sequence_parallel") or 1
    if size == 1:
        return
    row = config.data.get("row_tokens")
    if row and row % size:
        raise ConfigError(
            f"data.sequence_parallel: {size} does not divide data.row_tokens {row}; give "
            f"row_tokens a multiple of {size}"
        )
    devices, nodes = config.trainer.devices, config.trainer.num_nodes or 1
    if isinstance(devices, int) and devices > 0 and (devices * nodes) % size:
        raise ConfigError(
            f"data.sequence_parallel: {size} does not divide the {devices * nodes} processes "
            f"(trainer.devices x trainer.num_nodes); give a divisor of {devices * nodes}"
        )
    model = config.model.as_dict() if hasattr(config.model, "as_dict") else dict(config.model)
    kind = drafters.get(model.get("kind") or "eagle3")
    own = {f.name for f in dataclasses.fields(kind.Options)}
    if kind(kind.Options(**{k: v for k, v in model.items() if k in own})).sequence_halo() is None:
        raise ConfigError(
            f"data.sequence_parallel: {size}, but model.kind {kind.name} (with these options) "
            "cannot split a row across ranks; only serial TTT (eagle3) can: set it to 1"
        )


def charge_wait(trainer: Trainer, seconds: float) -> str | None:
    """Count ``seconds`` already spent waiting for a stream's first shards in
    ``trainer.max_time`` (its clock starts with the first step): a time budget is wall
    time. Returns a line saying so, or None without a time cap."""
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    if timer is None or timer._duration is None:  # Lightning keeps the cap there, in seconds
        return None
    timer._duration = max(timer._duration - seconds, 1.0)
    return f"waited {seconds:.0f} s for the stream's first shards; trainer.max_time counts them"


def main(args: list[str] | None = None) -> int:
    """Run ``draftsmith train <fit|validate> ...``; bad options (and a full disk) end in one
    line, exit 2; SIGTERM saves a checkpoint and ends in one line naming it, exit 143."""
    prog = "draftsmith train"
    return exit_code(prog, lambda: exit_on_sigterm(prog, lambda: run_stage(args)))


def check_section(section: dict[str, Any]) -> None:
    """Parse and check a ``fit`` section (the pipeline's train section) without instantiating
    or running anything, and without Lightning's seeding and banner lines."""
    loggers = [logging.getLogger(name) for name in ("lightning.fabric", "lightning.pytorch")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run_stage(section, dry_run=True)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def run_stage(args: list[str] | dict[str, Any] | None, dry_run: bool = False) -> int:
    """Run the LightningCLI on command-line ``args``, or on a config already in memory: a
    ``fit`` section (the pipeline's), or ``{"subcommand": ..., ...}``, parsed once, here.
    ``dry_run`` parses and checks it without instantiating or running anything."""
    if isinstance(args, dict) and "subcommand" not in args:
        args = {"subcommand": "fit", "fit": args}
    on_gpu = torch.cuda.is_available()
    with contextlib.ExitStack() as stack:
        TrainCLI.exit_stack, TrainCLI.dry_run = stack, dry_run
        cli = TrainCLI(
            DraftModule,
            StatesDataModule,
            args=args,
            trainer_defaults={
                "precision": "bf16-mixed" if on_gpu else "32-true",
                "use_distributed_sampler": False,  # StatesDataModule deals rows to ranks itself
                "log_every_n_steps": 10,
            },
            save_config_kwargs={"overwrite": True},
            parser_kwargs={
                "prog": "draftsmith train",
                "exit_on_error": False,  # one line, not the whole usage (parse_errors)
                **{cmd: {"exit_on_error": False} for cmd in ("fit", "validate")},
            },
            run=True,  # subcommands exist only then; a dry run stops before running one
        )
    if dry_run:
        return 0
    if cli.subcommand == "fit" and cli.trainer.is_global_zero:
        ckpt = cli.trainer.checkpoint_callback
        best = getattr(ckpt, "best_model_path", "") or "none"
        score = getattr(ckpt, "best_model_score", None)
        score_text = f" (val acceptance length {float(score):.3f})" if score is not None else ""
        say(f"train: {cli.trainer.global_step} steps; best checkpoint {best}{score_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
