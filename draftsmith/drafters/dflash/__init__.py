"""DFlash: a few Qwen3-style layers that draft a whole block in one pass (``model.kind: dflash``).

- ``model.py``: the drafter, op for op what vLLM 0.32 serves as ``DFlashDraftModel``.
- ``blocks.py``: training blocks (anchors, block mask, slot targets, the weighted loss).
- ``objective.py``: the objective and the validation walk.
- ``export.py``: the directory vLLM serves with ``method: dflash``.
- ``replica.py``: an exported drafter drafting as vLLM serves it (eval's expected acceptance).

Mask token: ``vocab.choose_mask_token``. The mask slots' input vector is trained
(``mask_embedding.pt`` in the export) unless ``model.train_mask_embedding: false``; with the
default (null) it is trained unless the id is spare and the target's row of it is non-zero
(a zero row would make every mask slot's query zero, blind to its position).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from draftsmith.core.console import say
from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import TargetInfo, eos_ids
from draftsmith.drafters.attention.masks import check_window
from draftsmith.drafters.dflash.export import export_dflash
from draftsmith.drafters.dflash.model import DFlashDrafter, dflash_from_target
from draftsmith.drafters.dflash.objective import dflash_loss, target_layer_ids
from draftsmith.drafters.dflash.options import DFlashOptions
from draftsmith.drafters.headfiles.directory import check_block_taps
from draftsmith.drafters.losses.loss import TTTLoss
from draftsmith.drafters.protocol import Built, Drafter, Trainee, TrainingData
from draftsmith.drafters.protocol.batch import Batch
from draftsmith.drafters.target.vocab import choose_mask_token, draft_vocab
from draftsmith.drafters.target.weights import TargetWeights


class DFlash(Drafter):
    """DFlash block drafting (the DFlash paper; vLLM's ``method: dflash``)."""

    name = "dflash"
    title = "DFlash"
    Options = DFlashOptions
    methods = {"dflash": ("DFlashDraftModel",)}
    head_class = DFlashDrafter
    options: DFlashOptions

    def check_options(self) -> None:
        opt = self.options
        if opt.loss_decay_gamma is not None and opt.loss_decay_gamma <= 0:
            raise ConfigError(
                f"model.loss_decay_gamma: {opt.loss_decay_gamma}; give a positive decay (slot i "
                "weighs exp(-(i - 1) / gamma)) or null for the paper's choice"
            )
        check_window(opt.sliding_window, opt.block_size, "model.block_size",
                     "a block's last slot must still see the context")  # fmt: skip
        if opt.block_size < 2 or opt.num_anchors < 1:
            raise ConfigError(
                f"model.block_size {opt.block_size} / model.num_anchors {opt.num_anchors}: a "
                "block holds the anchor and at least one draft (block_size >= 2), "
                "num_anchors >= 1"
            )

    def build(self, target: TargetInfo, data: TrainingData, weights: TargetWeights) -> Built:
        opt = self.options
        ids = target_layer_ids(data.aux_layer_ids, target.num_hidden_layers)
        mask_id, spare = choose_mask_token(target, data, opt.mask_token_id)
        trained = opt.train_mask_embedding
        if trained is None:
            trained = not (spare and bool(weights.embed[mask_id].abs().sum() > 0))
        head = self.head_from_target(
            target.config,
            target_layer_ids=ids,
            mask_token_id=mask_id,
            num_layers=opt.num_layers,
            block_size=opt.block_size,
            train_mask_embedding=trained,
            sliding_window=opt.sliding_window,
            **self.head_options(),
        )
        head.set_embeddings(weights.embed)
        buffers = {}
        if opt.loss_vocab_size is not None:
            if not 0 < opt.loss_vocab_size <= target.vocab_size:
                raise ConfigError(
                    f"model.loss_vocab_size: {opt.loss_vocab_size}; give "
                    f"1..{target.vocab_size} (the target's vocabulary) or null for all of it"
                )
            counts = data.train_token_counts(target.vocab_size)
            kept = draft_vocab(counts, opt.loss_vocab_size, eos_ids(target.config))
            covered = counts[kept].sum().item() / max(counts.sum().item(), 1)
            buffers["loss_lm_head"] = weights.lm_head[kept]
            say(f"train: {self.title} loss over the {kept.numel():,} most frequent ids "
                f"({covered:.2%} of the loss tokens); drafting and validation over "
                "all ids")  # fmt: skip
        how = "spare id past the tokenizer" if spare else "an id unused in the responses"
        how = "model.mask_token_id" if opt.mask_token_id is not None else how
        say(f"train: {self.title} mask token {mask_id} ({how}), "
            f"{'trained' if trained else 'target'} embedding; target_layer_ids {ids}")  # fmt: skip
        info = {
            "head_kwargs": head.init_kwargs,
            "layer_ids": list(data.aux_layer_ids),
            "mask_token_id": mask_id,
            "mask_token_spare": spare,
        }
        return Built(head, buffers, info)

    def head_options(self) -> dict[str, Any]:
        """Head arguments beyond DFlash's own, from the options (DFlash2: its convolution
        and selector sizes)."""
        return {}

    def loss(self, trainee: Trainee, batch: Batch) -> tuple[Tensor, TTTLoss]:
        return dflash_loss(trainee, self.options, batch)

    def walk_length(self) -> int:
        return self.options.block_size - 1

    @classmethod
    def head_from_target(cls, target_config: dict[str, Any], **head_options: Any):
        return dflash_from_target(target_config, **head_options)

    @classmethod
    def export(cls, head, target, out_dir, **kwargs: Any) -> Path:
        return export_dflash(head, target, out_dir, **kwargs)

    @classmethod
    def check_head(
        cls, head: str, method: str, config: dict, shapes: dict[str, list[int]], target: TargetInfo
    ) -> None:
        ids = (config.get("dflash_config") or {}).get("target_layer_ids")
        check_block_taps(head, ids, "dflash_config.target_layer_ids", shapes, target)

    @classmethod
    def replica(cls, head_dir: str, method: str, target: TargetInfo):
        from draftsmith.drafters.dflash.replica import DFlashReplica

        return DFlashReplica(head_dir, target)

    @classmethod
    def serve_hint(cls, head_dir: Path, config: dict[str, Any]) -> str:
        """A DFlash drafter is given to the target's server (its config names no verifier)."""
        spec = f'{{"method": "dflash", "model": "{head_dir}", "num_speculative_tokens": K}}'
        return f"vllm serve TARGET --speculative-config '{spec}'"
