"""The Lightning module that trains a draft head with training-time test (TTT).

Per batch (keys in ``data.py``): the teacher is the target's own next-token distribution,
``softmax(lm_head(final_norm(layer N)))``, computed here from the stored last-layer state and
the target's frozen norm and lm_head, never stored. The head is unrolled ``ttt_steps`` times
(``ttt.py``); step k's loss is the soft cross-entropy (``loss: kl``), the total variation
(``tv``) or their blend against the teacher over the draft vocabulary (``loss.py``), weighted
``loss_decay**k``. EAGLE-1 adds a smooth-L1 regression of its output on the target's next
(final-normed) state, as in the EAGLE paper. ``init_from_target`` starts the head from the
target's top layers (``init.py``).

The head itself is a plain ``nn.Module`` (``heads.py``) built in ``setup`` once the dataset is
known, so that ``draftsmith export`` can rebuild it from a checkpoint alone (see ``checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Timer
from torch import Tensor

from draftsmith.core.console import say
from draftsmith.core.errors import ConfigError, DatasetError
from draftsmith.core.targets import TargetInfo, eos_ids, read_target
from draftsmith.drafters.acceptance import acceptance_from_counts, step_validity
from draftsmith.drafters.dflash.blocks import served_walk
from draftsmith.drafters.dflash.objective import (
    build_dflash,
    choose_mask_token,
    dflash_forward_loss,
)
from draftsmith.drafters.eagle3.parallel import peagle_forward_loss
from draftsmith.drafters.llama import from_target_config
from draftsmith.drafters.loss import LossKind, objective_weights, teacher_argmax, ttt_loss
from draftsmith.drafters.target_init import init_from_target
from draftsmith.drafters.target_weights import load_target_weights
from draftsmith.drafters.ttt import ttt_unroll
from draftsmith.train.data import EagleDataModule, draft_vocab
from draftsmith.train.packing import PAD_DOC_ID
from draftsmith.train.schedule import adamw_with_schedule

CHECKPOINT_KEY = "draftsmith"


def default_draft_vocab_size(vocab_size: int) -> int:
    """Full vocabulary up to 32k ids; 32k above (Llama-3's 128k, Qwen's 151k)."""
    return min(vocab_size, 32_000)


class DraftModule(pl.LightningModule):
    """Train an EAGLE-3, EAGLE-1 or DFlash head for the target a dataset was extracted from.

    Args:
        kind: ``eagle3`` (fused low/mid/high states, reduced draft vocabulary) or ``eagle``
            (EAGLE-1: the target's final state, the target's lm_head) or ``dflash`` (a block
            drafted in one pass, ``dflash_train.py``); vLLM's method names.
        target: the target model (directory, hub id or short name); default: the dataset's.
        num_layers: decoder layers in the head.
        ttt_steps: K, draft steps unrolled per batch (training-time test).
        loss_decay: step k's loss weight is ``loss_decay ** k``.
        loss: per-token objective against the teacher: ``kl`` (soft cross-entropy), ``tv``
            (total variation ``0.5 * sum |p_draft - p_teacher|``; a sampled draft token is
            accepted with probability 1 - TV) or ``kl_tv`` (``(1 - tv_weight) * kl +
            tv_weight * tv``).
        tv_weight: ``kl_tv``: the weight of TV, in [0, 1].
        draft_vocab_size: EAGLE-3 draft vocabulary: the most frequent loss-masked tokens of
            the dataset (EOS always kept). Default: the full vocabulary up to 32k ids, else 32k.
        train_lm_head: EAGLE-3: train the draft lm_head (it starts from the target's rows).
        init_from_target: start the draft's decoder layers as copies of the target's last
            ``num_layers`` layers, ``fc`` passing the deepest tapped layer through (EAGLE-1:
            the hidden half) and EAGLE-3's final norm as the target's; details in ``init.py``.
            Needs the head's hidden size to equal the target's. Default: random init.
        norm_before_fc: EAGLE-3: one RMSNorm over the fused tapped states before ``fc``
            (vLLM's ``norm_before_fc``, weight ``input_norm.weight``).
        fc_norm: EAGLE-3: one RMSNorm per tapped state before ``fc`` (vLLM's ``fc_norm``,
            weights ``fc_norm.{i}.weight``); after ``norm_before_fc`` when both are on.
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio * lr``.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        anneal_to_time_cap: with ``trainer.max_time`` set, the cosine follows whichever is
            further along, optimizer steps or the time cap, so a run the cap stops before
            ``max_epochs`` still ends at ``min_lr_ratio * lr`` (the demo stops this way).
        regression_weight: EAGLE-1: weight of the smooth-L1 feature loss.
        ce_weight: EAGLE-1: weight of the cross-entropy (the EAGLE paper uses 0.1).
        loss_chunk_size: tokens per chunk of logits in the loss (bounds peak memory).
        attention: TTT attention: ``auto`` (blockwise on CPU, efficient on GPU), ``blockwise``,
            ``efficient`` (SDPA; O(T) per step) or ``dense`` (reference).
        block_size: DFlash: slots per block, the anchor plus ``block_size - 1`` drafts (serve
            with ``num_speculative_tokens`` = block_size - 1).
        num_anchors: DFlash and P-EAGLE: blocks per packed row, anchored at random response
            tokens.
        mask_token_id: DFlash and P-EAGLE: the mask slots' token id; null: a spare id past
            the tokenizer, else one unused in the responses (``dflash_train.py``).
        train_mask_embedding: DFlash: learn the mask slots' input vector (exported as
            ``mask_embedding.pt``); null: unless the mask id is spare with a non-zero row.
        loss_decay_gamma: DFlash: slot i >= 1 weighs ``exp(-(i - 1) / gamma)``; null: the
            paper's 7 / 5 / 4 for block sizes 16 / 10 / 8 and below.
        parallel_drafting: EAGLE-3: train a P-EAGLE head that drafts all ``ttt_steps`` tokens
            in one pass (vLLM's ``parallel_drafting``; ``peagle.py``), with ``num_anchors`` mask
            blocks per row and the mask token chosen as for DFlash (``mask_token_id``).
        loss_vocab_size: DFlash: score the training loss over the most frequent loss-masked
            tokens only (EOS kept), like an EAGLE-3 draft vocabulary: the loss's cost falls
            with it. Drafting and validation still use the full vocabulary. Null: all ids.
    """

    def __init__(
        self,
        kind: Literal["eagle3", "eagle", "dflash"] = "eagle3",
        target: str | None = None,
        num_layers: int = 1,
        ttt_steps: int = 7,
        loss_decay: float = 0.8,
        loss: LossKind = "kl",
        tv_weight: float = 0.5,
        draft_vocab_size: int | None = None,
        train_lm_head: bool = True,
        init_from_target: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        anneal_to_time_cap: bool = True,
        regression_weight: float = 1.0,
        ce_weight: float = 0.1,
        loss_chunk_size: int = 1024,
        attention: Literal["auto", "blockwise", "efficient", "dense"] = "auto",
        block_size: int = 8,
        num_anchors: int = 128,
        mask_token_id: int | None = None,
        train_mask_embedding: bool | None = None,
        loss_decay_gamma: float | None = None,
        parallel_drafting: bool = False,
        loss_vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if ttt_steps < 1 or not 0 < loss_decay <= 1 or lr <= 0:
            raise ConfigError(
                f"model: need ttt_steps >= 1, 0 < loss_decay <= 1 and lr > 0; got "
                f"ttt_steps={ttt_steps}, loss_decay={loss_decay}, lr={lr}"
            )
        objective_weights(loss, tv_weight)  # refuses an unknown loss or a bad tv_weight
        for name, on in (("norm_before_fc", norm_before_fc), ("fc_norm", fc_norm)):
            if on and kind != "eagle3":
                raise ConfigError(
                    f"model.{name}: normalises EAGLE-3's fused tapped states; set it false "
                    f"for model.kind {kind}"
                )
        if loss_vocab_size is not None and kind != "dflash":
            raise ConfigError(
                f"model.loss_vocab_size: restricts DFlash's loss; model.kind {kind} has "
                "model.draft_vocab_size instead. Set loss_vocab_size null"
            )
        if parallel_drafting and kind != "eagle3":
            raise ConfigError(
                f"model.parallel_drafting: P-EAGLE drafts with an EAGLE-3 head; set model.kind "
                f"eagle3 (got {kind}) or parallel_drafting false"
            )
        self.save_hyperparameters()
        self.head: torch.nn.Module | None = None
        self.info: dict[str, Any] = {}  # what export needs: saved in every checkpoint
        self._val_seen: Tensor | None = None
        self._val_hit: Tensor | None = None
        self._last_batch_end: float | None = None

    # ----- building -------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Check dataset against target, build the head, pick the draft vocabulary."""
        if self.head is not None:
            return
        dm = self.trainer.datamodule if self._trainer is not None else None
        if not isinstance(dm, EagleDataModule):
            raise TypeError("DraftModule trains on an EagleDataModule (the `data:` section)")
        target = read_target(self.hparams.target or dm.target_path)
        dm.check_target(target)
        if self.hparams.kind == "dflash":
            build_dflash(self, target, dm)
        else:
            mask_id = None
            if self.hparams.parallel_drafting:
                mask_id, spare = choose_mask_token(target, dm, self.hparams.mask_token_id)
                how = "a spare id past the tokenizer" if spare else "an id unused in the responses"
                say(f"train: P-EAGLE mask token {mask_id} ({how}), trained mask_hidden")
            self.build(target, dm.aux_layer_ids, dm.teacher_layer_id, mask_id)
        if self.hparams.kind == "eagle3":
            counts = dm.train_token_counts(target.vocab_size)
            ids = draft_vocab(counts, self.head.draft_vocab_size, eos_ids(target.config))
            self.set_draft_vocab(ids)
            covered = counts[ids].sum().item() / max(counts.sum().item(), 1)
            self.info["draft_vocab_coverage"] = round(covered, 6)
            say(
                f"train: draft vocabulary of {ids.numel():,} ids covers {covered:.2%} of the "
                "loss tokens"
            )
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
        mask_token_id: int | None = None,
    ) -> None:
        """Build the head for ``target`` and load the frozen target tensors it shares
        (``mask_token_id``: P-EAGLE's mask slots)."""
        kind = self.hparams.kind
        n = target.num_hidden_layers
        if kind == "eagle" and aux_layer_ids != [n]:
            raise DatasetError(
                f"data.aux_layers: EAGLE-1 reads the target's last layer only; set "
                f"data.aux_layers [{n}] (got {aux_layer_ids})"
            )
        if kind == "eagle3" and teacher_layer_id in aux_layer_ids:
            raise DatasetError(f"data.aux_layers: {aux_layer_ids} must not include layer {n}")
        vocab = target.vocab_size
        hp = self.hparams
        options: dict[str, Any] = {"num_layers": hp.num_layers}
        if kind == "eagle3":
            size = (
                default_draft_vocab_size(vocab)
                if hp.draft_vocab_size is None
                else hp.draft_vocab_size
            )
            if size < 1:
                raise ConfigError(
                    f"model.draft_vocab_size: {size}; give a positive size or null (the "
                    f"target's vocabulary up to {default_draft_vocab_size(vocab):,} ids)"
                )
            if size > vocab:  # a draft vocabulary larger than the target's is the target's
                say(f"train: model.draft_vocab_size {size} > the target's vocabulary {vocab}: "
                    f"using all {vocab} ids")  # fmt: skip
                size = vocab
            options.update(draft_vocab_size=size, num_aux_states=len(aux_layer_ids))
            options.update(norm_before_fc=hp.norm_before_fc, fc_norm=hp.fc_norm)
            if hp.parallel_drafting:
                options.update(parallel_drafting=True, mask_token_id=mask_token_id)
        head = from_target_config(target.config, kind, **options)
        weights = load_target_weights(target)
        head.set_embeddings(weights.embed)
        if kind == "eagle":
            head.set_lm_head(weights.lm_head)
        if hp.init_from_target:
            self.info["init_from_target_layers"] = init_from_target(head, target, weights.norm)
        self.norm_eps = weights.norm_eps
        self.register_buffer("target_lm_head", weights.lm_head, persistent=False)
        self.register_buffer("target_norm", weights.norm, persistent=False)
        self.head = head
        self.info.update(
            kind=kind,
            target=target.path,
            head_kwargs=head.init_kwargs,
            layer_ids=aux_layer_ids if kind == "eagle3" else None,
        )

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Use ``target_ids`` as the draft vocabulary; the draft lm_head starts from their
        target rows (and stays frozen unless ``train_lm_head``)."""
        self.head.set_draft_vocab(target_ids)
        with torch.no_grad():
            self.head.lm_head.weight.copy_(self.target_lm_head[target_ids.to(self.device)])
        self.head.lm_head.weight.requires_grad_(self.hparams.train_lm_head)

    # ----- checkpoints ----------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if v.numel() == 1}
        checkpoint[CHECKPOINT_KEY] = {**self.info, "metrics": metrics}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.head is None:
            raise RuntimeError("load checkpoints through the trainer (ckpt_path) or export")
        if self.hparams.kind != "eagle3":
            return
        state = checkpoint.get("state_dict")
        if state is None:  # FSDP / DeepSpeed loaded the weights and d2t themselves: redo t2d
            d2t = self.head.d2t
            self.head.set_draft_vocab(d2t + torch.arange(d2t.numel(), device=d2t.device))
        elif "head.d2t" in state:  # (a full-vocabulary head stores no d2t)
            d2t = state["head.d2t"]
            self.set_draft_vocab(d2t + torch.arange(d2t.numel(), device=d2t.device))

    # ----- the objective --------------------------------------------------------------
    def teacher(self, batch: dict[str, Tensor]) -> Tensor:
        """Final-normed target states [B, T, H] (row p predicts token p+1)."""
        x = batch["teacher_states"].float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.target_norm
        return x.to(batch["teacher_states"].dtype)

    def forward_loss(self, batch: dict[str, Tensor], full_vocab_top1: bool):
        """TTT unroll + loss; returns (total loss, ``TTTLoss``)."""
        if self.hparams.kind == "dflash":  # blocks of slots instead of steps
            return dflash_forward_loss(self, batch)
        if self.hparams.parallel_drafting:  # P-EAGLE: one pass drafts every position
            return peagle_forward_loss(self, batch, full_vocab_top1)
        hp, head = self.hparams, self.head
        teacher = self.teacher(batch)
        states = batch["aux_states"]
        if hp.kind == "eagle":
            states = teacher  # EAGLE-1 reads the target's final-normed state
        steps = ttt_unroll(
            head, batch["input_ids"], states, batch["position_ids"], batch["doc_ids"],
            hp.ttt_steps, hp.attention,
        )  # fmt: skip
        if hp.kind == "eagle3":
            ids = head.draft_to_target(torch.arange(head.draft_vocab_size, device=self.device))
            teacher_weight, to_draft = self.target_lm_head[ids], head.target_to_draft_index()
        else:
            teacher_weight, to_draft = self.target_lm_head, None
        top1 = None
        if full_vocab_top1:  # accuracy as vLLM judges it: the target's argmax over all ids
            top1 = teacher_argmax(teacher, self.target_lm_head, to_draft, hp.loss_chunk_size)
        out = ttt_loss(
            steps, head.logits_weight, teacher, teacher_weight, batch["loss_mask"],
            batch["doc_ids"], top1, hp.loss_decay, hp.loss_chunk_size,
            loss=hp.loss, tv_weight=hp.tv_weight,
        )  # fmt: skip
        if not self.training:  # the acceptance vLLM serves: chains where the last one ended
            accepted = torch.zeros_like(batch["input_ids"])
            accepted[:, 1:] = out.stream_accepted[:, :-1]  # stream t's bonus token is x_{t+1}
            seen, hit = served_walk(accepted, batch["loss_mask"], batch["doc_ids"], hp.ttt_steps)
            out = dataclasses.replace(
                out,
                chain_seen=seen,
                chain_hit=hit,
                acceptance_length=acceptance_from_counts(seen, hit),
            )
        loss = out.loss
        if hp.kind == "eagle":
            loss = hp.ce_weight * loss + hp.regression_weight * self.regression(
                steps, teacher, batch
            )
        return loss, out

    def regression(self, steps: list[Tensor], teacher: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """EAGLE-1: smooth-L1 of step k's output at t on the target state at t+k+1."""
        total = teacher.new_zeros((), dtype=torch.float32)
        for k, out in enumerate(steps):
            valid = step_validity(batch["loss_mask"], batch["doc_ids"], k)  # [B, T]
            b, t = valid.nonzero(as_tuple=True)
            if b.numel():
                err = F.smooth_l1_loss(out[b, t].float(), teacher[b, t + k + 1].float())
                total = total + self.hparams.loss_decay**k * err
        return total

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, out = self.forward_loss(batch, full_vocab_top1=False)
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
            rate = self._tokens * self.trainer.world_size / max(now - self._last_batch_end, 1e-9)
            self.log("train/tokens_per_s", rate, prog_bar=True, rank_zero_only=True)
        self._last_batch_end = now

    def on_train_epoch_start(self) -> None:
        self._last_batch_end = None

    def on_validation_epoch_start(self) -> None:
        hp = self.hparams
        k = hp.block_size - 1 if hp.kind == "dflash" else hp.ttt_steps
        self._val_seen = torch.zeros(k, dtype=torch.long, device=self.device)
        self._val_hit = torch.zeros(k, dtype=torch.long, device=self.device)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, out = self.forward_loss(batch, full_vocab_top1=True)
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
        if self.trainer.world_size > 1:
            seen, hit = self.all_gather(seen).sum(0), self.all_gather(hit).sum(0)
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
        return per_epoch * max(trainer.max_epochs or 1, 1)

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
