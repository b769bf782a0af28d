"""The Lightning module that trains a draft head: the loop, whatever the drafter kind.

The kind (``model.kind``: a folder of ``draftsmith.drafters``) gives the head, its objective
and its validation walk (``drafters/protocol.py``); this module builds it once the dataset is
known, holds the frozen target tensors every objective shares (the teacher's final norm and
lm_head: the teacher is the target's own next-token distribution,
``softmax(lm_head(final_norm(layer N)))``, computed from the stored last-layer state, never
stored), logs, checkpoints and optimises. It never asks which kind it trains.

``model.*`` options: ``kind``, ``target`` and the optimiser's are this module's own; every
other one belongs to one or more kinds (``drafters.option_fields``) and is passed to the kind
as its ``Options``. The CLI's signature is built from the registry (``cli_signature``), so a
kind registered before ``draftsmith train`` runs brings its options with it.

The head itself is a plain ``nn.Module`` built in ``setup``, so that ``draftsmith export`` can
rebuild it from a checkpoint alone (``checkpoints.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import time
import typing
from collections.abc import Iterator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Timer
from torch import Tensor

from draftsmith import drafters
from draftsmith.core.console import say
from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import TargetInfo, read_target
from draftsmith.drafters.attention.sequence_parallel import SequenceShard, make_shard
from draftsmith.drafters.losses.acceptance import acceptance_from_counts
from draftsmith.drafters.protocol import TrainingData
from draftsmith.drafters.protocol.batch import PAD_DOC_ID
from draftsmith.drafters.target.weights import load_target_weights
from draftsmith.train.checkpoints import CHECKPOINT_KEY
from draftsmith.train.data import StatesDataModule
from draftsmith.train.resume import apply_changes, check_resume
from draftsmith.train.schedule import adamw_with_schedule


class DraftModule(pl.LightningModule):
    """Train a draft head of any registered kind for the target a dataset was extracted from.

    Args:
        kind: the drafter kind, named as vLLM's method: ``eagle3`` (fused low/mid/high states,
            reduced draft vocabulary; P-EAGLE with ``parallel_drafting``), ``eagle``
            (EAGLE-1: the target's final state, the target's lm_head) or ``dflash`` (a block
            drafted in one pass); any kind registered in ``draftsmith.drafters``.
        target: the target model (directory, hub id or short name); default: the dataset's.
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio * lr``.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        anneal_to_time_cap: with ``trainer.max_time`` set, the cosine follows whichever is
            further along, optimizer steps or the time cap, so a run the cap stops before
            ``max_epochs`` still ends at ``min_lr_ratio * lr`` (the demo stops this way).
        options: the kind's options (``drafters.option_fields``; ``--help`` lists them).
    """

    def __init__(
        self,
        kind: str = "eagle3",
        target: str | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        anneal_to_time_cap: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ConfigError(f"model.lr: {lr}; give a positive learning rate")
        self.drafter = drafters.make(kind, options)
        every = {name: spec[1] for name, spec in drafters.option_fields().items()}
        self.save_hyperparameters(
            {
                "kind": kind,
                "target": target,
                **every,
                **options,
                "lr": lr,
                "weight_decay": weight_decay,
                "warmup_steps": warmup_steps,
                "min_lr_ratio": min_lr_ratio,
                "anneal_to_time_cap": anneal_to_time_cap,
            }
        )
        self.head: torch.nn.Module | None = None
        self.sequence_shard: SequenceShard | None = None  # data.sequence_parallel > 1
        self.info: dict[str, Any] = {}  # what export needs: saved in every checkpoint
        self._val_seen: Tensor | None = None
        self._val_hit: Tensor | None = None
        self._last_batch_end: float | None = None

    # ----- building -------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Check dataset against target, build the head, fit it to the data."""
        if self.head is not None:
            return
        dm = self.trainer.datamodule if self._trainer is not None else None
        if not isinstance(dm, StatesDataModule):
            raise TypeError("DraftModule trains on a StatesDataModule (the `data:` section)")
        target = read_target(self.hparams.target or dm.target_path)
        dm.check_target(target)
        self.build(target, dm.aux_layer_ids, dm.teacher_layer_id, dm)
        if dm.sequence_parallel > 1:
            halo = self.drafter.sequence_halo()
            if halo is None:
                raise ConfigError(
                    f"data.sequence_parallel: {dm.sequence_parallel}, but model.kind "
                    f"{self.drafter.name} (with these options) cannot split a row across "
                    "ranks; only serial TTT (eagle3) can: set data.sequence_parallel 1"
                )
            self.sequence_shard = make_shard(dm.sequence_parallel, dm.row_tokens, halo)
        self.info.update(self.drafter.fit_to_data(self, target, dm))
        self.info["data"] = {
            "path": str(dm.data),
            "val_data": dm.val_data,
            "samples": len(dm.dataset),
            "tokens": int(dm.manifest.get("num_tokens", sum(dm.dataset.lengths))),
            "train_samples": len(dm.train_indices),
            "val_samples": len(dm.val_indices),
        }

    def build(
        self,
        target: TargetInfo,
        aux_layer_ids: list[int],
        teacher_layer_id: int,
        data: TrainingData | None = None,
    ) -> None:
        """Build the head for ``target`` and load the frozen target tensors it shares
        (``data``: the training data; None: the layer ids alone, nothing read from tokens)."""
        data = data or LayersOnly(aux_layer_ids, teacher_layer_id)
        weights = load_target_weights(target)
        built = self.drafter.build(target, data, weights)
        self.norm_eps = weights.norm_eps
        self.register_buffer("target_lm_head", weights.lm_head, persistent=False)
        self.register_buffer("target_norm", weights.norm, persistent=False)
        for name, tensor in built.buffers.items():
            self.register_buffer(name, tensor, persistent=False)
        self.head = built.head
        self.info.update(kind=self.drafter.name, target=target.path, **built.info)

    # ----- checkpoints ----------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if v.numel() == 1}
        checkpoint[CHECKPOINT_KEY] = {**self.info, "metrics": metrics}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.head is None:
            raise RuntimeError("load checkpoints through the trainer (ckpt_path) or export")
        saved = dict(checkpoint.get("hyper_parameters") or {})
        ours = dict(self.hparams)
        check_resume(saved, ours, checkpoint.get(CHECKPOINT_KEY) or {}, self.info)
        if note := apply_changes(checkpoint, saved, ours):
            say(f"train: {note}")
        self.drafter.restore(self.head, checkpoint.get("state_dict"))

    # ----- the objective --------------------------------------------------------------
    def teacher(self, batch: dict[str, Tensor]) -> Tensor:
        """Final-normed target states [B, T, H] (row p predicts token p+1)."""
        x = batch["teacher_states"].float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.target_norm
        return x.to(batch["teacher_states"].dtype)

    def on_before_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> Any:
        """Sequence parallelism: only this rank's share of the states moves to the device."""
        if self.sequence_shard is None:
            return batch
        decode = getattr(self.trainer.datamodule, "decoded", None)  # stored -> drafters' batch
        return self.sequence_shard.take(decode(batch) if decode else batch)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, out = self.drafter.loss(self, batch)
        logs = {
            "train/loss": loss,
            "train/acceptance_length": out.acceptance_length,
            "train/lr": self.optimizers().param_groups[0]["lr"],
        }
        for k in range(len(out.step_loss)):
            logs[f"train/loss_{k}"] = out.step_loss[k]
            logs[f"train/acc_{k}"] = out.step_accuracy[k]
        self.log_dict(logs, prog_bar=False, batch_size=batch["input_ids"].shape[0])
        self.log("loss", loss, prog_bar=True, logger=False)
        self._tokens = int((batch["doc_ids"] != PAD_DOC_ID).sum())
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Real (non-padding) tokens per second, batch end to batch end (data loading included)."""
        now = time.perf_counter()
        if self._last_batch_end is not None:
            share = self.sequence_shard.size if self.sequence_shard is not None else 1
            rows = self.trainer.world_size // share  # ranks sharing a row count it once
            rate = self._tokens * rows / max(now - self._last_batch_end, 1e-9)
            self.log("train/tokens_per_s", rate, prog_bar=True, rank_zero_only=True)
        self._last_batch_end = now

    def on_train_epoch_start(self) -> None:
        self._last_batch_end = None

    def on_validation_epoch_start(self) -> None:
        k = self.drafter.walk_length()
        self._val_seen = torch.zeros(k, dtype=torch.long, device=self.device)
        self._val_hit = torch.zeros(k, dtype=torch.long, device=self.device)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, out = self.drafter.loss(self, batch)
        logs = {"val/loss": loss}
        for k in range(len(out.step_loss)):
            logs[f"val/loss_{k}"] = out.step_loss[k]
            logs[f"val/acc_{k}"] = out.step_accuracy[k]
        self.log_dict(logs, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        self._val_seen += out.chain_seen.to(self.device)
        self._val_hit += out.chain_hit.to(self.device)

    def on_validation_epoch_end(self) -> None:
        """Simulated acceptance length: each validation response walked as vLLM drafts it
        (a chain of drafts, then the next chain after the accepted ones and the target's own
        token), with counts summed over every validation batch and rank; ``_k{k}`` reads the
        walk's first k positions."""
        seen, hit = self._val_seen, self._val_hit
        if self.trainer.world_size > 1:  # the ranks sharing a row hold its counts each
            share = self.sequence_shard.size if self.sequence_shard is not None else 1
            seen, hit = (self.all_gather(x).sum(0) // share for x in (seen, hit))
        for k in range(1, len(seen) + 1):
            al = acceptance_from_counts(seen[:k], hit[:k])
            self.log(f"val/acceptance_length_k{k}", al, rank_zero_only=True)
        full = acceptance_from_counts(seen, hit)
        self.log("val/acceptance_length", full, prog_bar=True, sync_dist=False)

    # ----- optimisation ---------------------------------------------------------------
    def total_steps(self) -> int:
        """Optimizer steps of the whole run, for the LR schedule. Counted from the packing
        rather than ``trainer.estimated_stepping_batches``, which builds the train loader
        before a checkpoint is restored and so loses the loader's mid-epoch position."""
        trainer = self.trainer
        if trainer.max_steps and trainer.max_steps > 0:
            return trainer.max_steps
        batches = trainer.datamodule.num_train_batches()
        if trainer.limit_train_batches is not None and isinstance(trainer.limit_train_batches, int):
            batches = min(batches, trainer.limit_train_batches)
        per_epoch = -(-batches // trainer.accumulate_grad_batches)
        epochs = max(trainer.max_epochs or 1, 1)
        cap = getattr(trainer.datamodule, "epochs_cap", None)  # a stream that drops shards: 1
        return per_epoch * (min(epochs, cap) if cap else epochs)

    def time_progress(self) -> float:
        """Fraction of ``trainer.max_time`` spent in fit so far; 0 without a time cap."""
        if not self.hparams.anneal_to_time_cap or self._trainer is None:
            return 0.0
        timer = next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)
        remaining = timer.time_remaining("train") if timer is not None else None
        if remaining is None:
            return 0.0
        elapsed = timer.time_elapsed("train")
        return min(elapsed / max(elapsed + remaining, 1e-9), 1.0)

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.head.parameters() if p.requires_grad]
        return adamw_with_schedule(
            params,
            lr=hp.lr,
            weight_decay=hp.weight_decay,
            warmup_steps=hp.warmup_steps,
            total_steps=self.total_steps(),
            min_lr_ratio=hp.min_lr_ratio,
            time_progress=self.time_progress,
        )


class LayersOnly:
    """Training data known by its layer ids alone (``DraftModule.build`` without a dataset)."""

    def __init__(self, aux_layer_ids: list[int], teacher_layer_id: int) -> None:
        self.aux_layer_ids, self.teacher_layer_id = aux_layer_ids, teacher_layer_id

    def train_token_counts(self, vocab_size: int) -> Tensor:
        raise ConfigError("this drafter choice reads the dataset's tokens; train with `data:`")


@contextlib.contextmanager
def cli_signature() -> Iterator[None]:
    """While the CLI builds its parser, give ``DraftModule`` the signature and docstring it
    reads: its own arguments, ``kind`` as a choice of the registered kinds, then every kind's
    options (typed, with defaults and docs). Lightning's ``save_hyperparameters`` reads the
    real signature (``**options``) again once the parser is built."""
    own = inspect.signature(DraftModule.__init__).parameters
    params = [p for p in own.values() if p.kind is not p.VAR_KEYWORD]
    params = [
        p.replace(annotation=Literal[tuple(drafters.names())]) if p.name == "kind" else p
        for p in params
    ]
    doc = [DraftModule.__doc__.split("        options:")[0].rstrip()]
    docs = drafters.option_docs()
    for name, (_, default, owners) in drafters.option_fields().items():
        hint = typing.get_type_hints(drafters.get(owners[0]).Options)[name]
        keyword = inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(name, keyword, default=default, annotation=hint))
        doc.append(f"        {name}: ({', '.join(owners)}) {docs.get(name, '')}")
    init = DraftModule.__init__
    saved = DraftModule.__doc__, init.__annotations__
    init.__signature__ = inspect.Signature(params)
    init.__annotations__ = {p.name: p.annotation for p in params if p.name != "self"}
    DraftModule.__doc__ = "\n".join(doc) + "\n"
    try:
        yield
    finally:
        del init.__signature__
        DraftModule.__doc__, init.__annotations__ = saved
